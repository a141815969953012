"""P2P per GPU pair from the PCIe tree, the ze_peer probe (a fake ze_peer executable on PATH stands in for the
hardware), the oneCCL profile per scenario, the override and the idempotent topology.json."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app, main
from b70ctl.errors import BadInput
from b70ctl.host.facts import collect_facts
from b70ctl.host.model import load_topology
from b70ctl.host.topology import CCL_PROFILES, TOPOLOGY_PATH, analyse, parse_ze_peer_output, topology
from sysfs_trees import REPO, build_tree

TOPOLOGY_SCRIPT = REPO / "control" / "b70ctl" / "host" / "topology.py"

# scenario -> (profile, group, [(a, b, relation, acs, p2p)])
EXPECTED = {
    "b70x2-switch": ("p2p", [0, 1], [(0, 1, "same_switch", "off", True)]),
    "b70x2-switch-user": ("no-p2p", [0, 1], [(0, 1, "same_switch", "unknown", None)]),
    "b70x2-root-ports": ("no-p2p", [0, 1], [(0, 1, "separate_root_ports", "not_applicable", False)]),
    "b70-igpu": ("no-p2p", [0], []),
    "b70x4-two-switches": ("no-p2p", [0, 1, 2, 3], [
        (0, 1, "same_switch", "off", True),
        (0, 2, "separate_host_bridges", "not_applicable", False),
        (0, 3, "separate_host_bridges", "not_applicable", False),
        (1, 2, "separate_host_bridges", "not_applicable", False),
        (1, 3, "separate_host_bridges", "not_applicable", False),
        (2, 3, "same_switch", "redirect", False),
    ]),
    "b60x2-switch": ("p2p", [0, 1], [(0, 1, "same_switch", "off", True)]),
    "xe-unbound": ("no-p2p", [], [(0, 1, "same_switch", "off", True)]),
    "no-intel-gpu": ("no-p2p", [], []),
}


@pytest.fixture
def no_ze_peer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A PATH without ze_peer, whatever the machine has installed."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def fake_ze_peer(directory: Path, output: str, exit_code: int = 0) -> Path:
    """An executable ze_peer that records its arguments and prints `output`."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "ze_peer"
    script.write_text(
        "#!%s\nimport sys\nopen(%r, 'a').write(' '.join(sys.argv[1:]) + '\\n')\nsys.stdout.write(%r)\nsys.exit(%d)\n"
        % (sys.executable, str(directory / "calls"), output, exit_code))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


ZE_PEER_TABLE = """================================================================================
Single Process Unidirectional tests
================================================================================
--------------------------------------------------------------------------------
Bandwidth Write : Device(0)--->Device(1)
 Size   | BW [GBPS] 
  8388608 |    21.34
 268435456 |    24.87

--------------------------------------------------------------------------------
"""
ZE_PEER_REFUSED = """Bandwidth Write : Device(0)--->Device(1)
 Size   | BW [GBPS] 
ERROR: zeMemOpenIpcHandle failed: ZE_RESULT_ERROR_INVALID_ARGUMENT
terminate called without an active exception
"""


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_profile_and_pairs_per_scenario(tmp_path: Path, scenario: str, no_ze_peer: None) -> None:
    profile, group, pairs = EXPECTED[scenario]
    document = analyse(collect_facts(build_tree(tmp_path, scenario)))
    assert document["profile"] == profile
    assert document["group"] == group
    assert [(p["a"], p["b"], p["relation"], p["acs"], p["p2p"]) for p in document["pairs"]] == pairs
    assert document["ccl_env"] == CCL_PROFILES[profile]["env"]
    assert document["docker_args"] == CCL_PROFILES[profile]["docker_args"]
    assert document["probe"]["status"] == "not_installed"


def test_switch_pair_explains_itself(tmp_path: Path, no_ze_peer: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")))
    (pair,) = document["pairs"]
    assert pair["common_bridge"] == "0000:01:00.0"
    assert pair["reason"] == "share the switch below 0000:01:00.0 with ACS redirect off"
    assert document["affinity_mask"] == "0,1"
    assert document["group_devices"] == ["/dev/dri/card0", "/dev/dri/renderD128", "/dev/dri/card1",
                                         "/dev/dri/renderD129"]


def test_separate_root_ports_name_the_kernel_refusal(tmp_path: Path, no_ze_peer: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-root-ports")))
    assert "separate root ports (0000:00:01.0, 0000:00:01.1)" in document["pairs"][0]["reason"]
    assert "P2PDMA refuses" in document["reasons"][0]


def test_acs_redirect_names_the_ports(tmp_path: Path, no_ze_peer: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x4-two-switches")))
    redirect = document["pairs"][-1]
    assert redirect["acs_redirect_bridges"] == ["0000:cc:00.0", "0000:cc:01.0"]


@pytest.mark.parametrize("tensor_parallel_size, profile, group", [(2, "p2p", [0, 1]), (3, "no-p2p", [0, 1, 2]),
                                                                   (4, "no-p2p", [0, 1, 2, 3])])
def test_four_cards_pick_a_p2p_pair_for_tp2(tmp_path: Path, no_ze_peer: None, tensor_parallel_size: int,
                                           profile: str, group: list[int]) -> None:
    facts = collect_facts(build_tree(tmp_path, "b70x4-two-switches"))
    document = analyse(facts, tensor_parallel_size=tensor_parallel_size)
    assert (document["profile"], document["group"]) == (profile, group)


def test_tp2_on_a_single_card_host_is_no_p2p_with_reason(tmp_path: Path, no_ze_peer: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70-igpu")), tensor_parallel_size=2)
    assert document["profile"] == "no-p2p"
    assert document["reasons"] == ["tensor-parallel size 2 but 1 usable GPU(s)"]


def test_unbound_cards_are_not_usable(tmp_path: Path, no_ze_peer: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "xe-unbound")))
    assert document["reasons"][0] == "not bound to xe, not usable: 0000:05:00.0, 0000:09:00.0"


def test_override_forces_the_profile_and_keeps_the_auto_choice(tmp_path: Path, no_ze_peer: None) -> None:
    facts = collect_facts(build_tree(tmp_path, "b70x2-root-ports"))
    document = analyse(facts, profile="p2p")
    assert (document["profile"], document["auto_profile"], document["profile_source"]) == ("p2p", "no-p2p",
                                                                                         "override")
    assert document["ccl_env"]["CCL_TOPO_P2P_ACCESS"] == "1"
    assert document["reasons"][-1] == "profile p2p set by override (auto chose no-p2p)"
    with pytest.raises(ValueError, match="choose one of auto, p2p, no-p2p"):
        analyse(facts, profile="fast")


def test_profiles_carry_the_documented_oncl_sets() -> None:
    no_p2p = CCL_PROFILES["no-p2p"]
    assert no_p2p["env"] == {
        "CCL_TOPO_P2P_ACCESS": "0",
        "CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD": "4294967296",
        "CCL_SYCL_REDUCE_SCATTER_SIMPLE_THRESHOLD": "4294967296",
        "CCL_SYCL_ALLGATHERV_SIMPLE_THRESHOLD": "4294967296",
        "CCL_SYCL_ALLTOALL_TMP_BUF": "1",
    }
    assert no_p2p["docker_args"] == ["--cap-add", "SYS_PTRACE", "--ipc=host"]
    p2p = CCL_PROFILES["p2p"]["env"]
    assert p2p["CCL_TOPO_P2P_ACCESS"] == "1" and p2p["CCL_ZE_IPC_EXCHANGE"] == "drmfd"
    assert p2p["CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD"] == "131072"


def test_ze_peer_confirms_a_pair_whose_acs_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = fake_ze_peer(tmp_path / "bin", ZE_PEER_TABLE)
    monkeypatch.setenv("PATH", str(tool.parent))
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch-user")))
    assert (tool.parent / "calls").read_text() == "-s 0 -d 1\n"
    (pair,) = document["pairs"]
    assert (pair["p2p_from_topology"], pair["p2p"]) == (None, True)
    assert pair["probe"]["status"] == "confirmed" and pair["probe"]["peak_gb_per_s"] == 24.87
    assert document["profile"] == "p2p"
    assert document["probe"] == {"tool": str(tool), "status": "probed"}


def test_ze_peer_refusal_beats_the_topology(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = fake_ze_peer(tmp_path / "bin", ZE_PEER_REFUSED, exit_code=134)
    monkeypatch.setenv("PATH", str(tool.parent))
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")))
    (pair,) = document["pairs"]
    assert (pair["p2p_from_topology"], pair["p2p"]) == (True, False)
    assert pair["probe"]["status"] == "refused"
    assert pair["probe"]["detail"] == "ERROR: zeMemOpenIpcHandle failed: ZE_RESULT_ERROR_INVALID_ARGUMENT"
    assert document["profile"] == "no-p2p"


def test_ze_peer_probes_the_candidate_group_by_level_zero_index(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tool = fake_ze_peer(tmp_path / "bin", ZE_PEER_TABLE)
    monkeypatch.setenv("PATH", str(tool.parent))
    document = analyse(collect_facts(build_tree(tmp_path, "b70x4-two-switches")), tensor_parallel_size=2)
    assert (tool.parent / "calls").read_text() == "-s 0 -d 1\n"
    assert document["profile"] == "p2p"


def test_probe_never_skips_an_installed_ze_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = fake_ze_peer(tmp_path / "bin", ZE_PEER_REFUSED, exit_code=1)
    monkeypatch.setenv("PATH", str(tool.parent))
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")), probe="never")
    assert not (tool.parent / "calls").exists()
    assert document["probe"]["status"] == "skipped" and document["profile"] == "p2p"


@pytest.mark.parametrize("output, exit_code, expected", [
    (ZE_PEER_TABLE, 0, ("confirmed", 24.87)),
    (" Device(0)->Device(1):  GBPS 21.5\n", 0, ("confirmed", 21.5)),
    ("BW [GBPS]:  256 MB:    23.10\nBW [GBPS]:    8 MB:    19.02\n", 0, ("confirmed", 23.10)),
    (ZE_PEER_REFUSED, 134, ("refused", None)),
    ("ERROR: there are no peer devices among 2 devices found\n", 0, ("refused", None)),
    ("Single Process Unidirectional tests\n", 0, ("inconclusive", None)),
])
def test_ze_peer_output_formats(output: str, exit_code: int, expected: tuple) -> None:
    status, peak, _ = parse_ze_peer_output(output, exit_code)
    assert (status, peak) == expected


def test_write_is_atomic_and_idempotent(tmp_path: Path, no_ze_peer: None) -> None:
    root = build_tree(tmp_path, "b70x2-switch")
    first = topology(root, write=True)
    target = Path(root) / TOPOLOGY_PATH.lstrip("/")
    assert first["changed"] is True and first["path"] == TOPOLOGY_PATH
    written = json.loads(target.read_text())
    assert written["profile"] == "p2p" and "changed" not in written
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert topology(root, write=True)["changed"] is False
    assert [name for name in os.listdir(target.parent)] == ["topology.json"]  # no temp file left behind
    changed = topology(root, profile="no-p2p", write=True)
    assert changed["changed"] is True
    assert json.loads(target.read_text())["ccl_env"]["CCL_TOPO_P2P_ACCESS"] == "0"
    assert topology(root)["changed"] is False  # without --write nothing is touched


def test_cli_json_and_the_standalone_script_agree(tmp_path: Path) -> None:
    root = build_tree(tmp_path, "b70x2-root-ports")
    cli = CliRunner().invoke(app, ["host", "topology", "--root", root, "--write", "--json", "--profile", "no-p2p",
                                   "--probe", "never"])
    assert cli.exit_code == 0, cli.output
    from_cli = json.loads(cli.stdout)
    assert from_cli["changed"] is True and from_cli["profile_source"] == "override"
    # The host's python3 runs the file next to facts.py, outside the b70ctl package.
    script = subprocess.run(["/usr/bin/env", "python3", str(TOPOLOGY_SCRIPT), "--root", root, "--write",
                             "--profile", "no-p2p", "--probe", "never"],
                            capture_output=True, text=True, check=True, cwd=tmp_path)
    from_script = json.loads(script.stdout)
    assert from_script["changed"] is False
    from_cli.pop("changed")
    from_script.pop("changed")
    assert from_script == from_cli


def test_cli_rejects_a_bad_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Through the console script's entry point, which maps BadInput to one line and exit 2."""
    root = build_tree(tmp_path, "b70x2-switch")
    monkeypatch.setattr(sys, "argv", ["b70ctl", "host", "topology", "--root", root, "--profile", "fast"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert "--profile 'fast': choose one of auto, p2p, no-p2p" in capsys.readouterr().err
    assert not (Path(root) / TOPOLOGY_PATH.lstrip("/")).exists()


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_written_document_loads_as_the_typed_model(tmp_path: Path, scenario: str, no_ze_peer: None) -> None:
    root = build_tree(tmp_path, scenario)
    topology(root, tensor_parallel_size=2 if scenario == "b70x4-two-switches" else None, write=True)
    document = load_topology(Path(root) / TOPOLOGY_PATH.lstrip("/"))
    # With TP=2 the four-card server places its group on the P2P pair 0,1.
    assert document.profile == ("p2p" if scenario == "b70x4-two-switches" else EXPECTED[scenario][0])
    env = document.serve_env()
    assert env["CCL_TOPO_P2P_ACCESS"] == ("1" if document.profile == "p2p" else "0")
    if document.group:
        assert env["ZE_AFFINITY_MASK"] == document.affinity_mask
    else:
        assert "ZE_AFFINITY_MASK" not in env


def test_probed_document_loads_as_the_typed_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = fake_ze_peer(tmp_path / "bin", ZE_PEER_TABLE)
    monkeypatch.setenv("PATH", str(tool.parent))
    root = build_tree(tmp_path, "b70x2-switch-user")
    topology(root, write=True)
    document = load_topology(Path(root) / TOPOLOGY_PATH.lstrip("/"))
    assert document.pairs[0].probe is not None and document.pairs[0].probe.status == "confirmed"
    assert document.profile == "p2p"


def test_a_tampered_topology_file_is_refused(tmp_path: Path, no_ze_peer: None) -> None:
    root = build_tree(tmp_path, "b70x2-switch")
    topology(root, write=True)
    target = Path(root) / TOPOLOGY_PATH.lstrip("/")
    data = json.loads(target.read_text())
    data["profile"] = "fast"
    target.write_text(json.dumps(data))
    with pytest.raises(BadInput, match=r"profile: Input should be 'p2p' or 'no-p2p'"):
        load_topology(target)
    data["profile"] = "no-p2p"  # env of the p2p profile under the no-p2p name
    target.write_text(json.dumps(data))
    with pytest.raises(BadInput, match="ccl_env differs from profile no-p2p's set"):
        load_topology(target)
    with pytest.raises(BadInput, match="No such file or directory: run `b70ctl host topology --write`"):
        load_topology(tmp_path / "absent.json")
