"""P2P per GPU pair by the kernel's P2PDMA rule (expected outcomes from drivers/pci/p2pdma.c, see
tests/fixtures/README.md), the Level Zero probe (a stub loader built here with gcc stands in for the runtime), the
oneCCL profile per scenario, the override and the idempotent topology.json."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app, main
from b70ctl.errors import BadInput
from b70ctl.host_documents import load_topology
from b70host.facts import collect_facts
from b70host.topology import CCL_PROFILES, P2PDMA_HOST_BRIDGE_WHITELIST, TOPOLOGY_PATH, analyse, topology
from host_package import host_module
from sysfs_trees import REPO, build_tree

# scenario -> (profile, group, [(a, b, relation, acs, p2p, rule)]); each pair's outcome is P2PDMA's
# (tests/fixtures/README.md). The profile is no-p2p on every tree: the kernel's yes is not proof, no probe opened peer
# memory. https://github.com/SergiioB/intel-arc-pro-b70-inference-cookbook/issues/8, "TP2 on 2xB70 fails at
# zeMemOpenIpcHandle (INVALID_ARGUMENT)", was closed with the four no-p2p variables from
# https://github.com/intel/llm-scaler/issues/594, where Intel answered "please try this as a workaround as your host
# platform does not support P2P".
EXPECTED = {
    "b70x2-switch": ("no-p2p", [0, 1], [(0, 1, "same_switch", "off", True, "same-switch")]),
    "b70x2-switch-user": ("no-p2p", [0, 1], [(0, 1, "same_switch", "unknown", None,
                                              "unknown: ACS not readable at 0000:02:00.0, 0000:03:00.0, 0000:04:01.0, "
                                              "0000:01:00.0, 0000:02:01.0, 0000:07:00.0, 0000:08:01.0")]),
    "b70x2-root-ports": ("no-p2p", [0, 1], [(0, 1, "separate_root_ports", "not_applicable", False,
                                             "refused: no shared upstream bridge, CPU not AMD Zen, host bridge "
                                             "8086:a703 not whitelisted")]),
    "b70x2-amd-zen": ("no-p2p", [0, 1], [(0, 1, "separate_root_ports", "not_applicable", True, "amd-zen")]),
    "b70x2-xeon-whitelisted": ("no-p2p", [0, 1], [(0, 1, "separate_root_ports", "not_applicable", True,
                                                 "whitelisted-host-bridge:8086:09a2")]),
    "b70-igpu": ("no-p2p", [0], []),
    "b70x4-two-switches": ("no-p2p", [0, 1, 2, 3], [
        (0, 1, "same_switch", "off", True, "same-switch"),
        (0, 2, "separate_host_bridges", "not_applicable", False,
         "refused: no shared upstream bridge, CPU not AMD Zen, host bridge 8086:347a, 8086:347a not whitelisted"),
        (0, 3, "separate_host_bridges", "not_applicable", False,
         "refused: no shared upstream bridge, CPU not AMD Zen, host bridge 8086:347a, 8086:347a not whitelisted"),
        (1, 2, "separate_host_bridges", "not_applicable", False,
         "refused: no shared upstream bridge, CPU not AMD Zen, host bridge 8086:347a, 8086:347a not whitelisted"),
        (1, 3, "separate_host_bridges", "not_applicable", False,
         "refused: no shared upstream bridge, CPU not AMD Zen, host bridge 8086:347a, 8086:347a not whitelisted"),
        (2, 3, "same_switch", "redirect", False,
         "refused: ACS redirect at 0000:cc:00.0, 0000:cc:01.0 and the host bridge route is not allowed"),
    ]),
    "b60x2-switch": ("no-p2p", [0, 1], [(0, 1, "same_switch", "off", True, "same-switch")]),
    "xe-unbound": ("no-p2p", [], [(0, 1, "same_switch", "off", True, "same-switch")]),
    "no-intel-gpu": ("no-p2p", [], []),
}

STUB_SOURCE = REPO / "tests" / "unit" / "ze_loader_stub.c"


@pytest.fixture
def no_ze_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No Level Zero loader, whatever the machine has installed."""
    monkeypatch.setenv("B70CTL_ZE_LOADER", str(tmp_path / "absent" / "libze_loader.so.1"))


@pytest.fixture(scope="session")
def stub_loader(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stub loader (tests/unit/ze_loader_stub.c) compiled into a shared library."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stub Level Zero loader")
    library = tmp_path_factory.mktemp("ze") / "libze_loader.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(STUB_SOURCE)], check=True)
    return library


def use_stub(monkeypatch: pytest.MonkeyPatch, library: Path, devices: str, access: bool, init_result: int = 0,
             ipc_open: bool = False) -> None:
    monkeypatch.setenv("B70CTL_ZE_LOADER", str(library))
    monkeypatch.setenv("ZE_STUB_DEVICES", devices)
    monkeypatch.setenv("ZE_STUB_PEER_ACCESS", "1" if access else "0")
    monkeypatch.setenv("ZE_STUB_IPC_OPEN", "1" if ipc_open else "0")
    monkeypatch.setenv("ZE_STUB_INIT_RESULT", str(init_result))


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_profile_and_pairs_per_scenario(tmp_path: Path, scenario: str, no_ze_loader: None) -> None:
    profile, group, pairs = EXPECTED[scenario]
    document = analyse(collect_facts(build_tree(tmp_path, scenario)))
    assert document["profile"] == profile
    assert document["group"] == group
    assert [(p["a"], p["b"], p["relation"], p["acs"], p["p2p"], p["rule"]) for p in document["pairs"]] == pairs
    assert document["ccl_env"] == CCL_PROFILES[profile]["env"]
    assert document["docker_args"] == CCL_PROFILES[profile]["docker_args"]
    assert document["probe"]["status"] in ("not_installed", "nothing_to_probe")


def test_switch_pair_explains_itself(tmp_path: Path, no_ze_loader: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")))
    (pair,) = document["pairs"]
    assert pair["common_bridge"] == "0000:01:00.0"
    assert pair["reason"] == "share the switch below 0000:01:00.0 with ACS redirect off"
    assert document["affinity_mask"] == "0,1"
    assert document["group_devices"] == ["/dev/dri/by-path/pci-0000:05:00.0-card",
                                         "/dev/dri/by-path/pci-0000:05:00.0-render",
                                         "/dev/dri/by-path/pci-0000:09:00.0-card",
                                         "/dev/dri/by-path/pci-0000:09:00.0-render"]


def test_separate_root_ports_name_the_kernel_refusal(tmp_path: Path, no_ze_loader: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-root-ports")))
    assert "separate root ports (0000:00:01.0, 0000:00:01.1)" in document["pairs"][0]["reason"]
    assert "P2PDMA refuses" in document["reasons"][0]


def test_acs_redirect_names_the_ports(tmp_path: Path, no_ze_loader: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x4-two-switches")))
    redirect = document["pairs"][-1]
    assert redirect["acs_redirect_bridges"] == ["0000:cc:00.0", "0000:cc:01.0"]


@pytest.mark.parametrize("tensor_parallel_size, profile, group", [(2, "no-p2p", [0, 1]), (3, "no-p2p", [0, 1, 2]),
                                                                   (4, "no-p2p", [0, 1, 2, 3])])
def test_four_cards_place_tp2_on_the_pair_the_kernel_allows(tmp_path: Path, no_ze_loader: None,
                                                            tensor_parallel_size: int, profile: str,
                                                            group: list[int]) -> None:
    facts = collect_facts(build_tree(tmp_path, "b70x4-two-switches"))
    document = analyse(facts, tensor_parallel_size=tensor_parallel_size)
    assert (document["profile"], document["group"]) == (profile, group)


def test_tp2_on_a_single_card_host_is_no_p2p_with_reason(tmp_path: Path, no_ze_loader: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70-igpu")), tensor_parallel_size=2)
    assert document["profile"] == "no-p2p"
    assert document["reasons"] == ["tensor-parallel size 2 but 1 usable GPU(s)"]


def test_unbound_cards_are_not_usable(tmp_path: Path, no_ze_loader: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "xe-unbound")))
    assert document["reasons"][0] == "not bound to xe, not usable: 0000:05:00.0, 0000:09:00.0"


def test_override_forces_the_profile_and_keeps_the_auto_choice(tmp_path: Path, no_ze_loader: None) -> None:
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


def test_level_zero_confirms_a_pair_whose_acs_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       stub_loader: Path) -> None:
    use_stub(monkeypatch, stub_loader, "0000:05:00.0,0000:09:00.0", access=True, ipc_open=True)
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch-user")))
    (pair,) = document["pairs"]
    assert (pair["p2p_from_topology"], pair["p2p"]) == (None, True)
    assert pair["probe"]["status"] == "confirmed" and pair["probe"]["peer_memory_opened"] is True
    assert "0000:05:00.0->0000:09:00.0 zeDeviceCanAccessPeer=True p2p flags access=True atomics=True" in \
        pair["probe"]["detail"]
    assert document["profile"] == "p2p"
    assert document["profile_reason"] == "p2p: peer memory opened between every pair of GPUs 0,1"


def test_peer_access_without_opening_peer_memory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           stub_loader: Path) -> None:
    """zeDeviceCanAccessPeer is what oneCCL asks, and X570 dual-B70 hosts then died at "zeMemOpenIpcHandle
    ZE_RESULT_ERROR_INVALID_ARGUMENT" (SergiioB/intel-arc-pro-b70-inference-cookbook#8, docs/facts.md "Field
    reports"): the stub allows access and fails the open the same way."""
    use_stub(monkeypatch, stub_loader, "0000:05:00.0,0000:09:00.0", access=True, ipc_open=False)
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")))
    (pair,) = document["pairs"]
    assert (pair["p2p_from_topology"], pair["p2p"]) == (True, False)
    assert pair["probe"]["status"] == "refused" and pair["probe"]["peer_memory_opened"] is False
    assert "zeDeviceCanAccessPeer=True" in pair["probe"]["detail"]
    assert "zeMemOpenIpcHandle returned ZE_RESULT_ERROR_INVALID_ARGUMENT" in pair["probe"]["detail"]
    assert document["profile"] == "no-p2p"
    assert document["probe"] == {"tool": str(stub_loader), "status": "probed", "detail": None}


def test_level_zero_refusal_beats_the_kernel_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 stub_loader: Path) -> None:
    use_stub(monkeypatch, stub_loader, "0000:05:00.0,0000:09:00.0", access=False)
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")))
    (pair,) = document["pairs"]
    assert (pair["p2p_from_topology"], pair["p2p"], pair["rule"]) == (True, False, "same-switch")
    assert pair["probe"]["status"] == "refused"
    assert "zeDeviceCanAccessPeer=False p2p flags access=False" in pair["probe"]["detail"]
    assert document["profile"] == "no-p2p"


def test_level_zero_joins_devices_by_pci_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 stub_loader: Path) -> None:
    """The loader lists the cards in its own order; the answer lands on the pair with those PCI addresses."""
    root = build_tree(tmp_path, "b70x4-two-switches")
    facts = collect_facts(root)
    addresses = [gpu["pci_address"] for gpu in facts["gpus"]]
    use_stub(monkeypatch, stub_loader, ",".join(reversed(addresses)), access=True, ipc_open=True)
    document = analyse(facts, tensor_parallel_size=2)
    probed = [pair for pair in document["pairs"] if pair["probe"]]
    assert [(pair["a_address"], pair["b_address"]) for pair in probed] == [(addresses[0], addresses[1])]
    assert probed[0]["probe"]["status"] == "confirmed" and document["profile"] == "p2p"


def test_a_missing_loader_falls_back_to_the_kernel_rule(tmp_path: Path, no_ze_loader: None) -> None:
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")))
    assert document["probe"]["status"] == "not_installed"
    assert document["probe"]["detail"].startswith("Level Zero loader ")
    assert document["probe"]["detail"].endswith("install the compute runtime's libze1: the kernel's P2PDMA rule "
                                                "decides")
    assert document["profile"] == "no-p2p" and document["pairs"][0]["probe"] is None
    assert document["pairs"][0]["p2p"] is True  # the kernel's rule still allows it: recorded, not trusted


def test_a_failing_zeinit_falls_back_to_the_kernel_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       stub_loader: Path) -> None:
    use_stub(monkeypatch, stub_loader, "0000:05:00.0,0000:09:00.0", access=True, init_result=0x78000001)
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-root-ports")))
    assert document["probe"]["status"] == "init_failed"
    assert "zeInit(ZE_INIT_FLAG_GPU_ONLY) returned ZE_RESULT_ERROR_UNINITIALIZED" in document["probe"]["detail"]
    assert document["profile"] == "no-p2p" and document["pairs"][0]["p2p"] is False


def test_probe_never_skips_an_installed_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               stub_loader: Path) -> None:
    use_stub(monkeypatch, stub_loader, "0000:05:00.0,0000:09:00.0", access=False)
    document = analyse(collect_facts(build_tree(tmp_path, "b70x2-switch")), probe="never")
    assert document["probe"]["status"] == "skipped" and document["pairs"][0]["probe"] is None
    assert document["pairs"][0]["p2p"] is True  # the refusing stub was not asked


def test_the_whitelist_is_the_kernels() -> None:
    """pci_p2pdma_whitelist[] as read (tests/fixtures/README.md): consumer Raptor Lake 8086:a703 is not in it."""
    intel = {(device, same) for vendor, device, same, _ in P2PDMA_HOST_BRIDGE_WHITELIST if vendor == 0x8086}
    assert {(0x3C00, True), (0x3C01, True), (0x2F00, True), (0x2F01, True), (0x09A2, False)} <= intel
    assert all(device != 0xA703 for _, device in intel)


def test_whitelisted_pairs_across_host_bridges_need_the_flag_off() -> None:
    from b70host.topology import host_bridge_whitelisted

    devices = {"pci0000:00": {"pci_id": "8086:3c00"}, "pci0000:80": {"pci_id": "8086:3c00"},
               "pci0000:16": {"pci_id": "8086:09a2"}, "pci0000:ca": {"pci_id": "8086:09a2"}}
    assert host_bridge_whitelisted("pci0000:00", "pci0000:00", devices)[0] is True
    assert host_bridge_whitelisted("pci0000:00", "pci0000:80", devices)[0] is False  # REQ_SAME_HOST_BRIDGE
    assert host_bridge_whitelisted("pci0000:16", "pci0000:ca", devices)[0] is True


def test_write_is_atomic_and_idempotent(tmp_path: Path, no_ze_loader: None) -> None:
    root = build_tree(tmp_path, "b70x2-switch")
    first = topology(root, write=True)
    target = Path(root) / TOPOLOGY_PATH.lstrip("/")
    assert first["changed"] is True and first["path"] == TOPOLOGY_PATH
    written = json.loads(target.read_text())
    assert written["profile"] == "no-p2p" and "changed" not in written
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert topology(root, write=True)["changed"] is False
    assert [name for name in os.listdir(target.parent)] == ["topology.json"]  # no temp file left behind
    changed = topology(root, profile="p2p", write=True)
    assert changed["changed"] is True
    assert json.loads(target.read_text())["ccl_env"]["CCL_TOPO_P2P_ACCESS"] == "1"
    assert topology(root)["changed"] is False  # without --write nothing is touched


def test_cli_json_and_the_standalone_script_agree(tmp_path: Path) -> None:
    root = build_tree(tmp_path, "b70x2-root-ports")
    cli = CliRunner().invoke(app, ["host", "topology", "--root", root, "--write", "--json", "--profile", "no-p2p",
                                   "--probe", "never"])
    assert cli.exit_code == 0, cli.output
    from_cli = json.loads(cli.stdout)
    assert from_cli["changed"] is True and from_cli["profile_source"] == "override"
    # The host's python3 runs the host package's module, outside the b70ctl package.
    script = subprocess.run(host_module("topology", "--root", root, "--write", "--profile", "no-p2p", "--probe",
                                        "never"),
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
def test_written_document_loads_as_the_typed_model(tmp_path: Path, scenario: str, no_ze_loader: None) -> None:
    root = build_tree(tmp_path, scenario)
    topology(root, tensor_parallel_size=2 if scenario == "b70x4-two-switches" else None, write=True)
    document = load_topology(Path(root) / TOPOLOGY_PATH.lstrip("/"))
    assert document.profile == EXPECTED[scenario][0]
    assert document.profile_reason is not None and document.profile_reason.startswith(document.profile + ": ")
    env = document.serve_env()
    assert env["CCL_TOPO_P2P_ACCESS"] == ("1" if document.profile == "p2p" else "0")
    if document.group:
        assert env["ZE_AFFINITY_MASK"] == document.affinity_mask
    else:
        assert "ZE_AFFINITY_MASK" not in env


def test_probed_document_loads_as_the_typed_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 stub_loader: Path) -> None:
    use_stub(monkeypatch, stub_loader, "0000:05:00.0,0000:09:00.0", access=True, ipc_open=True)
    root = build_tree(tmp_path, "b70x2-switch-user")
    topology(root, write=True)
    document = load_topology(Path(root) / TOPOLOGY_PATH.lstrip("/"))
    assert document.pairs[0].probe is not None and document.pairs[0].probe.status == "confirmed"
    assert document.pairs[0].probe.peer_memory_opened is True
    assert document.profile == "p2p" and document.schema_version == 2


def test_a_schema_1_document_still_loads(tmp_path: Path, no_ze_loader: None) -> None:
    root = build_tree(tmp_path, "b70x2-switch")
    topology(root, write=True)
    target = Path(root) / TOPOLOGY_PATH.lstrip("/")
    data = json.loads(target.read_text())
    data["schema_version"] = 1
    for pair in data["pairs"]:
        pair.pop("rule")
    data.pop("p2pdma")
    data["probe"].pop("detail")
    target.write_text(json.dumps(data))
    document = load_topology(target)
    assert document.schema_version == 1 and document.pairs[0].rule is None and document.profile == "no-p2p"


def test_a_tampered_topology_file_is_refused(tmp_path: Path, no_ze_loader: None) -> None:
    root = build_tree(tmp_path, "b70x2-switch")
    topology(root, profile="p2p", write=True)
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
