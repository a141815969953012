"""GuC releases and VRAM BARs a recipe refuses, read from fixture sysfs/debugfs trees: an existing tree with one
file rewritten the way a host with that firmware or BIOS setting shows it. dspark-int4-tp1 (TP=1) fits the
tree's RAM, so only the firmware decides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.host.fit import host_fit
from b70ctl.recipes import load_recipe
from b70host.facts import collect_facts
from sysfs_trees import build_tree

GIB = 1024 ** 3


def _tree(tmp_path: Path) -> Path:
    return Path(build_tree(tmp_path, "b70x2-switch"))


def _set_guc(root: Path, release: str) -> None:
    """xe's guc_info as xe_uc_fw_print writes it, with `found release version` set for every card."""
    infos = sorted(root.glob("sys/kernel/debug/dri/*/gt*/uc/guc_info"))
    assert infos, "the tree has no debugfs guc_info"
    for info in infos:
        lines = info.read_text().splitlines()
        lines = [f"\tfound release version {release}" if "found release version" in line else line
                 for line in lines]
        info.write_text("\n".join(lines) + "\n")


def _b70_resources(root: Path) -> list[Path]:
    found = []
    for device in sorted(root.glob("sys/bus/pci/devices/*")):
        vendor, ident = (device / "vendor").read_text().strip(), (device / "device").read_text().strip()
        if (vendor, ident) == ("0x8086", "0xe223"):
            found.append(device / "resource")
    assert found
    return found


def _shrink_bar2(resource: Path, size: int) -> None:
    """The PCI `resource` file: one 'start end flags' line per BAR; BAR 2 becomes `size` bytes long."""
    lines = resource.read_text().splitlines()
    start, _, flags = lines[2].split()
    lines[2] = f"{start} 0x{int(start, 16) + size - 1:016x} {flags}"
    resource.write_text("\n".join(lines) + "\n")


def test_the_tree_as_built_passes(tmp_path):
    result = host_fit(load_recipe("dspark-int4-tp1"), collect_facts(str(_tree(tmp_path))))
    assert result.firmware is not None and result.firmware.fits, result.firmware


# intel/compute-runtime #948 and vllm-project/vllm #55425, as docs/facts.md (Field reports) sums them up: "GuC
# firmware 70.58.0 is implicated in `Engine reset ... ccs/bcs` and `Fault response: Unsuccessful -ENOENT` faults
# under load; 70.65.0 and 70.72.1 cleared them".
def test_guc_70_58_0_is_refused_with_newer_linux_firmware_as_the_fix(tmp_path):
    root = _tree(tmp_path)
    _set_guc(root, "70.58.0")
    result = host_fit(load_recipe("dspark-int4-tp1"), collect_facts(str(root)))
    assert not result.fits and not result.firmware.fits
    reason = result.firmware.reason
    assert "loaded GuC 70.58.0" in reason and "Fault response: Unsuccessful -ENOENT" in reason
    assert "intel/compute-runtime #948, vllm-project/vllm #55425" in reason
    assert "70.65.0 and 70.72.1 cleared them: install a firmware with GuC 70.72.1 or newer" in reason
    assert "\n" not in reason


# docs/facts.md (Hardware): "GuC 70.54+ recommended": the floor. Below it the card is refused, at it it is not.
@pytest.mark.parametrize(("release", "refused"), [("70.40.2", True), ("70.53.9", True), ("70.54.0", False),
                                                  ("70.72.1", False), ("71.0.0", False)])
def test_the_guc_floor_is_70_54(tmp_path, release: str, refused: bool) -> None:
    root = _tree(tmp_path)
    _set_guc(root, release)
    result = host_fit(load_recipe("dspark-int4-tp1"), collect_facts(str(root)))
    assert result.firmware is not None and result.firmware.fits is not refused, result.firmware
    if refused:
        assert f"GuC {release} is below the B70 floor 70.54.0" in result.firmware.reason


def test_guc_70_65_0_passes(tmp_path):
    root = _tree(tmp_path)
    _set_guc(root, "70.65.0")
    result = host_fit(load_recipe("dspark-int4-tp1"), collect_facts(str(root)))
    assert result.firmware.fits and "GuC 70.65.0" in result.firmware.reason
    assert "caution" not in result.firmware.reason


# intel/compute-runtime #999 (GSD-13481, open, 2026-09-17): "On 2x Intel Arc Pro B65 (Battlemage G31, 8086:e222)
# under the xe driver, a deterministic two-GPU tensor-parallel LLM serving startup (vLLM TP=2 ...) fails every time"
# on GuC 70.72.1. Accepted (it is above the floor and cleared 70.58.0's resets in vllm #55425), but the fit says so
# once, with the thread and the way out, however many cards loaded it.
def test_guc_70_72_1_passes_with_its_open_report_named_once(tmp_path):
    root = _tree(tmp_path)
    _set_guc(root, "70.72.1")
    result = host_fit(load_recipe("pr620-fp8-tp2"), collect_facts(str(root)))
    assert result.firmware is not None and result.firmware.fits
    assert result.firmware.guc_releases == ["70.72.1", "70.72.1"]
    reason = result.firmware.reason
    assert reason.count("caution: GuC 70.72.1: a deterministic two-GPU TP=2 startup hang") == 1, reason
    assert "intel/compute-runtime #999" in reason and "/lib/firmware/updates/xe/" in reason


# docs/facts.md (Hardware): Resizable BAR must be on; with it off the VRAM aperture (BAR 2) stays 256 MiB.
def test_a_small_bar_is_refused_with_the_firmware_setup_fix(tmp_path):
    root = _tree(tmp_path)
    resource = _b70_resources(root)[0]
    _shrink_bar2(resource, 256 * 1024 ** 2)
    done = CliRunner().invoke(app, ["host", "fit", "--recipe", "dspark-int4-tp1", "--root", str(root), "--json"])
    assert done.exit_code == 1, done.output
    firmware = json.loads(done.stdout)["firmware"]
    assert firmware["fits"] is False and 256 in firmware["vram_bar_mib"]
    assert (f"GPU {resource.parent.name}: VRAM BAR (BAR 2) is 256 MiB of 32 GiB VRAM: Resizable BAR is off; "
            "enable Resizable BAR and Above 4G decoding in the firmware (BIOS/UEFI) setup") in firmware["reason"]


def test_people_see_the_firmware_part_of_the_fit(tmp_path):
    root = _tree(tmp_path)
    _set_guc(root, "70.58.0")
    done = CliRunner().invoke(app, ["host", "fit", "--recipe", "dspark-int4-tp1", "--root", str(root)])
    assert done.exit_code == 1
    assert "FAIL Firmware: GPU" in done.stdout and "ok RAM:" in done.stdout
