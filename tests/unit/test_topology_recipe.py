"""The tensor-parallel group as real B70 hosts need it: only the recipe's GPUs by PCI id, p2p only when proven,
device nodes by /dev/dri/by-path, and a --write that stays under --root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app, main
from b70ctl.host.fit import host_fit
from b70ctl.host.memory import usable_gpus
from b70ctl.recipes import load_recipe
from b70host.facts import collect_facts
from b70host.topology import (
    CCL_PROFILES,
    TOPOLOGY_PATH,
    PairTopology,
    Probe,
    TopologyRefused,
    all_pairs,
    analyse,
    decide,
    topology,
)
from host_package import host_module
from sysfs_trees import REPO, build_tree

# docs/facts.md, Hardware: "Arc Pro B70 = Battlemage G31, PCI id 8086:e223 ... Arc Pro B60 = 8086:e211"; the B580
# is 8086:e20b (G21 family "e202, e209, e20b-e20d, e210-e212, e215, e216").
B70_ID, B60_ID, B580_ID = "8086:e223", "8086:e211", "8086:e20b"
# tests/fixtures/sysfs.py: the two B70s sit at these addresses in both mixed trees, the other card at 0000:03:00.0.
B70_ADDRESSES = ["0000:09:00.0", "0000:0d:00.0"]


@pytest.fixture(autouse=True)
def no_ze_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("B70CTL_ZE_LOADER", str(tmp_path / "absent" / "libze_loader.so.1"))


def cli_topology(*args: str) -> dict:
    result = CliRunner().invoke(app, ["host", "topology", "--json", "--probe", "never", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("scenario, other_id", [("b70x2-b60", B60_ID), ("b70x2-b580", B580_ID)])
def test_the_recipe_group_is_its_b70s_only_and_fit_agrees(tmp_path: Path, scenario: str, other_id: str) -> None:
    root = build_tree(tmp_path, scenario)
    facts = collect_facts(root)
    assert [gpu["pci_id"] for gpu in facts["gpus"]] == [other_id, B70_ID, B70_ID]
    recipe = load_recipe("pr620-fp8-tp2")
    assert recipe.host.gpu_pci_ids == [B70_ID]
    document = cli_topology("--root", root, "--recipe", "pr620-fp8-tp2")
    by_index = {gpu["index"]: gpu for gpu in document["gpus"]}
    assert [by_index[index]["pci_address"] for index in document["group"]] == B70_ADDRESSES
    assert {by_index[index]["pci_id"] for index in document["group"]} == {B70_ID}
    assert document["tensor_parallel_size"] == recipe.serve.tensor_parallel_size == 2
    assert document["gpu_pci_ids"] == [B70_ID]
    assert any(reason.startswith("not of the recipe's PCI ids 8086:e223, not used: 0000:03:00.0")
               for reason in document["reasons"])
    # host fit counts the same GPUs the group is built from.
    fit = host_fit(recipe, facts)
    assert fit.gpus.fits and fit.gpus.usable_gpu_count == 2
    assert [gpu["pci_address"] for gpu in usable_gpus(recipe, facts)] == B70_ADDRESSES
    # Without the ids every xe-bound GPU is a candidate: a group of three takes the other card too.
    assert cli_topology("--root", root, "--tensor-parallel-size", "3")["group"] == [0, 1, 2]


def test_the_hosts_script_takes_the_recipes_ids(tmp_path: Path) -> None:
    """The gpu_topology role runs topology.py with the host's python3 and passes the ids as --pci-id."""
    root = build_tree(tmp_path, "b70x2-b60")
    script = subprocess.run(host_module("topology", "--root", root, "--probe", "never", "--tensor-parallel-size",
                                        "2", "--pci-id", B70_ID), capture_output=True, text=True, check=True,
                            cwd=tmp_path)
    from_script = json.loads(script.stdout)
    from_cli = cli_topology("--root", root, "--recipe", "pr620-fp8-tp2")
    assert from_script == from_cli
    # As the role passes them: the recipe's list after one --pci-id, the option after it; an empty list is any GPU.
    def group(*ids: str) -> list[int]:
        run = subprocess.run(host_module("topology", "--root", root, "--probe", "never", "--pci-id", *ids,
                                         "--tensor-parallel-size", "2"), capture_output=True, text=True, check=True)
        return json.loads(run.stdout)["group"]
    assert group(B70_ID) == from_script["group"] == [1, 2]
    three = subprocess.run(host_module("topology", "--root", root, "--probe", "never", "--pci-id",
                                       "--tensor-parallel-size", "3"), capture_output=True, text=True, check=True)
    assert json.loads(three.stdout)["group"] == [0, 1, 2]
    bad = subprocess.run(host_module("topology", "--root", root, "--pci-id", "e223"), capture_output=True,
                         text=True, cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr == "error: --pci-id e223 is not vendor:device in hex (e.g. 8086:e223)\n"


def test_the_role_passes_the_recipes_ids() -> None:
    tasks = (REPO / "roles" / "gpu_topology" / "tasks" / "main.yml").read_text()
    defaults = (REPO / "roles" / "gpu_topology" / "defaults" / "main.yml").read_text()
    assert "+ ['--pci-id'] + gpu_topology_pci_ids" in tasks
    assert "b70_recipe_spec.host.gpu_pci_ids" in defaults


def test_a_tp2_recipe_on_one_b70_is_refused_even_beside_a_b60(tmp_path: Path) -> None:
    """The B60 does not make up the count: nothing written, one line naming the PCI id."""
    root = build_tree(tmp_path, "b70x2-b60")
    with pytest.raises(TopologyRefused, match=r"tensor-parallel size 3 but 2 usable GPU\(s\) .*PCI id 8086:e223"):
        topology(root, 3, probe="never", write=True, pci_ids=[B70_ID])
    assert not (Path(root) / TOPOLOGY_PATH.lstrip("/")).exists()


# ---- p2p only when proven ---------------------------------------------------------------------------------------
# SergiioB/intel-arc-pro-b70-inference-cookbook#8, "TP2 on 2xB70 fails at zeMemOpenIpcHandle (INVALID_ARGUMENT)":
# closed with the four no-p2p variables, "Intel's own documented workaround for exactly this failure"; intel/
# llm-scaler#594 (Intel's reply there): "please try this as a workaround as your host platform does not support P2P".
# Those were X570 (AMD) dual-B70 hosts, which P2PDMA's AMD Zen rule allows, while an
# X870 host measured 28.5 GB/s with ze_peer (intel/llm-scaler#618): the kernel's rule predicts neither.

def test_an_amd_host_the_kernel_allows_gets_no_p2p_with_the_reason(tmp_path: Path) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-amd-zen")))
    (pair,) = document["pairs"]
    assert (pair["rule"], pair["p2p"]) == ("amd-zen", True)
    assert document["profile"] == "no-p2p"
    assert document["ccl_env"] == CCL_PROFILES["no-p2p"]["env"]
    assert document["profile_reason"].startswith("no-p2p: no probe opened peer memory between the GPUs")
    assert "zeMemOpenIpcHandle" in document["profile_reason"]


def test_every_kernel_rule_alone_gives_no_p2p(tmp_path: Path) -> None:
    for scenario in ("b70x2-switch", "b70x2-amd-zen", "b70x2-xeon-whitelisted", "b70x2-b60"):
        document = analyse(collect_facts(build_tree(tmp_path, scenario)), tensor_parallel_size=2,
                           pci_ids=[B70_ID])
        assert all(pair["p2p"] for pair in document["pairs"] if pair["a"] in document["group"]
                   and pair["b"] in document["group"]), scenario
        assert document["profile"] == "no-p2p", scenario


def _pairs_with(tmp_path: Path, probe: Probe) -> tuple[list, list[PairTopology]]:
    facts = collect_facts(build_tree(tmp_path, "b70x2-amd-zen"))
    pairs = all_pairs(facts["gpus"], facts["cpu"], facts["host_bridge_devices"])
    pairs[0].probe = probe
    pairs[0].p2p = True if probe.status == "confirmed" else pairs[0].p2p
    return facts["gpus"], pairs


def test_only_a_probe_that_opened_peer_memory_proves_p2p(tmp_path: Path) -> None:
    gpus, pairs = _pairs_with(tmp_path, Probe("confirmed", detail="zeDeviceCanAccessPeer=True"))
    assert decide(gpus, pairs, 2).profile == "no-p2p"
    gpus, pairs = _pairs_with(tmp_path, Probe("confirmed", detail="opened", peer_memory_opened=True))
    decision = decide(gpus, pairs, 2)
    assert (decision.profile, decision.group) == ("p2p", [0, 1])
    assert decision.profile_reason == "p2p: peer memory opened between every pair of GPUs 0,1"


def test_the_override_still_forces_p2p_and_says_so(tmp_path: Path) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")), profile="p2p")
    assert document["profile"] == "p2p"
    assert document["profile_reason"].startswith("p2p: set by override (auto chose no-p2p: no probe opened")


# ---- device nodes by path ---------------------------------------------------------------------------------------
# B70 owners' reports: "DRM minor numbers follow probe order (simpledrm can take card0; B70s seen as
# card2/card3, renderD129/130): llm-scaler maps GPUs through /dev/dri/by-path".

def test_group_devices_are_by_path_and_lead_to_the_b70s_own_nodes(tmp_path: Path) -> None:
    root = build_tree(tmp_path, "b70x2-b580")
    facts = collect_facts(root)
    # simpledrm holds card0, so the B70s are card2/card3 here: a cardN name says nothing about which card it is.
    assert [(gpu["card"], gpu["render"]) for gpu in facts["gpus"][1:]] == [("card2", "renderD130"),
                                                                        ("card3", "renderD131")]
    document = cli_topology("--root", root, "--recipe", "pr620-fp8-tp2")
    assert document["group_devices"] == [f"/dev/dri/by-path/pci-{address}-{kind}" for address in B70_ADDRESSES
                                         for kind in ("card", "render")]
    for node in document["group_devices"]:
        link = Path(root) / node.lstrip("/")
        target = Path(os.path.normpath(link.parent / os.readlink(link)))
        address = link.name[len("pci-"):].rsplit("-", 1)[0]
        # The node the link names is the DRM node sysfs lists under that PCI function.
        drm = Path(root) / "sys/bus/pci/devices" / address / "drm"
        assert target.name in os.listdir(drm), (node, target)


def test_no_group_device_is_a_minor_numbered_name(tmp_path: Path) -> None:
    for scenario in ("b70x2-switch", "b70-igpu", "b70x4-two-switches", "b70x2-b60"):
        document = analyse(collect_facts(build_tree(tmp_path, scenario)), probe="never")
        assert document["group_devices"], scenario
        assert all(node.startswith("/dev/dri/by-path/pci-") for node in document["group_devices"]), scenario


# ---- --write stays under --root ---------------------------------------------------------------------------------

def test_write_refuses_a_symlinked_etc_b70_leading_out_of_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Through the console script's entry point, which maps every B70Error to one line and its exit code (2)."""
    root = Path(build_tree(tmp_path, "b70x2-switch"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "b70").symlink_to(outside)
    monkeypatch.setattr(sys, "argv", ["b70ctl", "host", "topology", "--root", str(root), "--write", "--probe",
                                      "never"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "outside --root" in lines[0] and "nothing was written" in lines[0], lines
    assert list(outside.iterdir()) == []
    script = subprocess.run(host_module("topology", "--root", str(root), "--write", "--probe", "never"),
                            capture_output=True, text=True, cwd=tmp_path)
    assert script.returncode == 2 and script.stderr.count("\n") == 1 and "outside --root" in script.stderr
    assert list(outside.iterdir()) == []


def test_write_refuses_a_symlinked_etc_too(tmp_path: Path) -> None:
    root = Path(build_tree(tmp_path, "b70x2-switch"))
    outside = tmp_path / "elsewhere"
    (outside / "b70").mkdir(parents=True)
    (root / "etc").symlink_to(outside)
    with pytest.raises(TopologyRefused, match="outside --root"):
        topology(str(root), probe="never", write=True)
    assert list((outside / "b70").iterdir()) == []


def test_a_link_that_stays_inside_root_is_fine(tmp_path: Path) -> None:
    root = Path(build_tree(tmp_path, "b70x2-switch"))
    (root / "srv" / "b70").mkdir(parents=True)
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "b70").symlink_to(Path("..") / "srv" / "b70")
    assert topology(str(root), probe="never", write=True)["changed"] is True
    assert (root / "srv" / "b70" / "topology.json").is_file()
