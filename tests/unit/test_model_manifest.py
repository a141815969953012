"""What a host receives from the controller's model cache: `b70ctl model manifest` describes it without reading
fetched weights again, and the model_store role's b70_model_dir module (run on the host) reads nothing when the
host's copy matches, keeps what an interrupted transfer delivered, and records its manifest only after every file
was verified."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from b70ctl.lock.model import load_recipe_and_lock
from b70ctl.lock.resolve import resolve_and_write
from b70ctl.models.convert import PROVENANCE_FILE, convert
from b70ctl.models.fetch import fetch
from b70ctl.models.manifest import HOST_MANIFEST_FILE, directory_manifest
from store_fixtures import sha256, write_recipe

REPO_ROOT = Path(__file__).resolve().parents[2]
B70CTL = str(Path(sys.executable).with_name("b70ctl"))
_spec = importlib.util.spec_from_file_location(
    "b70_model_dir", REPO_ROOT / "roles" / "model_store" / "library" / "b70_model_dir.py")
assert _spec is not None and _spec.loader is not None
model_dir = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_dir)


@pytest.fixture
def fetched(hub_env, tmp_path):
    """The recipe's models fetched and the drafter converted, as the role leaves them on the controller."""
    recipe_file = write_recipe(tmp_path)
    resolve_and_write(str(recipe_file))
    recipe, lock, _ = load_recipe_and_lock(str(recipe_file))
    dest = tmp_path / "cache"
    fetch(recipe, lock, dest)
    convert(dest / "drafter", dest / "drafter-converted", "0.32.0", dest / "target",
            source_revision=lock.drafter.revision)
    return lock, dest


def test_manifest_of_fetched_models_takes_the_locked_hashes_and_reads_no_weight(fetched):
    lock, dest = fetched
    target = directory_manifest(dest / "target")
    assert target.hashed_bytes == 0
    assert [(f.path, f.size_bytes, f.sha256) for f in target.files] == sorted(
        (f.path, f.size_bytes, f.sha256) for f in lock.target.files)

    converted = directory_manifest(dest / "drafter-converted")
    small = {"config.json", PROVENANCE_FILE}
    assert converted.hashed_bytes == sum((dest / "drafter-converted" / name).stat().st_size for name in small)
    by_path = {f.path: f for f in converted.files}
    for pin in lock.drafter.files:
        if pin.path not in small:  # hard links of the verified weights: the lock's hash, not read again
            assert (by_path[pin.path].size_bytes, by_path[pin.path].sha256) == (pin.size_bytes, pin.sha256)
    assert by_path["config.json"].sha256 == sha256((dest / "drafter-converted" / "config.json").read_bytes())


def test_manifest_hashes_a_weight_changed_after_fetch(fetched):
    _lock, dest = fetched
    weight = dest / "target" / "model.safetensors"
    data = bytearray(weight.read_bytes())
    data[-1] ^= 0xFF
    weight.unlink()  # a new inode: fetch's record no longer vouches for it
    weight.write_bytes(bytes(data))
    manifest = directory_manifest(dest / "target")
    assert manifest.hashed_bytes == len(data)
    assert {f.path: f.sha256 for f in manifest.files}["model.safetensors"] == sha256(bytes(data))


def test_manifest_command_prints_json_for_each_directory(fetched):
    _, dest = fetched
    run = subprocess.run([B70CTL, "model", "manifest", "--json", str(dest / "target"), str(dest / "drafter")],
                         capture_output=True, text=True, check=True)
    manifests = json.loads(run.stdout)["manifests"]
    assert [m["directory"] for m in manifests] == [str(dest / "target"), str(dest / "drafter")]
    assert [m["hashed_bytes"] for m in manifests] == [0, 0]


# --- the host side: roles/model_store/library/b70_model_dir.py ------------------------------------------------


def _install(source: Path, host_dir: Path, files: list[dict]) -> dict:
    """The role's three steps: plan, send what the plan lists (b70_model_send's chunks, staged in a directory
    standing in for Ansible's temporary one), verify and record."""
    wanted = model_dir.wanted_files(files)
    planned = model_dir.plan(str(host_dir), wanted)
    staging = host_dir.parent / "staged-chunks"
    staging.mkdir(exist_ok=True)
    sent = []
    for entry in planned["send"]:
        path = entry["path"]

        def stage(index: int, offset: int, length: int, path: str = path) -> str:
            with open(source / path, "rb") as handle:
                handle.seek(offset)
                (staging / str(index)).write_bytes(handle.read(length))
            return str(staging / str(index))

        def host(chunk_sha256: list[str], staged: dict[str, str], finish: bool, entry: dict = entry) -> dict:
            return model_dir.transfer_chunks(str(host_dir), entry, 4096, chunk_sha256, staged, finish)

        model_dir.send_file(str(source / path), entry, 4096, 4 * 4096, host, stage)
        sent.append({"placed": True, "directory": str(host_dir), "path": path})  # what b70_model_send adds
    if not planned["in_place"]:  # what the send placed was checked against its sha256 on the host
        verified = planned["verified"] + model_dir.placed_in(str(host_dir), sent)
        recorded = model_dir.record(str(host_dir), wanted, verified)
        assert recorded["bad"] == [] and recorded["hashed_bytes"] == 0
    return planned


def _files(fetched_dir: Path) -> list[dict]:
    return directory_manifest(fetched_dir).model_dump(mode="json")["files"]


def test_host_copy_that_matches_is_not_read(fetched, tmp_path, monkeypatch):
    _, dest = fetched
    files = _files(dest / "target")
    host_dir = tmp_path / "host" / "target"
    first = _install(dest / "target", host_dir, files)
    assert sorted(first["send"], key=lambda entry: entry["path"]) == files
    assert json.loads((host_dir / HOST_MANIFEST_FILE).read_text())["files"] == files

    def no_reading(path: str, *args: object) -> str:
        raise AssertionError(f"{path} was read on a no-op re-run")

    monkeypatch.setattr(model_dir, "sha256_file", no_reading)
    again = model_dir.plan(str(host_dir), model_dir.wanted_files(files))
    assert again == {"changed": False, "in_place": True, "send": [], "verified": [], "removed": [],
                     "hashed_bytes": 0}


def test_interrupted_transfer_resumes_with_what_it_delivered(fetched, tmp_path):
    _, dest = fetched
    files = _files(dest / "target")
    weight = next(f for f in files if f["path"] == "model.safetensors")
    host_dir = tmp_path / "host" / "target"
    host_dir.mkdir(parents=True)
    # Cut after config.json arrived, half-way through the weights, before tokenizer.json: no manifest yet.
    shutil.copyfile(dest / "target" / "config.json", host_dir / "config.json")
    (host_dir / "model.safetensors").write_bytes((dest / "target" / "model.safetensors").read_bytes()[:1000])
    planned = model_dir.plan(str(host_dir), model_dir.wanted_files(files))
    assert planned["in_place"] is False
    assert planned["verified"] == ["config.json"]
    assert [entry["path"] for entry in planned["send"]] == sorted(f["path"] for f in files
                                                                  if f["path"] != "config.json")
    assert planned["hashed_bytes"] == (host_dir / "config.json").stat().st_size  # the cut weight: size differs
    assert not (host_dir / HOST_MANIFEST_FILE).exists()
    # Sending was cut again: nothing claims completeness, the record step names what is missing.
    recorded = model_dir.record(str(host_dir), model_dir.wanted_files(files), planned["verified"])
    assert recorded["changed"] is False and any(b.startswith("model.safetensors:") for b in recorded["bad"])
    assert not (host_dir / HOST_MANIFEST_FILE).exists()
    # The next run sends only what is still missing, then records.
    planned = _install(dest / "target", host_dir, files)
    assert [entry["path"] for entry in planned["send"]] == sorted(f["path"] for f in files
                                                                  if f["path"] != "config.json")
    assert sha256((host_dir / "model.safetensors").read_bytes()) == weight["sha256"]
    assert model_dir.plan(str(host_dir), model_dir.wanted_files(files))["in_place"] is True


def test_changed_manifest_removes_the_record_first_and_stray_files(fetched, tmp_path):
    _, dest = fetched
    host_dir = tmp_path / "host" / "drafter"
    _install(dest / "drafter", host_dir, _files(dest / "drafter"))
    (host_dir / "old-shard.safetensors").write_bytes(b"from an older revision")
    # Same size, other bytes: only the hash tells, and the plan hashes because the directory is not in place.
    (host_dir / "config.json").write_bytes(b" " * (host_dir / "config.json").stat().st_size)
    planned = model_dir.plan(str(host_dir), model_dir.wanted_files(_files(dest / "drafter")))
    assert planned["removed"] == ["old-shard.safetensors"]
    assert [entry["path"] for entry in planned["send"]] == ["config.json"]
    assert not (host_dir / "old-shard.safetensors").exists() and not (host_dir / HOST_MANIFEST_FILE).exists()
    # The converted drafter replaces the published one: the recorded manifest no longer matches.
    converted = _install(dest / "drafter-converted", host_dir, _files(dest / "drafter-converted"))
    assert sorted(entry["path"] for entry in converted["send"]) == sorted(["config.json", PROVENANCE_FILE])
    assert model_dir.plan(str(host_dir), model_dir.wanted_files(_files(dest / "drafter-converted")))["in_place"]


def test_manifest_paths_outside_the_directory_are_refused():
    for path in ("../etc/passwd", "/etc/passwd", "a/../../b", HOST_MANIFEST_FILE):
        with pytest.raises(ValueError):
            model_dir.wanted_files([{"path": path, "size_bytes": 1, "sha256": "0" * 64}])
