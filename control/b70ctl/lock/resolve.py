"""`b70ctl lock resolve`: ask the hub and the registry what the recipe's moving names point at now, and pin it.

This is the only place that follows a branch or a tag. Every part is resolved on its own; a part that cannot be
resolved (hub or registry unreachable, file missing) is written as unresolved with the reason; with --offline
the network is not asked and parts whose recipe input is unchanged keep their previous pin. A lock that was fully
resolved is never replaced by a worse one: the write is skipped and the command fails naming what could not be resolved.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from b70ctl.errors import B70Error, BadInput
from b70ctl.extras import require
from b70ctl.lock.model import (
    FilePin,
    GeneratedModelPin,
    ImagePin,
    Lock,
    ModelPin,
    PatchSeriesPin,
    VendorPatchPin,
    appliance_hash,
    base_tree_description,
    build_lock,
    load_lock_file,
    lock_path_for,
    plain_relative_path,
    stale_inputs,
    write_lock,
)
from b70ctl.lock.registry import parse_reference, resolve_tag
from b70ctl.recipes import Recipe, load_recipe
from b70ctl.recipes.model import ModelSpec
from b70ctl.recipes.tiny import GENERATOR_VERSION, TinySpec

HUB_DEFAULT_ENDPOINT = "https://huggingface.co"
OFFLINE_REASON = ("not resolved: written with --offline, no hub or registry was asked; run b70ctl lock resolve "
                  "where they are reachable")


def hub_endpoint(endpoint: str | None = None) -> str:
    """The hub's base URL: the argument, else HF_ENDPOINT (read now, not at import), else huggingface.co."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or HUB_DEFAULT_ENDPOINT).rstrip("/")


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def repository_root(start: Path | None = None) -> Path:
    """The checkout holding images/: B70CTL_REPO_ROOT, else the first parent of this package (or of the working
    directory) with both pyproject.toml and images/."""
    if env_root := os.environ.get("B70CTL_REPO_ROOT"):
        return Path(env_root)
    for origin in ([start] if start else []) + [Path(__file__).resolve(), Path.cwd().resolve()]:
        for parent in [origin, *origin.parents]:
            if (parent / "pyproject.toml").is_file() and (parent / "images").is_dir():
                return parent
    return Path.cwd()


# --- models --------------------------------------------------------------------------------------------------


def generated_pin(recipe: Recipe, role: str, spec: ModelSpec) -> ModelPin:
    tiny = recipe.tiny or TinySpec()
    assert spec.generated is not None
    return ModelPin(role=role, generated=GeneratedModelPin(generator_version=GENERATOR_VERSION, role=spec.generated,
                                                           spec=tiny.model_dump(mode="json")), resolved=True)


def hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises for a hub that is missing, failing or unreachable. Its HTTP client is httpx2
    (huggingface_hub 2.x), not the httpx b70ctl itself uses; both are caught."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    errors: tuple[type[BaseException], ...] = (HfHubHTTPError, LocalEntryNotFoundError, httpx.HTTPError, OSError)
    try:
        import httpx2

        errors += (httpx2.HTTPError,)
    except ImportError:
        pass
    return errors


def _describe_hub_error(error: BaseException, repo: str, revision: str, endpoint: str) -> str:
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(error, RevisionNotFoundError):
        return f"revision {revision!r} of {repo} does not exist on the hub ({endpoint}): fix the recipe's revision"
    if isinstance(error, RepositoryNotFoundError):
        return f"repository {repo} does not exist on the hub ({endpoint}) or needs a token (HF_TOKEN)"
    return (f"hub {endpoint} unreachable or failing for {repo}@{revision} ({error.__class__.__name__}): "
            "run where the hub is reachable, or set HF_ENDPOINT to a mirror")


def hub_pin(role: str, spec: ModelSpec, endpoint: str | None = None) -> ModelPin:
    """Resolve the recipe's branch/tag to a commit and pin every included file by sha256 and size. LFS files carry
    their sha256 in the hub's metadata; small git files are downloaded at the commit and hashed."""
    require("huggingface_hub", "resolving a model on the Hugging Face hub")
    from huggingface_hub import HfApi, hf_hub_download

    assert spec.repo is not None
    endpoint = hub_endpoint(endpoint)
    requested = spec.revision or "main"
    try:
        info = HfApi(endpoint=endpoint).model_info(spec.repo, revision=requested, files_metadata=True)
    except hub_errors() as error:
        raise BadInput(_describe_hub_error(error, spec.repo, requested, endpoint)) from error
    revision = info.sha
    if not revision or len(revision) != 40:
        raise BadInput(f"hub {endpoint} gave no 40-hex commit for {spec.repo}@{requested}: use another endpoint")
    siblings = [s for s in info.siblings or []
                if any(fnmatch.fnmatch(s.rfilename, pattern) for pattern in spec.include)]
    if not siblings:
        raise BadInput(f"{spec.repo}@{revision} has no file matching {spec.include}: fix the recipe's include")
    for sibling in siblings:
        try:
            plain_relative_path(sibling.rfilename)
        except ValueError as error:
            raise BadInput(f"hub {endpoint} lists {spec.repo}@{revision} file {error}") from error
    files: list[FilePin] = []
    with tempfile.TemporaryDirectory(prefix="b70ctl-resolve-") as scratch:
        for sibling in sorted(siblings, key=lambda s: s.rfilename):
            if sibling.lfs is not None:
                files.append(FilePin(path=sibling.rfilename, sha256=sibling.lfs.sha256, size_bytes=sibling.lfs.size))
                continue
            try:
                local = hf_hub_download(spec.repo, sibling.rfilename, revision=revision, local_dir=scratch,
                                        endpoint=endpoint)
            except hub_errors() as error:
                raise BadInput(_describe_hub_error(error, spec.repo, revision, endpoint)) from error
            files.append(FilePin(path=sibling.rfilename, sha256=sha256_file(Path(local)),
                                 size_bytes=Path(local).stat().st_size))
    return ModelPin(role=role, repo=spec.repo, requested_revision=requested, include=list(spec.include),
                    revision=revision, files=files, resolved=True)


def unresolved_model_pin(role: str, spec: ModelSpec, reason: str) -> ModelPin:
    return ModelPin(role=role, repo=spec.repo, requested_revision=spec.revision or "main",
                    include=list(spec.include), resolved=False, unresolved_reason=reason)


def _model_input_unchanged(previous: ModelPin | None, spec: ModelSpec) -> bool:
    return (previous is not None and previous.resolved and previous.generated is None
            and previous.repo == spec.repo and previous.requested_revision == (spec.revision or "main")
            and previous.include == list(spec.include))


# --- image and patch series ----------------------------------------------------------------------------------


def is_local_reference(reference: str) -> bool:
    """Images under localhost/ are built on the host itself: no registry holds them."""
    return parse_reference(reference).registry == "localhost"


def image_pin(recipe: Recipe, registry_url: str | None, offline: bool, previous: ImagePin | None) -> ImagePin:
    image = recipe.image
    base = image.build.base if image.source == "build" and image.build else None
    fields: dict[str, Any] = dict(reference=image.reference, tag=image.tag, source=image.source, base_reference=base)
    if image.source == "build" and base is not None and is_local_reference(base):
        return ImagePin(**fields, local_build=True, resolved=True)
    unchanged = (previous is not None and previous.resolved and previous.reference == image.reference
                 and previous.tag == image.tag and previous.source == image.source
                 and previous.base_reference == base)
    if offline:
        return previous if unchanged and previous else ImagePin(**fields, unresolved_reason=OFFLINE_REASON)
    try:
        if image.source == "pull":
            return ImagePin(**fields, digest=resolve_tag(image.reference, image.tag, registry_url), resolved=True)
        assert base is not None
        return ImagePin(**fields, base_digest=resolve_tag(base, None, registry_url), resolved=True)
    except B70Error as error:
        return ImagePin(**fields, unresolved_reason=str(error))


def series_path(recipe: Recipe) -> str | None:
    build = recipe.image.build
    if build is None:
        return None
    return build.patch_series or f"{build.context.rstrip('/')}/patches/series"


def parse_series(text: str) -> tuple[dict[str, str], list[tuple[str, str | None]]]:
    """A series file: '#' comments; `<name>.patch [sha256] [purpose...]` lines in order (quilt's layout plus an
    optional sha256 the file must hash to); any other `key value` line is a directive (e.g. `base-vllm 0.21.0`)."""
    directives: dict[str, str] = {}
    patches: list[tuple[str, str | None]] = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if words[0].endswith((".patch", ".diff")):
            declared = words[1] if len(words) > 1 and len(words[1]) == 64 and all(
                c in "0123456789abcdef" for c in words[1]) else None
            patches.append((words[0], declared))
        else:
            directives[words[0]] = " ".join(words[1:])
    return directives, patches


def vendor_patch_pin(line: str, offline: bool, previous: VendorPatchPin | None) -> VendorPatchPin:
    """Pin the series' `vendor-patch REPO REVISION PATH` line: the commit and the file's sha256, downloaded from
    GitHub (or, offline, the previous pin of the same line, else the file a download left in the cache)."""
    from b70ctl.lock.vendor import NETWORK_NEEDED, cached_path, fetch_vendor_patch, resolve_commit

    words = line.split()
    if len(words) != 3:
        raise BadInput(f"vendor-patch {line!r}: expected 'vendor-patch OWNER/REPO REVISION PATH'")
    repo, requested, path = words
    if previous is not None and (previous.repo, previous.requested_revision, previous.path) == (repo, requested, path):
        if offline or previous.revision == requested:
            return previous
    if offline:
        cached = cached_path(repo, requested, path) if len(requested) == 40 else None
        if cached is None or not cached.is_file():
            raise BadInput(f"{repo}@{requested}:{path} is not pinned yet and not in the cache: run b70ctl lock "
                           f"resolve without --offline where {NETWORK_NEEDED} is reachable")
        file = cached
        commit = requested
    else:
        commit = resolve_commit(repo, requested)
        file = fetch_vendor_patch(repo, commit, path)
    return VendorPatchPin(repo=repo, path=path, requested_revision=requested, revision=commit,
                          sha256=sha256_file(file), size_bytes=file.stat().st_size)


def patch_series_pin(recipe: Recipe, repo_root: Path, offline: bool = False,
                     previous: PatchSeriesPin | None = None) -> PatchSeriesPin:
    """Hash the series file and every patch it lists, and pin the vendor patch the series names (the base tree
    it is written against). Route a (patched) needs one; other routes have none unless their build context
    carries a series file."""
    relative = series_path(recipe)
    needed = recipe.route == "patched" or (recipe.image.build is not None and recipe.image.build.patch_series)
    if relative is None or (not needed and not (repo_root / relative).is_file()):
        return PatchSeriesPin(applicable=False, resolved=True)
    series = repo_root / relative
    if not series.is_file():
        return PatchSeriesPin(applicable=True, path=relative,
                              unresolved_reason=f"{relative} does not exist under {repo_root}: write the series "
                                                "(or set B70CTL_REPO_ROOT to the checkout holding images/)")
    directives, listed = parse_series(series.read_text())
    patches: list[FilePin] = []
    for name, declared in listed:
        patch = series.parent / name
        if not patch.is_file():
            return PatchSeriesPin(applicable=True, path=relative,
                                  unresolved_reason=f"{relative} lists {name}, which does not exist beside it")
        actual = sha256_file(patch)
        if declared is not None and declared != actual:
            return PatchSeriesPin(applicable=True, path=relative,
                                  unresolved_reason=f"{relative} declares sha256 {declared} for {name}, the file "
                                                    f"hashes to {actual}: fix the series or the patch")
        patches.append(FilePin(path=name, sha256=actual, size_bytes=patch.stat().st_size))
    if not patches:
        return PatchSeriesPin(applicable=True, path=relative,
                              unresolved_reason=f"{relative} lists no patch: route a needs its patch set")
    vendor = None
    if "vendor-patch" in directives:
        try:
            vendor = vendor_patch_pin(directives["vendor-patch"], offline,
                                      previous.vendor_patch if previous is not None else None)
        except B70Error as error:
            return PatchSeriesPin(applicable=True, path=relative, unresolved_reason=str(error))
    base_vllm = directives.get("base-vllm")
    return PatchSeriesPin(applicable=True, path=relative, series_sha256=sha256_file(series), patches=patches,
                          base_vllm_version=base_vllm, vendor_patch=vendor,
                          base_tree=base_tree_description(base_vllm, vendor), resolved=True)


# --- the whole lock ------------------------------------------------------------------------------------------


def resolve_lock(recipe: Recipe, *, previous: Lock | None = None, endpoint: str | None = None,
                 registry_url: str | None = None, offline: bool = False, repo_root: Path | None = None) -> Lock:
    """A new lock for the recipe. Parts that cannot be resolved come back unresolved with their reason."""
    root = repo_root or repository_root()
    models: dict[str, ModelPin | None] = {}
    for role, spec in (("target", recipe.target), ("drafter", recipe.drafter)):
        if spec is None:
            models[role] = None
            continue
        if spec.generated is not None:
            models[role] = generated_pin(recipe, role, spec)
            continue
        old = getattr(previous, role) if previous is not None else None
        unchanged = _model_input_unchanged(old, spec)
        if offline:
            models[role] = old if unchanged else unresolved_model_pin(role, spec, OFFLINE_REASON)
            continue
        try:
            models[role] = hub_pin(role, spec, endpoint)
        except B70Error as error:
            models[role] = unresolved_model_pin(role, spec, str(error))
    target = models["target"]
    assert target is not None
    return build_lock(recipe=recipe.name, vllm_version=recipe.vllm_version,
                      image=image_pin(recipe, registry_url, offline, previous.image if previous else None),
                      patch_series=patch_series_pin(recipe, root, offline,
                                                    previous.patch_series if previous else None),
                      target=target, drafter=models["drafter"])


@dataclass
class ResolveOutcome:
    lock: Lock
    lock_path: Path
    written: bool
    kept_previous: bool
    unresolved: dict[str, str] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)

    def as_json(self, recipe: Recipe) -> dict[str, Any]:
        return {"recipe": recipe.name, "lock": str(self.lock_path), "changed": self.written,
                "resolved": self.lock.resolved, "unresolved": self.unresolved, "changes": self.changes,
                "appliance_hash": appliance_hash(recipe, self.lock)}


def _changes(previous: Lock | None, new: Lock) -> list[str]:
    """What moved: the lines a reviewer reads before committing a re-resolved lock."""
    if previous is None:
        return ["new lock"]
    changes = []
    if previous.image.digest != new.image.digest:
        changes.append(f"image digest {previous.image.digest} -> {new.image.digest}")
    if previous.image.base_digest != new.image.base_digest:
        changes.append(f"image base digest {previous.image.base_digest} -> {new.image.base_digest}")
    old_vendor, new_vendor = previous.patch_series.vendor_patch, new.patch_series.vendor_patch
    if (old_vendor and (old_vendor.revision, old_vendor.sha256)) != (new_vendor and (new_vendor.revision,
                                                                                       new_vendor.sha256)):
        changes.append(f"vendor patch {old_vendor and old_vendor.sha256} -> {new_vendor and new_vendor.sha256}")
    if previous.patch_series.series_sha256 != new.patch_series.series_sha256:
        changes.append(f"patch series {previous.patch_series.series_sha256} -> {new.patch_series.series_sha256}")
    for role in ("target", "drafter"):
        old, now = getattr(previous, role), getattr(new, role)
        if (old and old.revision) != (now and now.revision):
            changes.append(f"{role} revision {old and old.revision} -> {now and now.revision}")
        if old and now and old.generated != now.generated:
            changes.append(f"{role} generator spec changed")
    if previous.vllm_version != new.vllm_version:
        changes.append(f"vLLM {previous.vllm_version} -> {new.vllm_version}")
    return changes


def resolve_and_write(name_or_path: str, *, lock_path: Path | None = None, endpoint: str | None = None,
                      registry_url: str | None = None, offline: bool = False,
                      repo_root: Path | None = None) -> tuple[Recipe, ResolveOutcome]:
    recipe = load_recipe(name_or_path)
    path = lock_path or lock_path_for(name_or_path)
    previous = load_lock_file(path) if path.is_file() else None
    if previous is not None and previous.recipe != recipe.name:
        previous = None
    lock = resolve_lock(recipe, previous=previous, endpoint=endpoint, registry_url=registry_url, offline=offline,
                        repo_root=repo_root)
    unresolved = {name: getattr(lock, name).unresolved_reason or "unresolved" for name in lock.unresolved_fields()}
    if previous is not None and previous.resolved and not stale_inputs(recipe, previous) and not lock.resolved:
        # Never trade a working pin for a hole: keep the file, report what failed.
        return recipe, ResolveOutcome(lock=previous, lock_path=path, written=False, kept_previous=True,
                                      unresolved=unresolved)
    changes = _changes(previous, lock)
    written = write_lock(lock, path)
    return recipe, ResolveOutcome(lock=lock, lock_path=path, written=written, kept_previous=False,
                                  unresolved=unresolved, changes=changes if written else [])
