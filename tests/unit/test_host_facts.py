"""GPU inventory from real-shaped sysfs trees: which functions are cards, their model by PCI id, driver binding,
DRM nodes, links, BAR and firmware; the fact script run by the system python3 prints what the CLI prints."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app, main
from b70host import facts as facts_module
from b70host.facts import (
    classify_integrated,
    collect_facts,
    parse_cpd_release_version,
    parse_css_release_version,
    parse_link_speed_gts,
    parse_meminfo_total_bytes,
    parse_resize_sizes_bytes,
    parse_uc_info,
)
from host_package import host_module
from sysfs_trees import REPO, build_tree, sysfs

# Preflight pipes this one file to a host it has not changed yet (python3 -, the module alone).
FACTS_SCRIPT = REPO / "control" / "b70host" / "facts.py"

# scenario -> (PCI addresses of the cards, model per card, xe-bound count, integrated GPUs)
EXPECTED_INVENTORY = {
    "b70x2-switch": (["0000:05:00.0", "0000:09:00.0"], ["B70", "B70"], 2, []),
    "b70x2-switch-user": (["0000:05:00.0", "0000:09:00.0"], ["B70", "B70"], 2, []),
    "b70x2-root-ports": (["0000:03:00.0", "0000:06:00.0"], ["B70", "B70"], 2, []),
    "b70-igpu": (["0000:03:00.0"], ["B70"], 1, ["0000:00:02.0"]),
    "b70x4-two-switches": (["0000:1b:00.0", "0000:1f:00.0", "0000:cf:00.0", "0000:d3:00.0"], ["B70"] * 4, 4, []),
    "b60x2-switch": (["0000:05:00.0", "0000:09:00.0"], ["B60", "B60"], 2, []),
    "xe-unbound": (["0000:05:00.0", "0000:09:00.0"], ["B70", "B70"], 0, []),
    "no-intel-gpu": ([], [], 0, []),
}


@pytest.mark.parametrize("scenario", sorted(EXPECTED_INVENTORY))
def test_inventory_per_scenario(tmp_path: Path, scenario: str) -> None:
    addresses, models, bound, integrated = EXPECTED_INVENTORY[scenario]
    facts = collect_facts(build_tree(tmp_path, scenario))
    assert [gpu["pci_address"] for gpu in facts["gpus"]] == addresses
    assert [gpu["model"] for gpu in facts["gpus"]] == models
    assert facts["gpu_count"] == len(addresses)
    assert facts["gpu_count_xe_bound"] == bound
    assert [gpu["pci_address"] for gpu in facts["integrated_gpus"]] == integrated
    assert [gpu["index"] for gpu in facts["gpus"]] == list(range(len(addresses)))
    # The on-board bridges (e2ff/e2f0/e2f1) and the card's audio (e2f7) are never GPUs.
    assert not {"8086:e2f0", "8086:e2f1", "8086:e2ff", "8086:e2f7"} & set(facts["gpu_pci_ids"])


def test_b70_behind_a_switch_in_detail(tmp_path: Path) -> None:
    facts = collect_facts(build_tree(tmp_path, "b70x2-switch"))
    assert facts["kernel_release"] == "6.17.0-1009-intel"
    assert facts["ram_total_bytes"] == 131_842_412 * 1024
    assert facts["gpu_count_by_model"] == {"B70": 2}
    assert facts["gpu_pci_ids"] == ["8086:e223"]
    first = facts["gpus"][0]
    assert first["pci_id"] == "8086:e223" and first["class"] == "0x030000"
    assert first["marketing_name"] == "Intel Arc Pro B70" and first["die"] == "BMG-G31"
    assert (first["driver"], first["xe_bound"], first["level_zero_index"]) == ("xe", True, 0)
    assert (first["card"], first["render"]) == ("card0", "renderD128")
    assert first["dev_nodes"] == ["/dev/dri/card0", "/dev/dri/renderD128"]
    assert first["by_path"] == ["pci-0000:05:00.0-card", "pci-0000:05:00.0-render"]
    assert first["numa_node"] is None  # "-1" in sysfs: no NUMA affinity
    # Behind the card's own switch the GPU's link reads 2.5 GT/s x1; the slot link is the e2ff upstream port's.
    assert (first["link"]["current_speed_gts"], first["link"]["current_width"]) == (2.5, 1)
    assert first["slot_link"] == {"current_speed": "16.0 GT/s PCIe", "current_speed_gts": 16.0, "current_width": 16,
                                  "max_speed": "32.0 GT/s PCIe", "max_speed_gts": 32.0, "max_width": 16}
    assert first["bar"]["vram_bar_bytes"] == 32 * 1024 ** 3 and first["bar"]["resizable_bar"] == "full"
    assert first["bar"]["resizable_sizes_supported_bytes"][0] == 256 * 1024 ** 2
    assert first["vram_bytes"] == 32 * 1024 ** 3
    chain = [(bridge["address"], bridge["pci_id"], bridge["port_type"], bridge["on_board"])
             for bridge in first["parent_bridges"]]
    assert chain == [
        ("0000:00:01.0", "8086:a70d", "root_port", False),
        ("0000:01:00.0", "1000:c030", "switch_upstream", False),
        ("0000:02:00.0", "1000:c030", "switch_downstream", False),
        ("0000:03:00.0", "8086:e2ff", "switch_upstream", True),
        ("0000:04:01.0", "8086:e2f0", "switch_downstream", True),
    ]
    assert first["parent_bridges"][2]["acs"]["state"] == "off"
    assert first["parent_bridges"][2]["acs"]["control"] == "0x0000"
    assert first["firmware"]["guc"]["found_release"] == "70.54.0"
    assert first["firmware"]["guc"]["status"] == "RUNNING"
    assert first["firmware"]["huc"]["found_release"] == "8.2.10"
    assert facts["firmware_files"]["xe/bmg_guc_70.bin"]["release_version"] == "70.54.0"
    assert facts["firmware_files"]["xe/bmg_huc.bin"]["present"] is True
    # The HuC file is GSC/CPD-packaged: its version comes from its HUCP.man manifest, not a CSS header.
    assert facts["firmware_files"]["xe/bmg_huc.bin"]["release_version"] == "8.2.10"
    assert facts["warnings"] == []


def test_integrated_gpu_is_reported_but_never_counted(tmp_path: Path) -> None:
    facts = collect_facts(build_tree(tmp_path, "b70-igpu"))
    (igpu,) = facts["integrated_gpus"]
    assert igpu["pci_id"] == "8086:a780" and igpu["driver"] == "i915" and igpu["card"] == "card0"
    assert igpu["integrated_reason"] == "PCIe port type is root complex integrated endpoint"
    (card,) = facts["gpus"]
    assert (card["card"], card["render"], card["level_zero_index"]) == ("card1", "renderD129", 0)
    assert facts["ram_total_gib"] == pytest.approx(62.62, abs=0.01)


def test_integrated_gpu_without_readable_config_is_decided_by_location(tmp_path: Path) -> None:
    """As a user, config space is 64 bytes and the PCIe capability is not visible: an iGPU still sits on the
    host bridge's root bus with no bridge above it, a card never does."""
    root = tmp_path / "user"
    tree = sysfs.HostTree(str(root), config_bytes=64)
    host = tree.host_bridge("0000:00")
    tree.integrated_gpu(host)
    tree.battlemage_card(tree.root_port(host, "0000:00:01.0"), 0x01, sysfs.B70)
    tree.finish("6.17.0-1009-intel", 131_842_412)
    facts = collect_facts(str(root))
    assert [gpu["pci_address"] for gpu in facts["gpus"]] == ["0000:03:00.0"]
    assert facts["gpus"][0]["pcie_port_type"] is None
    assert facts["integrated_gpus"][0]["integrated_reason"] == "on the root bus of pci0000:00 with no bridge above it"
    assert facts["gpus"][0]["parent_bridges"][0]["acs"]["state"] == "unknown"


def test_classify_integrated_rules() -> None:
    assert classify_integrated("pci0000:00", [], "root_complex_integrated_endpoint")[0] is True
    assert classify_integrated("pci0000:00", [], None)[0] is True
    assert classify_integrated("pci0000:00", ["0000:00:01.0"], None)[0] is False
    assert classify_integrated("pci0000:00", [], "endpoint")[0] is False


def test_xe_not_bound_host(tmp_path: Path) -> None:
    facts = collect_facts(build_tree(tmp_path, "xe-unbound"))
    assert [gpu["driver"] for gpu in facts["gpus"]] == [None, None]
    assert [gpu["level_zero_index"] for gpu in facts["gpus"]] == [None, None]
    assert [gpu["card"] for gpu in facts["gpus"]] == [None, None]
    assert facts["xe_module_loaded"] is False
    assert [gpu["bar"]["resizable_bar"] for gpu in facts["gpus"]] == ["small", "small"]
    warnings = "\n".join(facts["warnings"])
    assert "0000:05:00.0: no driver bound (load the xe module" in warnings
    assert "VRAM BAR is 256 MiB: enable Resizable BAR" in warnings
    assert "firmware missing under /lib/firmware: xe/bmg_guc_70.bin, xe/bmg_huc.bin" in warnings


def test_separate_root_ports_host_warns_about_a_narrow_slot(tmp_path: Path) -> None:
    facts = collect_facts(build_tree(tmp_path, "b70x2-root-ports"))
    assert facts["warnings"] == ["B70 0000:06:00.0: slot link x8 of x16: reseat the card or use a full-width slot"]
    assert [gpu["parent_bridges"][0]["address"] for gpu in facts["gpus"]] == ["0000:00:01.0", "0000:00:01.1"]


def test_b60_and_server_numa(tmp_path: Path) -> None:
    b60 = collect_facts(build_tree(tmp_path, "b60x2-switch"))
    assert {gpu["pci_id"] for gpu in b60["gpus"]} == {"8086:e211"}
    assert [gpu["vram_gib_nominal"] for gpu in b60["gpus"]] == [24.0, 24.0]
    server = collect_facts(build_tree(tmp_path, "b70x4-two-switches"))
    assert [gpu["numa_node"] for gpu in server["gpus"]] == [0, 0, 1, 1]
    assert [gpu["host_bridge"] for gpu in server["gpus"]] == ["pci0000:16"] * 2 + ["pci0000:ca"] * 2


def test_host_without_intel_gpu_ignores_other_vga(tmp_path: Path) -> None:
    facts = collect_facts(build_tree(tmp_path, "no-intel-gpu"))
    assert facts["gpus"] == [] and facts["integrated_gpus"] == []
    assert facts["gpu_count_by_model"] == {}
    assert facts["warnings"] == []  # no GPU, so missing xe firmware is not a problem here


def test_unknown_battlemage_id_is_counted_with_its_die(tmp_path: Path) -> None:
    root = tmp_path / "g21"
    tree = sysfs.HostTree(str(root))
    host = tree.host_bridge("0000:00")
    tree.battlemage_card(tree.root_port(host, "0000:00:01.0"), 0x01, 0xE216)
    tree.finish("6.17.0-1009-intel", 131_842_412)
    (gpu,) = collect_facts(str(root))["gpus"]
    assert (gpu["model"], gpu["die"], gpu["known_model"]) == ("BMG-G21", "BMG-G21", True)


@pytest.mark.parametrize("scenario", ["b70x2-switch", "b70-igpu", "xe-unbound", "no-intel-gpu"])
def test_fact_script_under_system_python_prints_what_the_cli_prints(tmp_path: Path, scenario: str) -> None:
    """The installed fact (the host package's module) and preflight's read (the file alone on stdin, nothing
    installed) print what `b70ctl host facts --json` prints."""
    root = build_tree(tmp_path, scenario)
    installed = subprocess.run(host_module("facts", "--root", root), capture_output=True, text=True, check=True,
                               cwd=tmp_path)
    piped = subprocess.run(["python3", "-", "--root", root], input=FACTS_SCRIPT.read_text(), capture_output=True,
                           text=True, check=True, cwd=tmp_path)
    cli = CliRunner().invoke(app, ["host", "facts", "--root", root, "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(installed.stdout) == json.loads(piped.stdout) == json.loads(cli.stdout)


def test_the_free_space_of_the_model_store_is_what_df_says_before_and_after_it_exists(tmp_path: Path) -> None:
    """What the host fit weighs the models against, measured by the script preflight pipes to the host: GNU df's
    Available column for the directory, or for its nearest existing parent while the store is not created yet.
    df is asked just before and just after, so other writers to the filesystem move the bracket, not the verdict."""
    store = tmp_path / "var" / "lib" / "b70" / "models"

    def df_available(path: Path) -> int:
        lines = subprocess.run(["df", "-P", "-B1", str(path)], capture_output=True, text=True, check=True).stdout
        return int(lines.splitlines()[-1].split()[3])

    def measured(df_path: Path) -> tuple[dict, int, int]:
        first = df_available(df_path)
        completed = subprocess.run(["python3", "-", "--root", str(tmp_path), "--free-space-of", str(store)],
                                   input=FACTS_SCRIPT.read_text(), capture_output=True, text=True, check=True)
        return json.loads(completed.stdout)["free_space"], first, df_available(df_path)

    slack = 1 << 20  # df rounds nothing with -B1; this is room for a log line written in between
    before, first, last = measured(tmp_path)
    assert (before["path"], before["measured_at"]) == (str(store), str(tmp_path))
    assert min(first, last) - slack <= before["free_bytes"] <= max(first, last) + slack
    store.mkdir(parents=True)
    after, first, last = measured(store)
    assert after["measured_at"] == str(store)
    assert min(first, last) - slack <= after["free_bytes"] <= max(first, last) + slack
    # A relative path says nothing of where it is on the host: not measured (host fit names b70_model_store_dir).
    relative = subprocess.run(["python3", "-", "--root", str(tmp_path), "--free-space-of", "var/lib/b70"],
                              input=FACTS_SCRIPT.read_text(), capture_output=True, text=True, check=True)
    assert json.loads(relative.stdout)["free_space"] == {"path": "var/lib/b70", "measured_at": None,
                                                         "free_bytes": None}


def test_fact_script_refuses_a_missing_root(tmp_path: Path) -> None:
    completed = subprocess.run(host_module("facts", "--root", str(tmp_path / "absent")),
                               capture_output=True, text=True)
    assert completed.returncode == 2
    assert "is not a directory" in completed.stderr

def test_cli_refuses_a_missing_root_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["b70ctl", "host", "facts", "--root", str(tmp_path / "absent")])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert "is not a directory: give the root of a sysfs tree" in capsys.readouterr().err


def test_fixture_builder_runs_as_a_script(tmp_path: Path) -> None:
    target = tmp_path / "host1"
    completed = subprocess.run(["python3", "-m", "tests.fixtures.sysfs", "b70x2-root-ports", str(target)], cwd=REPO,
                               capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert (target / "sys/bus/pci/devices/0000:03:00.0").is_symlink()
    assert collect_facts(str(target))["gpu_count"] == 2
    unknown = subprocess.run(["python3", str(REPO / "tests/fixtures/sysfs.py"), "b90", str(target)],
                             capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown scenario 'b90'" in unknown.stderr


def test_kernel_formats_are_parsed() -> None:
    assert parse_link_speed_gts("16.0 GT/s PCIe") == 16.0
    assert parse_link_speed_gts("8 GT/s") == 8.0  # kernels before 4.17
    assert parse_link_speed_gts("Unknown") is None
    assert parse_resize_sizes_bytes("0000000000000300") == [256 * 2 ** 20, 512 * 2 ** 20]
    assert parse_meminfo_total_bytes("MemTotal:       65657044 kB\nMemFree: 1 kB\n") == 65_657_044 * 1024
    info = parse_uc_info("GuC firmware: xe/bmg_guc_70.bin\n\tstatus: LOAD_FAIL\n\twanted release version 70.44.1\n"
                         "\tfound release version 70.36.0\n")
    assert info == {"source": "debugfs", "path": "xe/bmg_guc_70.bin", "status": "LOAD_FAIL",
                    "wanted_release": "70.44.1", "found_release": "70.36.0"}
    assert parse_css_release_version(sysfs.guc_css_blob(70, 49, 4)) == "70.49.4"
    assert parse_css_release_version(b"$CPD" + bytes(200)) is None


# Offsets of the packed structs in Linux's drivers/gpu/drm/xe/xe_uc_fw_abi.h, counted here by hand from the field
# types: gsc_cpd_header_v2 is 4+4+1+1+1+1+4+4 = 20 bytes with header_length at byte 10; gsc_cpd_entry is 12+4+4+4
# = 24 bytes with its offset at byte 12; gsc_manifest_header has nine u32 (36 bytes) before fw_version (four u16)
# and is 128 bytes long.
CPD_HEADER_BYTES, CPD_ENTRY_BYTES, MANIFEST_BYTES, MANIFEST_VERSION_AT = 20, 24, 128, 36


def test_the_huc_fixture_is_laid_out_as_the_kernel_structs_say() -> None:
    blob = sysfs.huc_gsc_blob(8, 5, 4, 1)
    assert blob[:4] == b"$CPD" and int.from_bytes(blob[:4], "little") == 0x44504324  # GSC_CPD_HEADER_MARKER
    entries, header_length = int.from_bytes(blob[4:8], "little"), blob[10]
    assert (entries, header_length) == (2, CPD_HEADER_BYTES)
    names = [blob[header_length + i * CPD_ENTRY_BYTES:][:12].rstrip(b"\0") for i in range(entries)]
    assert names == [b"HUCP.man", b"huc_fw"]
    manifest = int.from_bytes(blob[header_length + 12:header_length + 16], "little") & (2 ** 25 - 1)
    version = blob[manifest + MANIFEST_VERSION_AT:manifest + MANIFEST_VERSION_AT + 8]
    assert [int.from_bytes(version[i:i + 2], "little") for i in range(0, 8, 2)] == [8, 5, 4, 1]
    # The driver keeps major.minor.hotfix for a HuC (the build only for the GSC firmware).
    assert parse_cpd_release_version(blob) == "8.5.4"


def test_the_huc_release_is_the_firmware_entrys_css_version_as_the_driver_prints_it() -> None:
    # parse_cpd_header reads the manifest's fw_version, then parse_css_header of "huc_fw" overwrites it: debugfs
    # huc_info shows the CSS release. A file whose two disagree reads as the driver would load it.
    blob = sysfs.huc_gsc_blob(8, 5, 4, css_version=(8, 6, 1))
    assert parse_cpd_release_version(blob) == "8.6.1"
    firmware = len(blob) - len(sysfs.guc_css_blob(8, 6, 1))
    broken_css = blob[:firmware + 4] + (0).to_bytes(4, "little") + blob[firmware + 8:]  # header_size_dw wrong
    assert parse_cpd_release_version(broken_css) == "8.5.4"  # no valid CSS: the manifest's version


def test_a_cut_or_garbled_cpd_gives_no_version_and_never_raises() -> None:
    blob = sysfs.huc_gsc_blob(8, 5, 4)
    manifest_end = CPD_HEADER_BYTES + 2 * CPD_ENTRY_BYTES + MANIFEST_BYTES
    # Cut anywhere before the manifest header's end: the driver refuses the file ("FW too small"), so None.
    assert [cut for cut in range(manifest_end) if parse_cpd_release_version(blob[:cut]) is not None] == []
    assert parse_cpd_release_version(blob[:manifest_end]) == "8.5.4"

    def changed(at: int, value: bytes) -> bytes:
        return blob[:at] + value + blob[at + len(value):]
    assert parse_cpd_release_version(changed(10, bytes([19]))) is None  # header_length below the header's size
    assert parse_cpd_release_version(changed(4, (10 ** 6).to_bytes(4, "little"))) is None  # entries past the end
    assert parse_cpd_release_version(changed(20, b"HUCP.mab")) is None  # no manifest entry
    assert parse_cpd_release_version(changed(20, b"HUCP.man1234")) is None  # 12 bytes, no NUL: not "HUCP.man"
    assert parse_cpd_release_version(changed(32, bytes(4))) is None  # manifest at offset 0: not found
    assert parse_cpd_release_version(changed(32, (len(blob) - 100).to_bytes(4, "little"))) is None
    assert parse_cpd_release_version(sysfs.guc_css_blob(70, 54, 0)) is None  # CSS, not CPD
    assert parse_cpd_release_version(b"$CPD" + bytes(1020)) is None  # the marker and nothing else
    assert parse_cpd_release_version(b"") is None and parse_cpd_release_version(None) is None
    garbage = random.Random(14)
    for _ in range(2000):
        noise = bytes(garbage.randrange(256) for _ in range(garbage.randrange(20, 400)))
        entries = garbage.choice([0, 1, 2, 3, 0xFFFFFFFF]).to_bytes(4, "little")
        result = parse_cpd_release_version(b"$CPD" + entries + noise)
        assert result is None or re.fullmatch(r"\d+\.\d+\.\d+", result)


def test_old_guc_is_warned_about(tmp_path: Path) -> None:
    root = tmp_path / "oldguc"
    tree = sysfs.HostTree(str(root))
    host = tree.host_bridge("0000:00")
    tree.battlemage_card(tree.root_port(host, "0000:00:01.0"), 0x01, sysfs.B70, with_debugfs=("70.36.0", "8.2.10"))
    tree.finish("6.17.0-1009-intel", 131_842_412)
    facts = collect_facts(str(root))
    assert facts["warnings"] == ["B70 0000:03:00.0: GuC 70.36.0 loaded, 70.54+ recommended: update /lib/firmware/xe"]
    assert facts_module.GUC_RECOMMENDED == (70, 54, 0)


def _environment_of(facts: dict):
    from b70ctl.host.environment import HostBundle, host_environment
    from b70ctl.lock.model import load_recipe_and_lock
    recipe, lock, _ = load_recipe_and_lock("pr620-fp8-tp2", None)
    return host_environment(HostBundle(hostname="b70-a", facts=facts), recipe, lock)


def test_the_environment_names_where_each_firmware_version_came_from(tmp_path: Path) -> None:
    facts = collect_facts(build_tree(tmp_path, "b70x2-switch"))
    loaded = _environment_of(facts)
    # The driver's own word first (debugfs, per GPU): what runs, not what lies on disk.
    assert (loaded.xe_guc_firmware, loaded.xe_huc_firmware) == ("70.54.0 (loaded)", "8.2.10 (loaded)")
    # Read without root: no debugfs, so the versions inside the files (CSS GuC, CPD HuC).
    unprivileged = dict(facts, gpus=[dict(gpu, firmware=None) for gpu in facts["gpus"]])
    from_files = _environment_of(unprivileged)
    assert (from_files.xe_guc_firmware, from_files.xe_huc_firmware) == ("70.54.0 (file)", "8.2.10 (file)")
    # A compressed file's version is not read: its name says what is there.
    compressed = dict(unprivileged, firmware_files=dict(facts["firmware_files"], **{"xe/bmg_huc.bin": {
        "present": True, "file": "xe/bmg_huc.bin.zst", "size_bytes": 1, "release_version": None}}))
    assert _environment_of(compressed).xe_huc_firmware == "xe/bmg_huc.bin.zst (file, version not readable)"
    # GPUs that loaded different versions show each.
    mixed = dict(facts, gpus=[facts["gpus"][0], dict(facts["gpus"][1], firmware={"guc": {"found_release": "70.49.4"},
                                                                                    "huc": None})])
    assert _environment_of(mixed).xe_guc_firmware == "70.54.0 / 70.49.4 (loaded)"


def test_the_environment_says_when_the_hardware_was_emulated(tmp_path: Path) -> None:
    root = build_tree(tmp_path, "b70-igpu")
    facts = collect_facts(root)
    assert facts["root"] == root and _environment_of(facts).hardware_root == root
    # Facts read at / are a real host's: nothing to say.
    for real in ("/", "//", None):
        assert _environment_of(dict(facts, root=real)).hardware_root is None
