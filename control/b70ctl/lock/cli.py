"""`b70ctl lock ...`: resolve, show the appliance hash, check a host against the lock."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from b70ctl.errors import BadInput
from b70ctl.lock.check import check_installed
from b70ctl.lock.model import appliance_hash, load_recipe_and_lock
from b70ctl.lock.registry import DIGEST_PATTERN
from b70ctl.lock.resolve import resolve_and_write
from b70ctl.options import JsonOption, print_json

app = typer.Typer(no_args_is_help=True, help="The lock: what each recipe resolves to, pinned.")
console = Console(stderr=True)

RecipeOption = Annotated[str, typer.Option("--recipe", help="Recipe name or path to a recipe file")]
MaybeRecipeOption = Annotated[str | None, typer.Option("--recipe", help="Recipe name or path to a recipe file")]
HostPackagesOption = Annotated[bool, typer.Option(
    "--host-packages", help="The host package lock (every .deb the roles install) instead of a recipe's lock")]
PackagesLockOption = Annotated[Path | None, typer.Option(
    "--packages-lock", help="Host package lock file (default: control/b70ctl/host/packages.lock.json)")]
SeriesOption = Annotated[list[str] | None, typer.Option(
    "--series", help="Release codename (repeat for several); default: every release of the package set")]
GroupOption = Annotated[list[str] | None, typer.Option(
    "--group", help="kernel, gpu_runtime or container_engine (repeat); default: every group the lock has")]
LockOption = Annotated[Path | None, typer.Option("--lock", help="Lock file (default: beside the recipe)")]



@app.command("resolve")
def resolve_command(
    recipe: MaybeRecipeOption = None,
    lock: LockOption = None,
    host_packages: HostPackagesOption = False,
    package_set: Annotated[Path | None, typer.Option(
        "--package-set", help="Package set (YAML or JSON) to resolve instead of the release matrix's")] = None,
    packages_lock: PackagesLockOption = None,
    series: SeriesOption = None,
    registry_url: Annotated[str | None, typer.Option(
        "--registry-url", help="Ask this registry base URL for every image (mirror; tests)")] = None,
    offline: Annotated[bool, typer.Option(
        "--offline", help="Ask no hub or registry: pin local inputs, keep unchanged network pins")] = False,
    as_json: JsonOption = False,
) -> None:
    """Ask the hub (HF_ENDPOINT) and the registry what the recipe points at now and write the lock; with
    --host-packages, read the apt indexes of each release and lock every .deb the roles install there."""
    if host_packages:
        from b70ctl.lock.debs_cli import resolve_host_packages

        resolve_host_packages(package_set, packages_lock, series or [], as_json)
        return
    if recipe is None:
        raise BadInput("say what to resolve: --recipe NAME (a recipe's lock) or --host-packages (the host package "
                       "lock)")
    loaded, outcome = resolve_and_write(recipe, lock_path=lock, registry_url=registry_url, offline=offline)
    result = outcome.as_json(loaded)
    if as_json:
        print_json(result)
    else:
        out = Console(highlight=False, markup=False, soft_wrap=True)
        state = "resolved" if outcome.lock.resolved else "NOT resolved"
        out.print(f"{outcome.lock_path}: {state}, {'written' if outcome.written else 'unchanged'}")
        for change in outcome.changes:
            out.print(f"  {change}")
        out.print(result["appliance_hash"])
    if outcome.unresolved and not offline:
        first_name, first_reason = next(iter(outcome.unresolved.items()))
        kept = " (the resolved lock on disk was kept)" if outcome.kept_previous else ""
        raise BadInput(f"{first_name}: {first_reason}{kept}")


@app.command("hash")
def hash_command(recipe: RecipeOption, lock: LockOption = None, as_json: JsonOption = False) -> None:
    """Print the appliance hash: sha256 of the recipe and its lock (same pinned inputs -> same hash)."""
    loaded, locked, path = load_recipe_and_lock(recipe, lock)
    digest = appliance_hash(loaded, locked)
    if as_json:
        print_json({"recipe": loaded.name, "lock": str(path), "resolved": locked.resolved,
                     "appliance_hash": digest})
        return
    if not locked.resolved:
        console.print(f"warning: the lock for {loaded.name} is not resolved; this hash pins nothing downloadable",
                      highlight=False)
    Console().print(digest, highlight=False)


@app.command("fetch")
def fetch_command(
    series: Annotated[str, typer.Option("--series", help="Release codename of the hosts")],
    cache: Annotated[Path, typer.Option("--cache", help="Controller's content-addressed .deb cache directory")],
    group: GroupOption = None,
    packages_lock: PackagesLockOption = None,
    host_dir: Annotated[str, typer.Option("--host-dir", help="Where the files go on the host (for sha256sums)")]
        = "/var/cache/b70/debs",
    as_json: JsonOption = False,
) -> None:
    """Fetch the locked .debs of a release into the cache (once; checked by sha256) and list them. Exit 2 when a
    file differs from the lock or cannot be had."""
    from b70ctl.lock.debs_cli import fetch_host_packages

    fetch_host_packages(series, cache, group or [], packages_lock, host_dir, as_json)


@app.command("check")
def check_command(
    recipe: MaybeRecipeOption = None,
    lock: LockOption = None,
    host_packages: HostPackagesOption = False,
    packages_lock: PackagesLockOption = None,
    series: Annotated[str | None, typer.Option("--series", help="Release codename of the host")] = None,
    group: GroupOption = None,
    installed: Annotated[str | None, typer.Option(
        "--installed", help="The host's dpkg-query --show output (FILE, or - for stdin), format "
                            "'${db:Status-Abbrev} ${Package} ${Version} ${Architecture}'")] = None,
    host_state: Annotated[str | None, typer.Option(
        "--host-state", help="Instead of --installed: a JSON object (FILE, or - for stdin) with 'dpkg' (that "
                             "output) and 'apt_policy' (apt-cache policy of the packages newer than the lock)")]
        = None,
    hold: Annotated[list[str] | None, typer.Option(
        "--hold", help="A package the host keeps at exactly its locked version (repeat); every other locked "
                       "package takes its release's security and stable updates")] = None,
    host: Annotated[str, typer.Option("--host", help="Host name for the message")] = "host",
    host_dir: Annotated[str, typer.Option("--host-dir", help="Where the .debs go on the host (install paths)")]
        = "/var/cache/b70/debs",
    models_dir: Annotated[Path | None, typer.Option(
        "--models-dir", help="Directory holding target/ and drafter/ (as b70ctl model fetch writes it)")] = None,
    target_dir: Annotated[Path | None, typer.Option("--target-dir", help="The target's directory")] = None,
    drafter_dir: Annotated[Path | None, typer.Option("--drafter-dir", help="The drafter's directory")] = None,
    image_digest: Annotated[str | None, typer.Option(
        "--image-digest", help="Digest of the installed image (pulled images)")] = None,
    image_base_digest: Annotated[str | None, typer.Option(
        "--image-base-digest", help="Base digest label of the installed image (built images)")] = None,
    as_json: JsonOption = False,
) -> None:
    """Compare what is installed with the lock and list the drift. Exit 1 on drift."""
    if host_packages:
        from b70ctl.lock.debs_cli import check_host_packages

        if series is None or (installed is None) == (host_state is None):
            raise BadInput("--host-packages needs --series CODENAME and one of --installed FILE or --host-state "
                           "FILE (- for stdin)")
        check_host_packages(series, group or [], installed, host_state, hold or [], host, packages_lock, host_dir,
                            as_json)
        return
    if recipe is None:
        raise BadInput("say what to check: --recipe NAME (models, image) or --host-packages (a host's packages)")
    for option, digest in (("--image-digest", image_digest), ("--image-base-digest", image_base_digest)):
        if digest is not None and not DIGEST_PATTERN.match(digest):
            raise BadInput(f"{option} {digest!r} is not a sha256 digest (sha256: and 64 hex digits): give the "
                           "digest docker image inspect prints")
    loaded, locked, _ = load_recipe_and_lock(recipe, lock)
    dirs: dict[str, Path] = {}
    if models_dir is not None:
        dirs = {"target": models_dir / "target", "drafter": models_dir / "drafter"}
    if target_dir is not None:
        dirs["target"] = target_dir
    if drafter_dir is not None:
        dirs["drafter"] = drafter_dir
    if not dirs and image_digest is None and image_base_digest is None:
        raise BadInput("nothing to check: give --models-dir, --target-dir/--drafter-dir or --image-digest")
    report = check_installed(loaded, locked, dirs, image_digest, image_base_digest)
    if as_json:
        print_json(report.model_dump(mode="json"))
    else:
        out = Console(highlight=False, markup=False, soft_wrap=True)
        out.print(f"{report.recipe}: checked {', '.join(report.checked) or 'nothing'} against the lock "
                  f"(appliance hash {report.appliance_hash}{'' if report.lock_resolved else ', lock NOT resolved'})")
        for drift in report.drift:
            where = f"{drift.component}/{drift.path}" if drift.path else drift.component
            detail = ", ".join(f"{name} {value}" for name, value in (("expected", drift.expected),
                                                                     ("actual", drift.actual)) if value)
            out.print(f"  drift {drift.kind}: {where}" + (f" ({detail})" if detail else ""))
        out.print("ok: what is installed matches the lock" if report.ok else
                  f"DRIFT: {len(report.drift)} difference(s) from the lock")
    if not report.ok:
        raise typer.Exit(1)


@app.command("status")
def status_command(
    recipe: RecipeOption,
    lock: LockOption = None,
    allow_unresolved: Annotated[bool, typer.Option(
        "--allow-unresolved", help="Exit 0 on an unresolved lock (the message still says it is unresolved)")] = False,
    as_json: JsonOption = False,
) -> None:
    """Say whether the recipe's lock is resolved; if not, the command that resolves it and the network it needs.
    Exit 1 on an unresolved lock unless --allow-unresolved."""
    from b70ctl.lock.status import lock_status

    loaded, locked, path = load_recipe_and_lock(recipe, lock)
    result = lock_status(loaded, locked, path, recipe, allow_unresolved)
    if as_json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
    else:
        out = Console(highlight=False, markup=False, soft_wrap=True)
        out.print(result.message)
        for part in result.unresolved:
            out.print(f"  {part.part}: {part.reason} (needs {part.network})")
    if not result.ok:
        raise typer.Exit(1)
