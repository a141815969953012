"""`b70ctl model stage`: everything the model_store role does on the controller, for every recipe of a play, as
one document.

For each distinct recipe the play's hosts name: fetch (or generate) its models into DEST_ROOT/<recipe name>,
verified against the lock; refuse a drafter made for another target (another vocabulary: vLLM would load it and
accept nothing, or crash on the first draft) before anything reaches a host; convert the drafter where the
recipe's vLLM needs it (hard links, O(1) in model size); and describe, file by file, what a host of that recipe
receives. The role then picks its recipe's entry by the name its inventory gives: it builds nothing itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from b70ctl.documents import Document
from b70ctl.files import read_json_object
from b70ctl.lock.model import load_recipe_and_lock
from b70ctl.models.convert import convert, target_text_config
from b70ctl.models.fetch import FetchResult, Source, fetch
from b70ctl.models.manifest import Manifest, directory_manifest

CONVERTED_DIR = "drafter-converted"


class Install(Document):
    """One directory a host receives: `name` under the host's store, the controller's copy and its files."""
    name: Literal["target", "drafter"]
    manifest: Manifest


class StagedRecipe(Document):
    name: str
    fetched: FetchResult  # what `b70ctl model record` turns into a host's models.json
    refused: str | None = None  # why the drafter cannot serve with this target; then nothing is installed
    installs: list[Install]


class StagedModels(Document):
    """Keyed by the recipe as the inventory names it (b70_recipe: a name or a file)."""
    recipes: dict[str, StagedRecipe]


def foreign_drafter(target: Path, drafter: Path) -> str | None:
    """Why DRAFTER cannot draft for TARGET (their vocabularies differ), or None. The target's vocabulary is read
    from its text config, as vLLM reads it (a composite config such as Qwen3.5's nests it)."""
    fix = "restore the model's config.json"
    target_config = read_json_object(target / "config.json", f"target {target}/config.json", fix)
    drafter_config = read_json_object(drafter / "config.json", f"drafter {drafter}/config.json", fix)
    target_vocab = target_text_config(target_config).get("vocab_size")
    drafter_vocab = drafter_config.get("vocab_size")
    if drafter_vocab == target_vocab:
        return None
    return (f"the drafter {drafter} has vocab_size {drafter_vocab}, the target {target_vocab}: it is a drafter of "
            "another model. Fix: point the recipe's drafter at the drafter trained for this target.")


def stage(recipes: list[str], dest_root: Path, source: Source = "hub", source_dir: Path | None = None) -> StagedModels:
    staged: dict[str, StagedRecipe] = {}
    for name_or_path in dict.fromkeys(recipes):  # each recipe once, in the order the play names them
        recipe, lock, _ = load_recipe_and_lock(name_or_path)
        dest = dest_root / recipe.name
        fetched = fetch(recipe, lock, dest, source, source_dir)
        installs = [Install(name="target", manifest=directory_manifest(dest / "target"))]
        refused = None
        if recipe.drafter is not None:  # an ngram recipe drafts from the prompt: it has no drafter to send
            refused = foreign_drafter(dest / "target", dest / "drafter")
            drafter = dest / "drafter"
            # Native dspark (vLLM >= 0.25) reads the drafter's config in its own layout; route a's patched vLLM
            # 0.21 reads the drafter as published.
            if refused is None and recipe.drafter.needs_conversion:
                drafter = dest / CONVERTED_DIR
                convert(dest / "drafter", drafter, recipe.vllm_version, dest / "target",
                        lock.drafter.revision if lock.drafter is not None else None, recipe)
            installs = [] if refused else installs + [Install(name="drafter", manifest=directory_manifest(drafter))]
        staged[name_or_path] = StagedRecipe(name=recipe.name, fetched=fetched, refused=refused, installs=installs)
    return StagedModels(recipes=staged)
