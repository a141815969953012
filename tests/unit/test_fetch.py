"""Model fetch against a local hub through huggingface_hub: locked revision, verification, quarantine, resume after
a cut connection and after a full disk (a real failing write: RLIMIT_FSIZE in a child process), offline sources,
idempotence; and `lock check` on what was installed."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from b70ctl.errors import BadInput
from b70ctl.lock.check import check_installed
from b70ctl.lock.model import load_recipe_and_lock, write_lock
from b70ctl.lock.resolve import resolve_and_write
from b70ctl.models.fetch import FetchFailed, fetch, fill_cache
from store_fixtures import DRAFTER_REPO, TARGET_REPO, drafter_files, sha256, target_files, write_recipe

B70CTL = str(Path(sys.executable).with_name("b70ctl"))


@pytest.fixture
def locked(hub_env, tmp_path):
    """A recipe resolved against the local hub and registry: (recipe, lock, recipe_file)."""
    recipe_file = write_recipe(tmp_path)
    resolve_and_write(str(recipe_file))
    recipe, lock, _ = load_recipe_and_lock(str(recipe_file))
    assert lock.resolved
    return recipe, lock, recipe_file


def _tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _expected(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if name != "README.md"}


def test_fetch_downloads_the_locked_files_and_a_rerun_is_a_no_op(locked, hub, tmp_path):
    recipe, lock, _ = locked
    dest = tmp_path / "models"
    result = fetch(recipe, lock, dest)
    assert result.changed is True and result.quarantined == []
    assert _tree(dest / "target") == _expected(target_files())
    assert _tree(dest / "drafter") == drafter_files()
    assert {f.action for m in result.models for f in m.files} == {"downloaded"}
    # Every download asked for the locked commit, not the branch.
    assert all(f"/resolve/{lock.target.revision}/" in r["path"] or f"/resolve/{lock.drafter.revision}/" in r["path"]
               for r in hub.downloads())
    downloads_before = len(hub.downloads())

    again = fetch(recipe, lock, dest)
    assert again.changed is False
    assert {f.action for m in again.models for f in m.files} == {"kept"}
    assert len(hub.downloads()) == downloads_before  # nothing fetched again

    report = check_installed(recipe, lock, {"target": dest / "target", "drafter": dest / "drafter"},
                             image_digest=lock.image.digest)
    assert report.ok and report.drift == [] and report.checked == ["target", "drafter", "image"]


def test_fetch_follows_the_lock_not_the_moved_branch(locked, hub, tmp_path):
    recipe, lock, _ = locked
    hub.repo(DRAFTER_REPO).commit(drafter_files(seed=77))  # main moves after the lock was resolved
    dest = tmp_path / "models"
    fetch(recipe, lock, dest)
    assert _tree(dest / "drafter") == drafter_files()  # the locked bytes, not main's new ones


def test_corrupt_weight_is_quarantined_and_named_good_files_stay(locked, hub, tmp_path):
    recipe, lock, _ = locked
    good = drafter_files()["model.safetensors"]
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    # Same size, one flipped byte; the hub's metadata (and so the lock) still says `good`.
    hub.corrupt[f"{DRAFTER_REPO}/model.safetensors"] = bytes(bad)
    dest = tmp_path / "models"
    with pytest.raises(FetchFailed) as failed:
        fetch(recipe, lock, dest)
    message = str(failed.value)
    assert message.startswith(f"drafter/model.safetensors: sha256 {sha256(bytes(bad))} does not match the lock's "
                              f"{sha256(good)}; quarantined at ")
    quarantined = dest / ".quarantine" / "drafter" / f"model.safetensors.{sha256(bytes(bad))[:12]}"
    assert quarantined.read_bytes() == bytes(bad)
    assert not (dest / "drafter" / "model.safetensors").exists()
    # Everything that did verify is in place.
    assert _tree(dest / "target") == _expected(target_files())
    assert (dest / "drafter" / "config.json").read_bytes() == drafter_files()["config.json"]
    assert [(f.role, f.path) for f in failed.value.result.quarantined] == [("drafter", "model.safetensors")]

    del hub.corrupt[f"{DRAFTER_REPO}/model.safetensors"]
    healed = fetch(recipe, lock, dest)
    assert healed.changed and _tree(dest / "drafter") == drafter_files()
    assert {(m.role, f.path, f.action) for m in healed.models for f in m.files if f.action != "kept"} == {
        ("drafter", "model.safetensors", "downloaded")}
    assert quarantined.is_file()  # evidence is kept


def test_installed_file_changed_after_fetch_is_replaced_and_drift_reported(locked, tmp_path):
    recipe, lock, _ = locked
    dest = tmp_path / "models"
    fetch(recipe, lock, dest)
    weights = dest / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x01
    weights.write_bytes(bytes(data))
    (dest / "drafter" / "stale-shard.safetensors").write_bytes(b"old")

    report = check_installed(recipe, lock, {"target": dest / "target", "drafter": dest / "drafter"},
                             image_digest="sha256:" + "0" * 64)
    assert not report.ok
    kinds = {(d.component, d.path, d.kind) for d in report.drift}
    assert kinds == {("drafter", "model.safetensors", "hash"), ("drafter", "stale-shard.safetensors", "extra"),
                     ("image", None, "digest")}

    result = fetch(recipe, lock, dest)
    assert result.changed
    assert [(f.role, f.path) for f in result.quarantined] == [("drafter", "model.safetensors")]
    assert weights.read_bytes() == drafter_files()["model.safetensors"]


def test_lock_check_cli_prints_drift_json_and_exits_1(locked, tmp_path):
    recipe, lock, recipe_file = locked
    dest = tmp_path / "models"
    fetch(recipe, lock, dest)
    ok = subprocess.run([B70CTL, "lock", "check", "--recipe", str(recipe_file), "--models-dir", str(dest), "--json"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    (dest / "target" / "config.json").write_text("{}")
    drifted = subprocess.run([B70CTL, "lock", "check", "--recipe", str(recipe_file), "--models-dir", str(dest),
                              "--json"], capture_output=True, text=True)
    assert drifted.returncode == 1
    report = json.loads(drifted.stdout)
    assert [(d["component"], d["path"], d["kind"]) for d in report["drift"]] == [("target", "config.json", "size")]
    # Without --json the same drift, for people.
    people = subprocess.run([B70CTL, "lock", "check", "--recipe", str(recipe_file), "--models-dir", str(dest)],
                            capture_output=True, text=True)
    assert people.returncode == 1
    lines = people.stdout.splitlines()
    assert lines[1].startswith("  drift size: target/config.json (expected ") and lines[-1] == (
        "DRIFT: 1 difference(s) from the lock")


def test_wrong_revision_fails_naming_it(locked, tmp_path):
    recipe, lock, _ = locked
    gone = "f" * 40
    bad_lock = lock.model_copy(update={"drafter": lock.drafter.model_copy(update={"revision": gone})})
    dest = tmp_path / "models"
    with pytest.raises(BadInput) as error:
        fetch(recipe, bad_lock, dest)
    assert f"revision {gone} of {DRAFTER_REPO} does not exist on the hub" in str(error.value)
    assert str(error.value).startswith("drafter/config.json: ")


def test_connection_cut_mid_body_resumes_with_a_range_request(locked, hub, tmp_path):
    recipe, lock, _ = locked
    size = len(target_files()["model.safetensors"])
    hub.cut_once["model.safetensors"] = size // 3
    dest = tmp_path / "models"
    result = fetch(recipe, lock, dest)
    assert _tree(dest / "target") == _expected(target_files())
    # huggingface_hub's http_get retried the cut transfer itself (from the last byte it had flushed to us: with
    # its 10 MB read chunks that is 0 here, so no Range); the cut bytes never reached the target directory.
    target_gets = [r for r in hub.downloads("model.safetensors") if r["path"].startswith(f"/{TARGET_REPO}/")]
    assert len(target_gets) == 2
    assert result.quarantined == []
    assert {(m.role, f.path): f.action for m in result.models for f in m.files}[("target", "model.safetensors")] \
        == "downloaded"


def _fetch_in_child(recipe_file: Path, dest: Path, env: dict[str, str], file_size_limit: int | None):
    def limit() -> None:
        if file_size_limit is not None:
            # A write past the limit fails with EFBIG, as one past a full disk fails with ENOSPC.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run([B70CTL, "model", "fetch", "--recipe", str(recipe_file), "--dest", str(dest), "--json"],
                          capture_output=True, text=True, env=env, preexec_fn=limit)


def test_disk_full_leaves_a_partial_and_the_rerun_resumes_it(locked, hub, tmp_path):
    _recipe, lock, recipe_file = locked
    dest = tmp_path / "models"
    env = dict(os.environ, HF_HUB_DISABLE_PROGRESS_BARS="1")
    size = lock.target.file("model.safetensors").size_bytes
    limit = 100_000
    assert size > limit
    full = _fetch_in_child(recipe_file, dest, env, file_size_limit=limit)
    assert full.returncode == 2, full.stderr
    error_line = full.stderr.strip().splitlines()[-1]
    assert error_line.startswith("error: target/model.safetensors: writing ")
    assert f"failed after {limit} of {size} bytes (disk full" in error_line
    partial = dest / ".b70ctl" / "partial" / "target" / "model.safetensors.part"
    assert partial.read_bytes() == target_files()["model.safetensors"][:limit]  # a clean prefix, no hole
    assert (dest / "target" / "config.json").is_file()  # small files before it are in place

    done = _fetch_in_child(recipe_file, dest, env, file_size_limit=None)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    actions = {(m["role"], f["path"]): f["action"] for m in result["models"] for f in m["files"]}
    assert actions[("target", "model.safetensors")] == "resumed"
    assert actions[("target", "config.json")] == "kept"
    assert f"bytes={limit}-" in [r["range"] for r in hub.downloads("model.safetensors")]
    assert _tree(dest / "target") == _expected(target_files())
    assert not partial.exists()


def test_offline_cache_filled_once_then_fetched_without_the_hub(locked, hub, tmp_path, monkeypatch):
    recipe, lock, _ = locked
    cache = tmp_path / "controller-cache"
    filled = fill_cache(lock, cache)
    assert sorted(filled["files"]) == sorted([f"target/{f.path}" for f in lock.target.files]
                                             + [f"drafter/{f.path}" for f in lock.drafter.files])
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the hosts cannot reach any hub
    downloads_before = len(hub.downloads())
    dest = tmp_path / "host-models"
    result = fetch(recipe, lock, dest, source="cache", source_dir=cache)
    assert len(hub.downloads()) == downloads_before
    assert _tree(dest / "target") == _expected(target_files())
    assert _tree(dest / "drafter") == drafter_files()
    assert {f.action for m in result.models for f in m.files} == {"linked"}  # same filesystem: no copy
    assert os.stat(dest / "drafter" / "model.safetensors").st_nlink >= 2
    assert fetch(recipe, lock, dest, source="cache", source_dir=cache).changed is False

    missing = lock.model_copy(update={"target": lock.target.model_copy(update={"revision": "e" * 40})})
    with pytest.raises(BadInput, match=f"acme/tiny-target@{'e' * 40} is not in the cache"):
        fetch(recipe, missing, tmp_path / "other", source="cache", source_dir=cache)


def test_local_directory_source_verifies_and_quarantines(locked, tmp_path):
    recipe, lock, _ = locked
    first = tmp_path / "first"
    fetch(recipe, lock, first)
    copy_source = tmp_path / "usb"
    for role in ("target", "drafter"):
        for name, data in _tree(first / role).items():
            (copy_source / role / name).parent.mkdir(parents=True, exist_ok=True)
            (copy_source / role / name).write_bytes(data)
    (copy_source / "drafter" / "config.json").write_text('{"vocab_size": 1}')
    dest = tmp_path / "host"
    with pytest.raises(FetchFailed, match=r"drafter/config.json: sha256 "):
        fetch(recipe, lock, dest, source="local", source_dir=copy_source)
    assert (copy_source / "drafter" / "config.json").read_text() == '{"vocab_size": 1}'  # the source is untouched
    assert _tree(dest / "target") == _expected(target_files())


def test_generated_models_follow_the_locked_spec(tmp_path):
    """cpu-tiny: fetch generates on the host (a short spec keeps this fast) and links target/ and drafter/."""
    import yaml

    from b70ctl.lock.resolve import resolve_lock
    from b70ctl.recipes import load_recipe_file, recipe_path

    data = yaml.safe_load(recipe_path("cpu-tiny").read_text())
    data["tiny"] = {"seed": 7, "train_steps": 2, "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    recipe_file = tmp_path / "tiny-fast.yaml"
    recipe_file.write_text(yaml.safe_dump(data))
    recipe = load_recipe_file(recipe_file)
    lock = resolve_lock(recipe)
    write_lock(lock, tmp_path / "tiny-fast.lock.json")
    dest = tmp_path / "models"
    result = fetch(recipe, lock, dest)
    assert result.changed
    assert os.readlink(dest / "drafter") == "generated/draft-perturbed"
    assert json.loads((dest / "target" / "config.json").read_text())["vocab_size"] == 300
    assert check_installed(recipe, lock, {"target": dest / "target", "drafter": dest / "drafter"}).ok
    assert fetch(recipe, lock, dest).changed is False


def test_convert_of_a_fetched_drafter_reuses_the_verified_hashes(locked, tmp_path):
    from b70ctl.models.convert import PROVENANCE_FILE, convert

    recipe, lock, _ = locked
    dest = tmp_path / "models"
    fetch(recipe, lock, dest)
    converted = dest / "drafter-vllm-0.32.0"
    convert(dest / "drafter", converted, "0.32.0", dest / "target", source_revision=lock.drafter.revision)
    provenance = json.loads((converted / PROVENANCE_FILE).read_text())
    assert provenance["source_revision"] == lock.drafter.revision
    assert provenance["source_files"] == {
        f.path: {"sha256": f.sha256, "size_bytes": f.size_bytes,
                 "hashed_by": "model fetch (verified against the lock)"} for f in lock.drafter.files}
    # A file changed after fetch verified it is hashed again, never trusted.
    (dest / "drafter" / "config.json").write_text((dest / "drafter" / "config.json").read_text() + "\n")
    convert(dest / "drafter", converted, "0.32.0", dest / "target")
    provenance = json.loads((converted / PROVENANCE_FILE).read_text())
    assert provenance["source_files"]["config.json"]["hashed_by"] == "model convert"
    assert provenance["source_files"]["model.safetensors"]["hashed_by"].startswith("model fetch")
