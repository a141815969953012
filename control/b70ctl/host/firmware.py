"""GPU firmware and PCI BAR a recipe refuses to start on, read from the host's facts (facts.py: the GuC release the
driver loaded, from debugfs; BAR 2's size, from the PCI device's sysfs `resource` file).

- GuC 70.58.0 is implicated in `Engine reset ... ccs/bcs` and `Fault response: Unsuccessful -ENOENT` under load;
  70.65.0 and 70.72.1 cleared them (intel/compute-runtime #948, vllm-project/vllm #55425; docs/facts.md, Field
  reports). The fix is a newer linux-firmware.
- BAR 2 is the VRAM aperture of Intel discrete GPUs. With Resizable BAR off it stays 256 MiB of a 32 GB card
  (facts.py `_bar` classifies it small, or partial when larger but below VRAM); B70 stacks need it on
  (docs/facts.md, Hardware).
"""

from __future__ import annotations

from typing import Any

from b70ctl.host.memory import Fit, usable_gpus
from b70ctl.recipes.model import Recipe

MIB = 1024 ** 2
# GuC releases with field reports of engine resets and page-fault storms, and the threads that report them.
GUC_BROKEN = {"70.58.0": "intel/compute-runtime #948, vllm-project/vllm #55425"}
GUC_CLEARED = ("70.65.0", "70.72.1")


class FirmwareFit(Fit):
    guc_releases: list[str | None]
    vram_bar_mib: list[int | None]


def firmware_fit(recipe: Recipe, facts: dict[str, Any]) -> FirmwareFit:
    """Refuses a broken GuC or a small VRAM BAR on any GPU this recipe uses; unknown values (debugfs is root only,
    an unreadable resource file) are not refused: nothing is known against them."""
    gpus = usable_gpus(recipe, facts) if recipe.host.accelerator == "xpu" else []
    releases = [((gpu.get("firmware") or {}).get("guc") or {}).get("found_release") for gpu in gpus]
    bars = [(gpu.get("bar") or {}) for gpu in gpus]
    bar_mib = [bar["vram_bar_bytes"] // MIB if isinstance(bar.get("vram_bar_bytes"), int) else None for bar in bars]
    problems: list[str] = []
    for gpu, release in zip(gpus, releases):
        if release in GUC_BROKEN:
            problems.append(f"GPU {gpu.get('pci_address')}: GuC {release} loaded, which resets engines and faults "
                            f"(\"Fault response: Unsuccessful -ENOENT\") under load ({GUC_BROKEN[release]}); "
                            f"{' and '.join(GUC_CLEARED)} cleared them: install a newer linux-firmware and reboot")
    for gpu, bar, mib in zip(gpus, bars, bar_mib):
        if bar.get("resizable_bar") in ("small", "partial"):
            vram = gpu.get("vram_bytes")
            of = f" of {vram / 1024 ** 3:.0f} GiB VRAM" if isinstance(vram, int) and vram else ""
            problems.append(f"GPU {gpu.get('pci_address')}: VRAM BAR (BAR 2) is {mib} MiB{of}: Resizable BAR is "
                            "off; enable Resizable BAR and Above 4G decoding in the firmware (BIOS/UEFI) setup")
    if problems:
        return FirmwareFit(fits=False, reason="; ".join(problems), guc_releases=releases, vram_bar_mib=bar_mib)
    known = ", ".join(f"GuC {release}" for release in releases if release) or "GuC unknown (debugfs is root only)"
    return FirmwareFit(fits=True, reason=f"{known}; VRAM BAR {', '.join(str(mib) for mib in bar_mib) or 'n/a'} MiB",
                       guc_releases=releases, vram_bar_mib=bar_mib)
