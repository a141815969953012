"""`b70ctl model stage`: the model_store role's controller side in one command, for every recipe of a play. Run
against the local hub: each recipe is fetched once and verified, its drafter converted where the recipe says so,
and each host's files described; a drafter of another model is refused before anything is described to send."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from b70ctl.lock.model import load_recipe_and_lock
from b70ctl.lock.resolve import resolve_and_write
from b70ctl.models.convert import PROVENANCE_FILE
from b70ctl.models.stage import StagedModels
from store_fixtures import drafter_config, drafter_files, write_recipe

B70CTL = str(Path(sys.executable).with_name("b70ctl"))


def stage(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([B70CTL, "model", "stage", *args], capture_output=True, text=True, timeout=300)


def test_each_recipe_is_staged_once_converted_and_described_by_the_locked_hashes(hub_env, tmp_path):
    recipe_file = write_recipe(tmp_path)
    resolve_and_write(str(recipe_file))
    _, lock, _ = load_recipe_and_lock(str(recipe_file))
    cache = tmp_path / "cache"
    # Two hosts of the play name the same recipe: it is fetched and described once.
    run = stage("--json", "--dest-root", str(cache), str(recipe_file), str(recipe_file))
    assert run.returncode == 0, run.stderr
    staged = StagedModels.model_validate_json(run.stdout)
    assert list(staged.recipes) == [str(recipe_file)]
    entry = staged.recipes[str(recipe_file)]
    assert entry.name == "store-test" and entry.refused is None
    assert entry.fetched.dest == str(cache / "store-test") and entry.fetched.changed
    target, drafter = entry.installs
    assert (target.name, target.manifest.directory) == ("target", str(cache / "store-test" / "target"))
    assert {(f.path, f.sha256) for f in target.manifest.files} == {(f.path, f.sha256) for f in lock.target.files}
    # The recipe's drafter needs converting: the host receives the converted copy, its weights by the lock's hash.
    assert (drafter.name, drafter.manifest.directory) == ("drafter", str(cache / "store-test" / "drafter-converted"))
    sent = {f.path: f.sha256 for f in drafter.manifest.files}
    assert PROVENANCE_FILE in sent
    weight = next(f for f in lock.drafter.files if f.path == "model.safetensors")
    assert sent["model.safetensors"] == weight.sha256
    converted = json.loads((cache / "store-test" / "drafter-converted" / "config.json").read_text())
    assert converted["architectures"] == ["Qwen3DSparkModel"]

    # Again: nothing fetched, and of all the weights none is read; only the converter's two small files are hashed.
    again = StagedModels.model_validate_json(stage("--json", "--dest-root", str(cache), str(recipe_file)).stdout)
    assert not again.recipes[str(recipe_file)].fetched.changed
    small = sum((cache / "store-test" / "drafter-converted" / name).stat().st_size
                for name in ("config.json", PROVENANCE_FILE))
    assert [install.manifest.hashed_bytes for install in again.recipes[str(recipe_file)].installs] == [0, small]


def test_a_drafter_of_another_model_is_refused_and_nothing_is_described(hub_env, tmp_path):
    hub, _ = hub_env
    hub.repo("acme/foreign-dspark").commit(drafter_files(config=drafter_config(vocab_size=151936)))
    recipe_file = write_recipe(tmp_path, "foreign", drafter={"repo": "acme/foreign-dspark", "revision": "main",
                                                             "needs_conversion": True})
    resolve_and_write(str(recipe_file))
    cache = tmp_path / "cache"
    run = stage("--json", "--dest-root", str(cache), str(recipe_file))
    assert run.returncode == 0, run.stderr  # the play fails the hosts of this recipe, not the command
    entry = StagedModels.model_validate_json(run.stdout).recipes[str(recipe_file)]
    assert entry.refused == (f"the drafter {cache}/foreign/drafter has vocab_size 151936, the target 1024: it is a "
                             "drafter of another model. Fix: point the recipe's drafter at the drafter trained for "
                             "this target.")
    assert entry.installs == [] and not (cache / "foreign" / "drafter-converted").exists()

    human = stage("--dest-root", str(cache), str(recipe_file))
    assert human.returncode == 1
    assert f"{recipe_file}: REFUSED: the drafter" in human.stdout


def test_a_recipe_that_cannot_be_read_is_one_line_and_exit_2(tmp_path):
    run = stage("--json", "--dest-root", str(tmp_path), str(tmp_path / "missing.yaml"))
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1 and "missing.yaml" in run.stderr
    assert run.stdout == ""
