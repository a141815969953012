"""The rehearsal overlay (control/b70ctl/serve/rehearsal.yaml) changes what a rehearsal serves in exactly two ways:
the models, and server options the CPU build cannot run. These tests hold `b70ctl serve units --rehearsal` to that:
the units, environment files and container record are the B70 host's, and the server's arguments differ only in
the overlay's options. Each option it names is one vLLM's own parser knows (the real vLLM in this venv), and the
refusal it quotes is the one the rehearsal reads from the CPU build on a test host."""

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
from b70ctl.serve.rehearsal import OVERLAY_PATH, apply_overlay, load_overlay
from b70ctl.serve.render import ServeCommand
from b70host.topology import TOPOLOGY_PATH, topology
from sysfs_trees import build_tree
from vllm_import import builtin_sys_intern

B70CTL = str(Path(sys.executable).with_name("b70ctl"))
MODELS = {"target": {"path": "/var/lib/b70/models/{recipe}/target", "revision": "r1"},
          "drafter": {"path": "/var/lib/b70/models/{recipe}/drafter", "revision": "r1"}}


def host_units(recipe: str, tmp_path: Path, *extra: str) -> dict:
    root = build_tree(tmp_path, "b70x2-switch")
    tensor_parallel = 2 if recipe == "pr620-fp8-tp2" else 1
    topology(root, tensor_parallel, probe="never", write=True)
    record = json.dumps(MODELS).replace("{recipe}", recipe)
    result = CliRunner().invoke(app, [
        "serve", "units", "--json", "--recipe", recipe, "--image", "sha256:" + "b" * 64, "--models-record", record,
        "--config-dir", "/etc/b70/serve", "--user", "b70", "--baseline-unit", "b70-vllm-baseline",
        "--topology", str(Path(root) / TOPOLOGY_PATH.lstrip("/")), *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("recipe", sorted(load_overlay().recipes))
def test_the_overlay_changes_only_the_options_it_lists(recipe: str, tmp_path: Path) -> None:
    plain = host_units(recipe, tmp_path / "plain")
    rehearsed = host_units(recipe, tmp_path / "rehearsed", "--rehearsal")
    overlay = load_overlay().recipes[recipe]
    assert rehearsed["container_json"] == plain["container_json"]
    assert rehearsed["config_files"] == plain["config_files"]
    for before, after in zip(plain["servers"], rehearsed["servers"], strict=True):
        # Unit file, environment file and every docker option: the B70 host's.
        assert after["env_file"] == before["env_file"]
        before_unit = [line for line in before["unit_file"].splitlines() if not line.startswith("ExecStart=")]
        assert [line for line in after["unit_file"].splitlines() if not line.startswith("ExecStart=")] == before_unit
        assert after["exec_start_line"].startswith(before["exec_start_line"].split('"--model"')[0])
    served_before = json.loads(plain["serve_json"])
    served_after = json.loads(rehearsed["serve_json"])
    assert served_before["rehearsal"] is None
    assert served_after["rehearsal"] == overlay.model_dump()
    assert served_after["env"] == served_before["env"] and served_after["docker_args"] == served_before["docker_args"]
    expected = list(served_before["argv"])
    for dropped in overlay.drop:
        at = expected.index(dropped.option)
        del expected[at:at + 2]
    for replaced in overlay.replace:
        expected[expected.index(replaced.option) + 1] = replaced.value
    assert served_after["argv"] == expected
    assert served_after["argv"] != served_before["argv"]


def test_every_option_the_overlay_names_is_one_of_vllms_own() -> None:
    with builtin_sys_intern():
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

    known = {option for action in make_arg_parser(FlexibleArgumentParser())._actions
             for option in action.option_strings}
    for recipe in load_overlay().recipes.values():
        for change in [*recipe.drop, *recipe.replace]:
            assert change.option in known, change.option
        for dropped in recipe.drop:
            assert f'"{dropped.refusal}"' in dropped.why, "the why quotes the refusal the rehearsal reads"


def test_the_overlay_admits_only_models_and_server_options(tmp_path: Path) -> None:
    data = yaml.safe_load(OVERLAY_PATH.read_text())
    recipe = next(iter(data["recipes"]))
    for key, value in (("env", {"VLLM_CPU_KVCACHE_SPACE": "1"}), ("image", "other"), ("docker_args", ["--cpus"])):
        broken = json.loads(json.dumps(data))
        broken["recipes"][recipe][key] = value
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump(broken))
        with pytest.raises(BadInput, match=key):
            load_overlay.__wrapped__(path)


def test_an_overlay_out_of_date_with_its_recipe_is_refused() -> None:
    overlay = load_overlay().recipes["dspark-int4-tp1"]
    command = ServeCommand(argv=["--model", "/models/target", "--port", "8000"], env={})
    with pytest.raises(BadInput, match="--speculative-config, which the render does not hold"):
        apply_overlay(command, overlay)
    # The baseline has no speculative config: only what it holds is changed.
    baseline = apply_overlay(ServeCommand(argv=["--model", "m", "--gpu-memory-utilization=0.90"], env={}), overlay,
                             speculative=False)
    assert baseline.argv == ["--model", "m", "--gpu-memory-utilization", "0.05"]


def units_command(tmp_path: Path, recipe: str, tensor_parallel: int, *flags: str) -> subprocess.CompletedProcess:
    """`b70ctl serve units` for RECIPE on a dual-B70 tree, as a process: what an owner sees on stderr and exit."""
    root = build_tree(tmp_path, "b70x2-switch")
    topology(root, tensor_parallel, probe="never", write=True)
    record = json.dumps(MODELS).replace("{recipe}", recipe)
    return subprocess.run([
        B70CTL, "serve", "units", "--json", "--recipe", recipe, "--image", "sha256:" + "b" * 64,
        "--models-record", record, "--config-dir", "/etc/b70/serve", "--user", "b70", *flags,
        "--topology", str(Path(root) / TOPOLOGY_PATH.lstrip("/"))], capture_output=True, text=True)


def test_rehearsal_of_a_recipe_without_an_overlay_is_one_line_exit_2(tmp_path: Path) -> None:
    result = units_command(tmp_path, "mtp3-int4-tp2", 2, "--rehearsal")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: --rehearsal: recipe mtp3-int4-tp2 has no rehearsal overlay")
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("recipe", sorted(load_overlay().recipes))
def test_the_first_start_keeps_every_dropped_option_and_sets_only_the_replaced_values(recipe: str,
                                                                                       tmp_path: Path) -> None:
    """--rehearsal-keep-dropped: the rehearsal's first start, whose journal must hold each drop's refusal."""
    plain = json.loads(host_units(recipe, tmp_path / "plain")["serve_json"])
    first = json.loads(host_units(recipe, tmp_path / "first", "--rehearsal", "--rehearsal-keep-dropped")["serve_json"])
    overlay = load_overlay().recipes[recipe]
    expected = list(plain["argv"])
    for replaced in overlay.replace:
        expected[expected.index(replaced.option) + 1] = replaced.value
    assert first["argv"] == expected
    assert all(dropped.option in first["argv"] for dropped in overlay.drop)
    assert first["rehearsal"]["drop"] == [] and first["rehearsal"]["replace"] == [
        change.model_dump() for change in overlay.replace]


def test_keep_dropped_without_a_rehearsal_is_one_line_exit_2(tmp_path: Path) -> None:
    result = units_command(tmp_path, "dspark-int4-tp1", 1, "--rehearsal-keep-dropped")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: --rehearsal-keep-dropped is a kind of --rehearsal: give both\n"
