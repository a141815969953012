"""`b70ctl model ...`: fetch the locked models, fill a controller-side cache, convert a DSpark drafter, describe
what a host receives (manifest), all three for every recipe of a play (stage), and what a host's store holds
(record)."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from b70ctl.choices import choice_option
from b70ctl.errors import BadInput
from b70ctl.lock.model import load_recipe_and_lock
from b70ctl.options import json_option, print_json
from b70ctl.recipes import load_recipe

if TYPE_CHECKING:  # the fetch module is imported by the commands that use it
    from b70ctl.models.fetch import FetchResult

app = typer.Typer(no_args_is_help=True, help="Model store: fetch (verified), cache, convert.")


class FetchSource(str, Enum):
    hub = "hub"  # download from the Hugging Face hub (HF_ENDPOINT)
    cache = "cache"  # a Hugging Face cache the controller filled (b70ctl model cache)
    local = "local"  # a directory holding target/ and drafter/

RecipeOption = Annotated[str, typer.Option("--recipe", help="Recipe name or path to a recipe file")]
LockOption = Annotated[Path | None, typer.Option("--lock", help="Lock file (default: beside the recipe)")]
JsonOption = Annotated[bool, json_option("Print JSON (with `changed`)")]



def _out() -> Console:
    return Console(highlight=False, markup=False, soft_wrap=True)


def _show_fetch(result: FetchResult, as_json: bool) -> None:
    if as_json:
        print_json(result.model_dump(mode="json"))
        return
    out = _out()
    for model in result.models:
        actions: dict[str, int] = {}
        for file in model.files:
            actions[file.action] = actions.get(file.action, 0) + 1
        done = ", ".join(f"{count} {action}" for action, count in sorted(actions.items())) or "no files"
        revision = f"@{model.revision[:12]}" if model.revision else ""
        out.print(f"{model.role}{revision}: {model.path} ({done}){'' if model.changed else ', unchanged'}")
    for failure in result.quarantined:
        out.print(f"  FAILED {failure.role}/{failure.path}: {failure.reason}"
                  + (f" (quarantined at {failure.quarantined_at})" if failure.quarantined_at else ""))
    out.print(f"{result.recipe} from {result.source} into {result.dest}: "
              f"{'changed' if result.changed else 'unchanged'}")


@app.command("fetch")
def fetch_command(
    recipe: RecipeOption,
    dest: Annotated[Path, typer.Option("--dest", help="Directory to hold target/ and drafter/")],
    source: Annotated[str, choice_option(FetchSource, "--source", "Where the files come from")] = "hub",
    source_dir: Annotated[Path | None, typer.Option(
        "--source-dir", help="The cache (Hugging Face cache layout) or local directory (target/, drafter/)")] = None,
    lock: LockOption = None,
    as_json: JsonOption = False,
) -> None:
    """Download (or link from a cache/local source) the target and drafter at the LOCKED revision, verify every
    file's sha256, quarantine mismatches."""
    from b70ctl.models.fetch import FetchFailed, fetch

    loaded, locked, _ = load_recipe_and_lock(recipe, lock)
    try:
        result = fetch(loaded, locked, dest, source, source_dir)  # type: ignore[arg-type]
    except FetchFailed as failed:
        _show_fetch(failed.result, as_json)
        raise
    _show_fetch(result, as_json)


@app.command("cache")
def cache_command(
    recipe: RecipeOption,
    cache_dir: Annotated[Path, typer.Option("--cache-dir", help="Hugging Face cache directory to fill")],
    lock: LockOption = None,
    as_json: Annotated[bool, json_option()] = False,
) -> None:
    """Controller side: download the locked files once into a cache that hosts fetch from (--source cache)."""
    from b70ctl.models.fetch import fill_cache

    _, locked, _ = load_recipe_and_lock(recipe, lock)
    result = fill_cache(locked, cache_dir)
    if as_json:
        print_json(result)
        return
    out = _out()
    for name in result["files"]:
        out.print(f"  verified {name}")
    out.print(f"{len(result['files'])} locked file(s) verified in the cache {result['cache_dir']}")


@app.command("convert")
def convert_command(
    src: Annotated[Path, typer.Argument(help="The drafter as downloaded")],
    dst: Annotated[Path, typer.Argument(help="Where to write the servable drafter (same filesystem as SRC)")],
    target: Annotated[Path | None, typer.Option(
        "--target", help="The target model's directory (default: SRC/../target, the fetch layout)")] = None,
    vllm_version: Annotated[str | None, typer.Option(
        "--vllm-version", help="vLLM that will serve it (default: the recipe's)")] = None,
    recipe: Annotated[str | None, typer.Option("--recipe", help="Recipe: default vLLM version, "
                                                  "and the source revision from its lock")] = None,
    as_json: JsonOption = False,
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
    result = convert(src, dst, vllm_version, target, source_revision, load_recipe(recipe) if recipe else None)
    if as_json:
        print_json(result)
        return
    out = _out()
    for change in result["changes"]:
        out.print(f"  {change}")
    out.print(f"{result['dst']}: servable by vLLM {result['vllm_version']}, "
              f"{'written' if result['changed'] else 'unchanged'}")


@app.command("manifest")
def manifest_command(
    directories: Annotated[list[Path], typer.Argument(help="Model directories a host receives")],
    as_json: Annotated[bool, json_option()] = False,
) -> None:
    """Every file in each DIRECTORY with its size and sha256: what a host's copy must hold. Hashes fetch
    verified are reused, so a directory of fetched weights is described without reading them."""
    from b70ctl.models.manifest import directory_manifest

    manifests = [directory_manifest(directory) for directory in directories]
    if as_json:
        print_json({"manifests": [manifest.model_dump(mode="json") for manifest in manifests]})
        return
    for manifest in manifests:
        total = sum(file.size_bytes for file in manifest.files)
        typer.echo(f"{manifest.directory}: {len(manifest.files)} file(s), {total} bytes "
                   f"({manifest.hashed_bytes} bytes hashed)")


@app.command("stage")
def stage_command(
    recipes: Annotated[list[str], typer.Argument(help="The recipes (name or file) the play's hosts serve, as their "
                                                       "inventory names them; repeats are staged once")],
    dest_root: Annotated[Path, typer.Option("--dest-root", help="The controller's model cache: each recipe's "
                                                                "models go into DEST_ROOT/<recipe name>")],
    source: Annotated[str, choice_option(FetchSource, "--source", "Where the files come from")] = "hub",
    source_dir: Annotated[Path | None, typer.Option(
        "--source-dir", help="The cache (Hugging Face cache layout) or local directory (target/, drafter/)")] = None,
    as_json: Annotated[bool, json_option("Print the staged models as JSON, keyed by RECIPE as given")] = False,
) -> None:
    """The model_store role's controller side, for every recipe of a play: fetch (or generate) and verify each
    recipe's models, refuse a drafter of another model, convert the drafter where the recipe's vLLM needs it, and
    describe what each host receives. A refused drafter exits 1; with --json it is its recipe's `refused` and the
    exit is 0, so that a play fails only the hosts that serve that recipe."""
    from b70ctl.models.stage import stage

    staged = stage(recipes, dest_root, source, source_dir)  # type: ignore[arg-type]
    if as_json:
        sys.stdout.write(staged.model_dump_json(indent=2) + "\n")
        return
    for key, entry in staged.recipes.items():
        if entry.refused:
            typer.echo(f"{key}: REFUSED: {entry.refused}")
        for install in entry.installs:
            total = sum(file.size_bytes for file in install.manifest.files)
            typer.echo(f"{key}: {install.name} from {install.manifest.directory}: "
                       f"{len(install.manifest.files)} file(s), {total} bytes")
    if any(entry.refused for entry in staged.recipes.values()):
        raise typer.Exit(1)


@app.command("record")
def record_command(
    store_dir: Annotated[str, typer.Option(help="The host's model store directory (target/ and drafter/ below it)")],
    as_json: Annotated[bool, json_option("Print models.json as the host stores it")] = False,
) -> None:
    """/etc/b70/models.json of a host from `b70ctl model fetch --json` on stdin: each model's directory in the
    host's store and the revision the fetch placed."""
    from pydantic import ValidationError

    from b70ctl.errors import first_problem
    from b70ctl.models.fetch import FetchResult
    from b70ctl.models.record import models_record

    try:
        fetched = FetchResult.model_validate_json(sys.stdin.read())
    except ValidationError as error:
        raise BadInput(f"stdin: {first_problem(error)}: pipe in the output of `b70ctl model fetch --json`") from error
    record = models_record(fetched, store_dir)
    if as_json:
        sys.stdout.write(record.model_dump_json(indent=2) + "\n")
        return
    for role, stored in (("target", record.target), ("drafter", record.drafter)):
        if stored is not None:
            typer.echo(f"{role}: {stored.path} @ {stored.revision or 'no revision'}")
