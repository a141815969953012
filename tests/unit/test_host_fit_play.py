"""`b70ctl host fit --hosts -`: preflight's one call for every host of a play, each host's verdicts (GPU count and
binding, VRAM, RAM, firmware, kernel, the model store's free space) over its facts from the sysfs scenarios, and
the document the preflight role hands it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from b70ctl.host.fit import PlayHost
from b70host.facts import collect_facts
from sysfs_trees import REPO, build_tree

B70CTL = str(Path(sys.executable).with_name("b70ctl"))
GIB = 2**30


def fit(hosts: list[dict], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([B70CTL, "host", "fit", "--hosts", "-", *args], input=json.dumps(hosts),
                          capture_output=True, text=True, timeout=60)


def test_each_host_of_the_play_gets_every_verdict(tmp_path: Path) -> None:
    igpu = collect_facts(build_tree(tmp_path / "igpu", "b70-igpu"))
    old_kernel = collect_facts(build_tree(tmp_path / "old", "b70x2-switch-old-kernel"))
    unbound = collect_facts(build_tree(tmp_path / "unbound", "xe-unbound"))
    hosts = [
        # One B70 on a 64 GB host, but 10 GiB free where the models go.
        {"host": "small-disk", "recipe": "dspark-int4-tp1", "facts": igpu, "gpus": 1, "disk_free_bytes": 10 * GIB},
        # Cards without xe under Debian 11's kernel: the kernel plan brings the kernel that binds them, so the
        # binding, firmware and kernel verdicts wait for it.
        {"host": "pending", "recipe": "pr620-fp8-tp2", "facts": old_kernel, "gpus": 2, "disk_free_bytes": 500 * GIB,
         "kernel_plan_needed": True},
        # The same kind of cards unbound under 6.8 with no plan: refused for the binding and the kernel.
        {"host": "unbound", "recipe": "pr620-fp8-tp2", "facts": unbound, "gpus": 2, "disk_free_bytes": 500 * GIB},
        {"host": "cpu", "recipe": "cpu-tiny", "facts": igpu, "gpus": 0, "disk_free_bytes": 500 * GIB},
    ]
    result = fit(hosts, "--json")
    assert result.returncode == 1, result.stderr
    fits = json.loads(result.stdout)
    assert list(fits) == ["small-disk", "pending", "unbound", "cpu"]
    assert fits["small-disk"]["reasons"] == ["10.0 GiB free for the model store, recipe dspark-int4-tp1 needs 40 GiB: "
                                             "free space there, or set b70_model_store_dir to a larger filesystem"]
    assert fits["pending"]["fits"] and fits["pending"]["kernel"] is None and fits["pending"]["firmware"] is None
    assert fits["pending"]["gpus"]["usable_gpu_count"] == 2
    assert not fits["unbound"]["fits"] and len(fits["unbound"]["reasons"]) == 2
    assert "bound to xe, host has 0" in fits["unbound"]["reasons"][0]
    assert fits["unbound"]["reasons"][1].startswith("kernel 6.8.0-45-generic is older than 6.14")
    assert fits["cpu"]["fits"] and fits["cpu"]["reasons"] == []
    people = fit(hosts)
    assert people.returncode == 1 and people.stdout.splitlines()[0].startswith("FAIL small-disk: 10.0 GiB free")
    assert "ok pending: recipe pr620-fp8-tp2 fits" in people.stdout


def test_the_preflight_role_hands_over_exactly_a_play_host() -> None:
    tasks = yaml.safe_load((REPO / "roles/preflight/tasks/host.yml").read_text())
    handed = next(task for task in tasks if task["name"] == "Name what the fit needs of this host")
    assert set(handed["ansible.builtin.set_fact"]["preflight_fit_input"]) == set(PlayHost.model_fields)
    call = next(task for task in tasks if task["name"] == "Ask b70ctl whether each host's recipe fits it")
    assert call["ansible.builtin.command"]["argv"][1:] == ["host", "fit", "--hosts", "-", "--json"]


@pytest.mark.parametrize(("args", "stdin", "named"), [
    ([], [{"host": "a"}], "--hosts -: 0.recipe: Field required"),
    ([], {"host": "a"}, "--hosts -: (top level): Input should be a valid array"),
    (["--recipe", "cpu-tiny"], [], "--hosts names each host's recipe and facts"),
])
def test_a_bad_play_is_one_line_and_exit_2(args: list[str], stdin: object, named: str) -> None:
    result = subprocess.run([B70CTL, "host", "fit", "--hosts", "-", *args], input=json.dumps(stdin),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and named in result.stderr, result.stderr
