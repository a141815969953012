"""`b70ctl lock check`: compare what a host has installed with the lock, and list every difference (drift).

Every file is hashed (no trust in markers: this is the audit). Extra files in a model directory are drift too:
a stale shard beside the pinned ones can change what vLLM loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from b70ctl.documents import Pinned
from b70ctl.files import read_own_json_object
from b70ctl.lock.model import Lock, ModelPin, appliance_hash
from b70ctl.lock.resolve import sha256_file
from b70ctl.recipes import Recipe

STATE_DIR_NAMES = {".b70ctl", ".quarantine", ".cache"}


class Drift(Pinned):
    component: str
    path: str | None = None
    kind: Literal["missing", "hash", "size", "extra", "revision", "generator", "digest", "unresolved"]
    expected: str | None = None
    actual: str | None = None


class CheckReport(Pinned):
    recipe: str
    appliance_hash: str
    lock_resolved: bool
    checked: list[str]
    drift: list[Drift]
    ok: bool


def model_files(directory: Path) -> list[str]:
    """Files of a model directory, '/'-separated, without b70ctl's and huggingface_hub's state directories."""
    found = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_file() and not (set(relative.parts) & STATE_DIR_NAMES):
            found.append(relative.as_posix())
    return found


def check_model(pin: ModelPin, directory: Path) -> list[Drift]:
    component = pin.role
    if not directory.is_dir():
        return [Drift(component=component, path=str(directory), kind="missing")]
    if pin.generated is not None:
        recorded = read_own_json_object(directory / "generator.json") or {}
        expected = {"generator_version": pin.generated.generator_version, "role": pin.generated.role,
                    "spec": pin.generated.spec}
        actual = {key: recorded.get(key) for key in expected}
        if actual != expected:
            return [Drift(component=component, path="generator.json", kind="generator",
                          expected=json.dumps(expected, sort_keys=True), actual=json.dumps(actual, sort_keys=True))]
        return []
    if not pin.resolved:
        return [Drift(component=component, kind="unresolved", expected="a resolved pin")]
    drift: list[Drift] = []
    pinned = {f.path: f for f in pin.files}
    for relative, file_pin in pinned.items():
        path = directory / relative
        if not path.is_file():
            drift.append(Drift(component=component, path=relative, kind="missing", expected=file_pin.sha256))
            continue
        size = path.stat().st_size
        if size != file_pin.size_bytes:
            drift.append(Drift(component=component, path=relative, kind="size", expected=str(file_pin.size_bytes),
                               actual=str(size)))
            continue
        digest = sha256_file(path)
        if digest != file_pin.sha256:
            drift.append(Drift(component=component, path=relative, kind="hash", expected=file_pin.sha256,
                               actual=digest))
    for relative in model_files(directory):
        if relative not in pinned:
            drift.append(Drift(component=component, path=relative, kind="extra"))
    return drift


def check_installed(recipe: Recipe, lock: Lock, model_dirs: dict[str, Path], image_digest: str | None = None,
                    image_base_digest: str | None = None) -> CheckReport:
    """model_dirs maps target/drafter to their directories; a role not given is not checked (and not listed)."""
    drift: list[Drift] = []
    checked: list[str] = []
    for pin in lock.models():
        if pin.role in model_dirs:
            checked.append(pin.role)
            drift += check_model(pin, model_dirs[pin.role])
    if image_digest is not None:
        checked.append("image")
        if lock.image.digest != image_digest:
            drift.append(Drift(component="image", kind="digest", expected=lock.image.digest, actual=image_digest))
    if image_base_digest is not None:
        checked.append("image_base")
        if lock.image.base_digest != image_base_digest:
            drift.append(Drift(component="image_base", kind="digest", expected=lock.image.base_digest,
                               actual=image_base_digest))
    return CheckReport(recipe=recipe.name, appliance_hash=appliance_hash(recipe, lock), lock_resolved=lock.resolved,
                       checked=checked, drift=drift, ok=not drift)
