"""`b70ctl model ...`: fetch the locked models, fill a controller-side cache, convert a DSpark drafter."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from b70ctl.errors import BadInput
from b70ctl.lock.model import load_recipe_and_lock
from b70ctl.recipes import load_recipe

app = typer.Typer(no_args_is_help=True, help="Model store: fetch (verified), cache, convert.")

RecipeOption = Annotated[str, typer.Option("--recipe", help="Recipe name or path to a recipe file")]
LockOption = Annotated[Optional[Path], typer.Option("--lock", help="Lock file (default: beside the recipe)")]


def _print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command("fetch")
def fetch_command(
    recipe: RecipeOption,
    dest: Annotated[Path, typer.Option("--dest", help="Directory to hold target/ and drafter/")],
    source: Annotated[str, typer.Option("--source", help="hub | cache | local")] = "hub",
    source_dir: Annotated[Optional[Path], typer.Option(
        "--source-dir", help="The cache (Hugging Face cache layout) or local directory (target/, drafter/)")] = None,
    lock: LockOption = None,
) -> None:
    """Download (or link from a cache/local source) the target and drafter at the LOCKED revision, verify every
    file's sha256, quarantine mismatches. Prints JSON with `changed`."""
    from b70ctl.models.fetch import FetchFailed, fetch

    if source not in ("hub", "cache", "local"):
        raise BadInput(f"--source {source!r}: choose hub, cache or local")
    loaded, locked, _ = load_recipe_and_lock(recipe, lock)
    try:
        result = fetch(loaded, locked, dest, source, source_dir)  # type: ignore[arg-type]
    except FetchFailed as failed:
        _print_json(failed.result.model_dump(mode="json"))
        raise
    _print_json(result.model_dump(mode="json"))


@app.command("cache")
def cache_command(
    recipe: RecipeOption,
    cache_dir: Annotated[Path, typer.Option("--cache-dir", help="Hugging Face cache directory to fill")],
    lock: LockOption = None,
) -> None:
    """Controller side: download the locked files once into a cache that hosts fetch from (--source cache)."""
    from b70ctl.models.fetch import fill_cache

    _, locked, _ = load_recipe_and_lock(recipe, lock)
    _print_json(fill_cache(locked, cache_dir))


@app.command("convert")
def convert_command(
    src: Annotated[Path, typer.Argument(help="The drafter as downloaded")],
    dst: Annotated[Path, typer.Argument(help="Where to write the servable drafter (same filesystem as SRC)")],
    target: Annotated[Optional[Path], typer.Option(
        "--target", help="The target model's directory (default: SRC/../target, the fetch layout)")] = None,
    vllm_version: Annotated[Optional[str], typer.Option(
        "--vllm-version", help="vLLM that will serve it (default: the recipe's)")] = None,
    recipe: Annotated[Optional[str], typer.Option("--recipe", help="Recipe: default vLLM version, "
                                                  "and the source revision from its lock")] = None,
) -> None:
    """Make a DSpark drafter servable by native vLLM: rename the architecture, hoist the fields vLLM reads
    top-level, validate against the target, hard-link the weights, write provenance. Re-running is a no-op."""
    from b70ctl.models.convert import convert

    source_revision = None
    if recipe is not None:
        loaded = load_recipe(recipe)
        vllm_version = vllm_version or loaded.vllm_version
        try:
            _, locked, _ = load_recipe_and_lock(recipe)
            if locked.drafter is not None:
                source_revision = locked.drafter.revision
        except BadInput:
            source_revision = None
    if vllm_version is None:
        raise BadInput("no vLLM version: give --vllm-version V or --recipe NAME")
    if target is None:
        target = src.parent / "target"
        if not (target / "config.json").is_file():
            raise BadInput(f"no target beside {src} ({target}/config.json): give --target DIR, the drafter is "
                           "checked against the target it will draft for")
    _print_json(convert(src, dst, vllm_version, target, source_revision))
