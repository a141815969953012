"""The rehearsal of both B70 routes (tests/appliance/rehearsal.py; make rehearse): each recipe's own host stage,
image, units and report on a systemd test host with two emulated B70s, served by vLLM's CPU build at the base's
release from a stand-in of that base: route a (pr620-fp8-tp2) on intel/llm-scaler-vllm:0.21.0-b3.1 with vLLM 0.21
and llm-scaler's multi-arc patch, route b (dspark-int4-tp1) on vllm/vllm-openai-xpu:v0.29.0 with vLLM 0.29.

It fails where a B70 host would fail to start: a unit the image cannot run (the XPU images once exec'd `--model`),
an image that does not build on its base's layout, a play that refuses the recipe, a server that rejects a rendered
option the overlay does not name, or a report that does not say what was served.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from b70ctl.recipes import load_recipe
from b70ctl.serve.rehearsal import recipe_overlay
from provision import REPO_ROOT, HostUnderTest, assert_recap, on, run_testhosts, start_hosts
from rehearsal import API_KEY, B70CTL, PORT, STANDINS, Rehearsal, forget_serving, rehearse, started_line

pytestmark = [pytest.mark.appliance, pytest.mark.timeout(2400)]

HOST_PREFIX = "b70-reh"
HOST_SUBNET = "172.30.78.0/24"


def standin_release(recipe: str) -> str:
    """The vLLM release line the recipe's stand-in carries: its Dockerfile's VLLM_VERSION default, e.g. "0.21."."""
    dockerfile = REPO_ROOT / "images" / "standins" / STANDINS[recipe] / "Dockerfile"
    version = re.search(r"^ARG VLLM_VERSION=(\d+\.\d+)\.", dockerfile.read_text(), re.MULTILINE)
    assert version is not None, dockerfile
    return version.group(1) + "."


@pytest.fixture(scope="module")
def rehearsal_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HostUnderTest, str, Path]]:
    """One systemd test host with two emulated B70s for both routes (make rehearse gives each its own): what a
    route leaves on it is removed before the next (rehearsal.forget_serving)."""
    if os.geteuid() != 0:
        pytest.fail("the appliance tests need root (they install and start a docker engine): run them as root")
    work_dir = tmp_path_factory.mktemp("rehearsal")
    try:
        hosts, ssh_key = start_hosts(HOST_PREFIX, HOST_SUBNET, {1: "b70x2-switch-192gb"}, work_dir,
                                     fresh=os.environ.get("B70_KEEP_TESTHOSTS") != "1")
        yield hosts[0], ssh_key, work_dir
    finally:
        if os.environ.get("B70_KEEP_TESTHOSTS") != "1":
            run_testhosts("down", "--prefix", HOST_PREFIX)


@pytest.fixture(scope="module", params=sorted(STANDINS))
def rehearsed(request: pytest.FixtureRequest, rehearsal_host) -> tuple[Rehearsal, str]:
    """One recipe's rehearsal (pytest runs every test of one recipe before the next)."""
    host, ssh_key, work_dir = rehearsal_host
    recipe = request.param
    forget_serving(host.name)
    recipe_dir = work_dir / recipe
    recipe_dir.mkdir()
    return rehearse(recipe, host, ssh_key, recipe_dir, recipe_dir / "reports"), host.name


def test_each_stand_in_carries_the_release_line_its_recipe_pins() -> None:
    for recipe in STANDINS:
        assert load_recipe(recipe).vllm_version.startswith(standin_release(recipe)), recipe


def test_the_units_as_rendered_stop_only_at_the_refusal_the_overlay_quotes(rehearsed) -> None:
    """With every option the overlay drops still in (only the values it replaces set), the rendered speculative
    server passes vLLM's parser and SpeculativeConfig (route b: dspark, k=7, probabilistic on 0.29; route a: dflash,
    k=4, the DSpark drafter loaded by the patched 0.21) and is refused by the CPU build for the reason the overlay
    gives: no other refusal comes first."""
    rehearsal, _ = rehearsed
    overlay = recipe_overlay(rehearsal.recipe)
    assert rehearsal.unrehearsed.returncode != 0, rehearsal.unrehearsed.output[-3000:]
    for dropped in overlay.drop:
        assert dropped.refusal in rehearsal.unrehearsed_journal, rehearsal.unrehearsed_journal[-4000:]
    assert "unrecognized arguments" not in rehearsal.unrehearsed_journal
    assert "invalid option" not in rehearsal.unrehearsed_journal  # bash's refusal of an exec'd `--model`


def test_the_rehearsed_units_start_through_the_real_exec_start(rehearsed) -> None:
    rehearsal, host = rehearsed
    assert_recap(rehearsal.serve, [host], failed=0)
    remote = on(host)
    for unit in ("b70-vllm", "b70-vllm-baseline"):
        assert remote.service(unit).is_running, unit
    assert started_line(rehearsal.journal), rehearsal.journal[-3000:]

    # The unit's ExecStart is the render for this host, with exactly the overlay's changes.
    topology = remote.file("/etc/b70/topology.json").content_string
    models = remote.file("/etc/b70/models.json").content_string
    common = ["serve", "units", "--json", "--recipe", rehearsal.recipe, "--image", rehearsal.image_id,
              "--models-record", models, "--config-dir", "/etc/b70/serve", "--user", "b70", "--baseline-unit",
              "b70-vllm-baseline", "--topology", "-", "--api-key-env-file", "/etc/b70/serve/api-key.env"]
    renders = {}
    for label, extra in (("as rendered", []), ("rehearsed", ["--rehearsal"])):
        result = subprocess.run([str(B70CTL), *common, *extra], input=topology, capture_output=True, text=True,
                                check=True)
        renders[label] = {server["unit"]: server for server in json.loads(result.stdout)["servers"]}
    unit_file = remote.file("/etc/systemd/system/b70-vllm.service").content_string
    exec_line = next(line for line in unit_file.splitlines() if line.startswith("ExecStart="))
    assert exec_line == "ExecStart=" + renders["rehearsed"]["b70-vllm"]["exec_start_line"]
    as_rendered = shlex.split(renders["as rendered"]["b70-vllm"]["exec_start_line"])
    rehearsed_words = shlex.split(exec_line.removeprefix("ExecStart="))
    at = as_rendered.index(rehearsal.image_id)
    # Everything up to the image (docker's options, env files, mounts, devices) is the B70 host's.
    assert rehearsed_words[:at + 1] == as_rendered[:at + 1]
    overlay = recipe_overlay(rehearsal.recipe)
    expected = list(as_rendered[at + 1:])
    for dropped in overlay.drop:
        index = expected.index(dropped.option)
        del expected[index:index + 2]
    for replaced in overlay.replace:
        expected[expected.index(replaced.option) + 1] = replaced.value
    assert rehearsed_words[at + 1:] == expected


def test_verify_reports_the_rehearsal_with_its_exec_start_and_overlay(rehearsed) -> None:
    rehearsal, host = rehearsed
    assert rehearsal.verify.returncode == 0, rehearsal.verify.output[-4000:]
    report = (rehearsal.report_dir / "report.md").read_text()
    data = json.loads((rehearsal.report_dir / "report.json").read_text())
    exec_start = on(host).file("/etc/systemd/system/b70-vllm.service").content_string
    exec_line = next(line for line in exec_start.splitlines() if line.startswith("ExecStart="))
    assert exec_line in report
    assert "**Rehearsal:**" in report and "removed --speculative-config" in report
    assert data["environment"]["serve_exec_start"] == exec_line.removeprefix("ExecStart=")
    assert data["environment"]["rehearsal"][0].startswith("models: ")
    assert data["environment"]["vllm_version"] is None or \
        data["environment"]["vllm_version"].startswith(standin_release(rehearsal.recipe))
    assert API_KEY not in report and str(PORT) in data["endpoint"]
