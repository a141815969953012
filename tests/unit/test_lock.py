"""The lock: resolved against a local hub and a local OCI registry through the real clients; the appliance hash
moves with every pinned input and with nothing else; unresolved locks are refused, never filled in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.errors import BadInput
from b70ctl.lock.model import (
    Lock,
    appliance_hash,
    load_lock_file,
    load_recipe_and_lock,
    lock_path_for,
    require_resolved,
)
from b70ctl.lock.registry import parse_reference, require_digest, resolve_tag
from b70ctl.lock.resolve import parse_series, patch_series_pin, resolve_and_write
from b70ctl.recipes import load_recipe, recipe_path
from local_endpoints import LocalRegistry
from store_fixtures import DRAFTER_REPO, TARGET_REPO, drafter_files, sha256, target_files, write_recipe

runner = CliRunner()


class Invocation:
    """A CLI run as `b70ctl` would end it: BadInput is exit 2 with its one-line message (main() maps it)."""

    def __init__(self, args: list[str]) -> None:
        result = runner.invoke(app, args)
        self.stdout = result.stdout
        self.error = str(result.exception) if isinstance(result.exception, BadInput) else None
        self.exit_code = BadInput.exit_code if self.error is not None else result.exit_code
        if result.exception is not None and self.error is None and not isinstance(result.exception, SystemExit):
            raise result.exception


def test_resolve_pins_commit_files_and_image_digest(hub_env, tmp_path):
    hub, registry = hub_env
    recipe_file = write_recipe(tmp_path)
    _recipe, outcome = resolve_and_write(str(recipe_file))
    lock = outcome.lock
    assert outcome.written and lock.resolved and outcome.unresolved == {}
    assert outcome.lock_path == tmp_path / "store-test.lock.json"

    assert lock.target.revision == hub.repo(TARGET_REPO).refs["main"]
    assert lock.drafter is not None and lock.drafter.revision == hub.repo(DRAFTER_REPO).refs["main"]
    expected_target = {name: (sha256(data), len(data)) for name, data in target_files().items()
                       if name != "README.md"}  # README.md matches no include pattern
    assert {f.path: (f.sha256, f.size_bytes) for f in lock.target.files} == expected_target
    assert {f.path: f.sha256 for f in lock.drafter.files} == {n: sha256(d) for n, d in drafter_files().items()}

    manifest = registry.manifests[("b70/vllm-native", "v1")]
    assert lock.image.digest == "sha256:" + sha256(manifest)
    assert lock.image.tag == "v1" and lock.image.resolved
    # The registry was asked with the manifest types a multi-arch pin needs, and through its token challenge.
    manifest_requests = [r for r in registry.requests if "/manifests/" in r["path"]]
    assert "application/vnd.oci.image.index.v1+json" in manifest_requests[0]["accept"]
    assert manifest_requests[-1]["authorization"] == f"Bearer {registry.token}"
    assert lock.patch_series.applicable is False and lock.patch_series.resolved

    on_disk = load_lock_file(outcome.lock_path)
    assert on_disk == lock
    # Resolving again when nothing moved rewrites nothing.
    _, again = resolve_and_write(str(recipe_file))
    assert again.written is False and again.lock == lock


def test_resolve_follows_a_moved_branch_and_the_hash_follows(hub_env, tmp_path):
    hub, _ = hub_env
    recipe_file = write_recipe(tmp_path)
    recipe, first = resolve_and_write(str(recipe_file))
    old_revision = first.lock.drafter.revision
    new_revision = hub.repo(DRAFTER_REPO).commit(drafter_files(seed=99))
    _, second = resolve_and_write(str(recipe_file))
    assert second.written
    assert second.lock.drafter.revision == new_revision != old_revision
    assert f"drafter revision {old_revision} -> {new_revision}" in second.changes
    assert appliance_hash(recipe, second.lock) != appliance_hash(recipe, first.lock)


def test_resolve_cli_writes_json_and_names_a_missing_revision(hub_env, tmp_path):
    recipe_file = write_recipe(tmp_path, drafter={"repo": DRAFTER_REPO, "revision": "no-such-branch"})
    result = Invocation(["lock", "resolve", "--recipe", str(recipe_file), "--json"])
    assert result.exit_code == 2
    assert "revision 'no-such-branch' of acme/tiny-dspark does not exist" in result.error
    printed = json.loads(result.stdout)
    assert printed["resolved"] is False and list(printed["unresolved"]) == ["drafter"]
    # The partial lock is written (it improves on nothing) and says what is missing; nothing is invented.
    lock = load_lock_file(tmp_path / "store-test.lock.json")
    assert lock.resolved is False and lock.target.resolved
    assert lock.drafter.revision is None and lock.drafter.files == []
    assert "no-such-branch" in lock.drafter.unresolved_reason


def test_a_resolved_lock_is_never_replaced_by_a_worse_one(hub_env, tmp_path, monkeypatch):
    recipe_file = write_recipe(tmp_path)
    _, outcome = resolve_and_write(str(recipe_file))
    before = outcome.lock_path.read_bytes()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: the hub is unreachable
    result = Invocation(["lock", "resolve", "--recipe", str(recipe_file)])
    assert result.exit_code == 2
    assert "unreachable" in result.error and "the resolved lock on disk was kept" in result.error
    assert outcome.lock_path.read_bytes() == before


def test_offline_resolve_keeps_network_pins_whose_inputs_did_not_change(hub_env, tmp_path, monkeypatch):
    recipe_file = write_recipe(tmp_path)
    _, outcome = resolve_and_write(str(recipe_file))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    _, offline = resolve_and_write(str(recipe_file), offline=True)
    assert offline.written is False and offline.lock == outcome.lock
    # A changed input cannot keep its old pin offline: it becomes unresolved, never guessed.
    moved = write_recipe(tmp_path, drafter={"repo": DRAFTER_REPO, "revision": "v2"})
    _, changed = resolve_and_write(str(moved), lock_path=tmp_path / "other.lock.json", offline=True)
    assert changed.lock.drafter.resolved is False and changed.lock.drafter.revision is None


def test_shipped_b70_locks_are_explicitly_unresolved_and_refused():
    for name in ("pr620-fp8-tp2", "dspark-int4-tp1"):
        _recipe, lock, path = load_recipe_and_lock(name)
        assert path == recipe_path(name).with_name(f"{name}.lock.json")
        assert lock.resolved is False
        assert {"image", "target", "drafter"} <= set(lock.unresolved_fields())
        assert lock.image.digest is None and lock.image.base_digest is None
        for pin in lock.models():
            assert pin.revision is None and pin.files == [] and not pin.resolved
        with pytest.raises(BadInput) as refused:
            require_resolved(lock)
        assert str(refused.value) == (f"lock for {name} is not resolved: run b70ctl lock resolve --recipe {name} "
                                      "where the hub and registry are reachable")
        result = Invocation(["model", "fetch", "--recipe", name, "--dest", "/nonexistent/never-created"])
        assert result.exit_code == 2 and result.error == str(refused.value)
        assert not Path("/nonexistent/never-created").exists()


def test_shipped_cpu_tiny_lock_pins_the_generator_spec_and_a_local_build():
    recipe, lock, _ = load_recipe_and_lock("cpu-tiny")
    assert lock.resolved
    assert lock.image.local_build and lock.image.digest is None
    assert lock.target.generated is not None and lock.target.generated.role == "target"
    assert lock.drafter.generated.role == "draft-perturbed"
    assert lock.target.generated.spec == recipe.tiny.model_dump(mode="json")
    # The shipped file is exactly what resolve produces today (resolve needs no network for cpu-tiny).
    from b70ctl.lock.resolve import resolve_lock

    assert resolve_lock(recipe, repo_root=Path(__file__).parents[2]) == lock


def test_lock_that_claims_resolved_without_pins_is_refused(tmp_path):
    _, lock, _ = load_recipe_and_lock("dspark-int4-tp1")
    data = lock.model_dump(mode="json")
    data["resolved"] = True
    path = tmp_path / "forged.lock.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BadInput, match="resolved is True but unresolved fields"):
        load_lock_file(path)
    data = lock.model_dump(mode="json")
    data["target"]["revision"] = "0" * 40  # a revision on an unresolved pin: half-invented
    path.write_text(json.dumps(data))
    with pytest.raises(BadInput, match=r"target: .*must not carry a revision"):
        load_lock_file(path)


# --- the appliance hash ------------------------------------------------------------------------------------------


def _reformatted_copy(tmp_path: Path, name: str) -> Path:
    """The same recipe and lock with other key order, indentation and comments."""
    source = recipe_path(name)
    data = yaml.safe_load(source.read_text())
    reordered = dict(reversed(list(data.items())))
    recipe_copy = tmp_path / f"{name}.yaml"
    recipe_copy.write_text("# reformatted copy\n" + yaml.safe_dump(reordered, sort_keys=False, indent=4,
                                                                       default_flow_style=False, width=200))
    lock_data = json.loads(lock_path_for(name).read_text())
    (tmp_path / f"{name}.lock.json").write_text(json.dumps(dict(reversed(list(lock_data.items()))), indent=7))
    return recipe_copy


@pytest.mark.parametrize("name", ["cpu-tiny", "pr620-fp8-tp2"])
def test_appliance_hash_ignores_formatting(tmp_path, name):
    recipe, lock, _ = load_recipe_and_lock(name)
    copy = _reformatted_copy(tmp_path, name)
    assert copy.read_text() != recipe_path(name).read_text()
    copy_recipe, copy_lock, _ = load_recipe_and_lock(str(copy))
    assert appliance_hash(copy_recipe, copy_lock) == appliance_hash(recipe, lock)
    cli = Invocation(["lock", "hash", "--recipe", str(copy), "--json"])
    assert cli.exit_code == 0
    assert json.loads(cli.stdout)["appliance_hash"] == appliance_hash(recipe, lock)


def test_appliance_hash_moves_with_every_pinned_input(hub_env, tmp_path):
    recipe_file = write_recipe(tmp_path)
    recipe, outcome = resolve_and_write(str(recipe_file))
    lock = outcome.lock
    base = appliance_hash(recipe, lock)
    first_file = lock.target.files[0]
    variants: dict[str, Lock] = {
        "image digest": lock.model_copy(update={"image": lock.image.model_copy(
            update={"digest": "sha256:" + "2" * 64})}),
        "target revision": lock.model_copy(update={"target": lock.target.model_copy(
            update={"revision": "3" * 40})}),
        "file sha256": lock.model_copy(update={"target": lock.target.model_copy(update={"files": [
            first_file.model_copy(update={"sha256": "4" * 64}), *lock.target.files[1:]]})}),
        "file size": lock.model_copy(update={"target": lock.target.model_copy(update={"files": [
            first_file.model_copy(update={"size_bytes": first_file.size_bytes + 1}), *lock.target.files[1:]]})}),
        "vllm version": lock.model_copy(update={"vllm_version": "0.33.0"}),
    }
    hashes = {what: appliance_hash(recipe, variant) for what, variant in variants.items()}
    assert base not in hashes.values()
    assert len(set(hashes.values())) == len(hashes)
    changed_recipe = recipe.model_copy(update={"serve": recipe.serve.model_copy(update={"max_model_len": 4096})})
    assert appliance_hash(changed_recipe, lock) != base
    assert appliance_hash(recipe, lock) == base


# --- registry ----------------------------------------------------------------------------------------------------


def test_reference_parsing_follows_docker_rules():
    assert parse_reference("intel/vllm:0.29").registry == "registry-1.docker.io"
    assert parse_reference("intel/vllm:0.29").repository == "intel/vllm"
    assert parse_reference("ubuntu").repository == "library/ubuntu"
    ghcr = parse_reference("ghcr.io/rmacy/qwen38-fp8-dspark", "v8")
    assert (ghcr.registry, ghcr.repository, ghcr.tag) == ("ghcr.io", "rmacy/qwen38-fp8-dspark", "v8")
    local = parse_reference("localhost:5000/b70/x:1@sha256:" + "a" * 64)
    assert (local.registry, local.repository, local.tag, local.digest) == (
        "localhost:5000", "b70/x", "1", "sha256:" + "a" * 64)


def test_registry_digest_from_get_when_head_omits_it():
    server = LocalRegistry(digest_header_on_head=False)
    digest = server.push("b70/plain", "v3", {"schemaVersion": 2, "layers": []})
    server.start()
    try:
        assert resolve_tag("registry.example/b70/plain", "v3", registry_url=server.url) == digest
        assert [r["method"] for r in server.requests] == ["HEAD", "GET"]
    finally:
        server.stop()


def test_registry_digest_that_does_not_exist_is_named(registry):
    missing = "sha256:" + "9" * 64
    with pytest.raises(BadInput) as error:
        require_digest("registry.example/b70/vllm-native", missing, registry_url=registry.url)
    assert missing in str(error.value) and "does not exist" in str(error.value)
    with pytest.raises(BadInput, match=missing):
        resolve_tag(f"registry.example/b70/vllm-native@{missing}", registry_url=registry.url)
    with pytest.raises(BadInput, match="does not exist in its registry"):
        resolve_tag("registry.example/b70/vllm-native", "v404", registry_url=registry.url)
    present = "sha256:" + sha256(registry.manifests[("b70/vllm-native", "v1")])
    require_digest("registry.example/b70/vllm-native", present, registry_url=registry.url)


def test_resolve_of_a_recipe_pinned_to_a_missing_digest_fails_naming_it(hub_env, tmp_path):
    missing = "sha256:" + "8" * 64
    recipe_file = write_recipe(tmp_path, image={"reference": f"registry.example/b70/vllm-native@{missing}",
                                                "source": "pull"})
    result = Invocation(["lock", "resolve", "--recipe", str(recipe_file)])
    assert result.exit_code == 2
    assert missing in result.error and result.error.startswith("image: ")


# --- patch series ------------------------------------------------------------------------------------------------


def test_patch_series_hashes_and_declared_hash_mismatch(tmp_path):
    recipe = load_recipe("pr620-fp8-tp2")
    patches = tmp_path / "images/xpu-dspark-0.21/patches"
    patches.mkdir(parents=True)
    (patches / "0001-a.patch").write_text("--- a\n+++ b\n")
    (patches / "0002-b.patch").write_text("--- c\n+++ d\n")
    good_sha = sha256(b"--- a\n+++ b\n")
    (patches / "series").write_text(f"# comment\nbase-vllm 0.21.0\n0001-a.patch  {good_sha}  first\n0002-b.patch\n")
    pin = patch_series_pin(recipe, tmp_path)
    assert pin.resolved and pin.base_vllm_version == "0.21.0"
    assert [(p.path, p.sha256) for p in pin.patches] == [("0001-a.patch", good_sha),
                                                          ("0002-b.patch", sha256(b"--- c\n+++ d\n"))]
    assert pin.series_sha256 == sha256((patches / "series").read_bytes())

    (patches / "0001-a.patch").write_text("--- changed\n")
    broken = patch_series_pin(recipe, tmp_path)
    assert not broken.resolved and "declares sha256" in broken.unresolved_reason
    assert broken.series_sha256 is None and broken.patches == []
    (patches / "series").unlink()
    absent = patch_series_pin(recipe, tmp_path)
    assert not absent.resolved and absent.applicable and "does not exist" in absent.unresolved_reason


def test_parse_series_reads_directives_and_optional_hashes():
    directives, patches = parse_series("base-vllm 0.21.0\n# x\n\n0001.patch -p1\n0002.diff " + "ab" * 32 + " why\n")
    assert directives == {"base-vllm": "0.21.0"}
    assert patches == [("0001.patch", None), ("0002.diff", "ab" * 32)]


def test_cli_entry_point_prints_one_line_error_and_exit_2(tmp_path):
    completed = subprocess.run([str(Path(sys.executable).with_name("b70ctl")), "model", "fetch", "--recipe",
                                "pr620-fp8-tp2", "--dest", str(tmp_path / "d")], capture_output=True, text=True)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [
        "error: lock for pr620-fp8-tp2 is not resolved: run b70ctl lock resolve --recipe pr620-fp8-tp2 where the "
        "hub and registry are reachable"]


def test_a_lock_whose_recipe_inputs_changed_is_stale(hub_env, tmp_path):
    recipe_file = write_recipe(tmp_path)
    resolve_and_write(str(recipe_file))
    write_recipe(tmp_path, image={"reference": "registry.example/b70/vllm-native", "tag": "v2", "source": "pull"})
    with pytest.raises(BadInput) as error:
        load_recipe_and_lock(str(recipe_file))
    assert str(error.value) == (f"lock for store-test is stale: the recipe's image changed since it was resolved: "
                                f"run b70ctl lock resolve --recipe {recipe_file}")
    _, outcome = resolve_and_write(str(recipe_file))  # re-resolving follows the new tag... which does not exist
    assert outcome.kept_previous is False and outcome.lock.image.resolved is False
    assert "does not exist in its registry" in outcome.unresolved["image"]


def test_every_shipped_lock_matches_its_recipe():
    from b70ctl.lock.model import stale_inputs
    from b70ctl.recipes import recipe_names

    for name in recipe_names():
        recipe = load_recipe(name)
        lock = load_lock_file(lock_path_for(name))
        assert stale_inputs(recipe, lock) == [], f"{name}: run b70ctl lock resolve --recipe {name} --offline"
