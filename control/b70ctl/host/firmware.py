"""GPU firmware and PCI BAR a recipe refuses to start on, read from the host's facts (facts.py: the GuC release the
driver loaded, from debugfs; BAR 2's size, from the PCI device's sysfs `resource` file).

- GuC releases below 70.54 are below the B70 floor (docs/facts.md, Hardware), and 70.58.0 is implicated in
  `Engine reset ... ccs/bcs` and `Fault response: Unsuccessful -ENOENT` under load;
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
# The B70 floor: docs/facts.md, Hardware ("GuC 70.54+ recommended"; facts.py GUC_RECOMMENDED warns below it).
GUC_FLOOR = (70, 54, 0)
# GuC releases that are accepted but carry an open report an owner should weigh before a TP=2 start, with what to do.
# 70.72.1 is the release the matrix installs where an archive's own GuC is refused (releases.yaml guc_override): the
# newest blob the package registries serve, and the one that cleared 70.58.0's resets in vllm-project/vllm #55425.
GUC_CAUTION = {
    "70.72.1": ("a deterministic two-GPU TP=2 startup hang on Battlemage G31 is reported against it, open: GuC takes "
                "the context and never runs it, until a 'not started' timeout (intel/compute-runtime #999, "
                "GSD-13481, 2x Arc Pro B65); owners quote Intel's OMIX support matrix as validating GuC 70.65. If TP=2 "
                "hangs at its first collective, put a GuC 70.65 xe/bmg_guc_70.bin in /lib/firmware/updates/xe/: the "
                "appliance keeps any accepted GuC it finds there"),
}


def guc_caution(release: str | None) -> str | None:
    """The open report against an accepted GuC release (GUC_CAUTION), or None."""
    return f"GuC {release}: {GUC_CAUTION[release]}" if release in GUC_CAUTION else None


def guc_refusal(release: str | None) -> str | None:
    """Why a GuC release is refused on a B70 (below the floor, or one the field shows resetting engines), or None:
    an unknown or unreadable release is not refused, since nothing is known against it."""
    if release is None:
        return None
    if release in GUC_BROKEN:
        return (f"GuC {release} resets engines and faults (\"Fault response: Unsuccessful -ENOENT\") under load "
                f"({GUC_BROKEN[release]}); {' and '.join(GUC_CLEARED)} cleared them")
    try:
        parts = tuple(int(part) for part in release.split("."))
    except ValueError:
        return None
    if parts < GUC_FLOOR:
        return f"GuC {release} is below the B70 floor {'.'.join(map(str, GUC_FLOOR))} (docs/facts.md, Hardware)"
    return None


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
        refusal = guc_refusal(release)
        if refusal is not None:
            problems.append(f"GPU {gpu.get('pci_address')}: loaded {refusal}: install a firmware with GuC "
                            f"{GUC_CLEARED[-1]} or newer and reboot (b70ctl host kernel-plan says how)")
    for gpu, bar, mib in zip(gpus, bars, bar_mib):
        if bar.get("resizable_bar") in ("small", "partial"):
            vram = gpu.get("vram_bytes")
            of = f" of {vram / 1024 ** 3:.0f} GiB VRAM" if isinstance(vram, int) and vram else ""
            problems.append(f"GPU {gpu.get('pci_address')}: VRAM BAR (BAR 2) is {mib} MiB{of}: Resizable BAR is "
                            "off; enable Resizable BAR and Above 4G decoding in the firmware (BIOS/UEFI) setup")
    if problems:
        return FirmwareFit(fits=False, reason="; ".join(problems), guc_releases=releases, vram_bar_mib=bar_mib)
    known = ", ".join(f"GuC {release}" for release in releases if release) or "GuC unknown (debugfs is root only)"
    cautions = [f"; caution: {caution}" for caution in dict.fromkeys(map(guc_caution, releases)) if caution]
    return FirmwareFit(fits=True, reason=f"{known}; VRAM BAR {', '.join(str(mib) for mib in bar_mib) or 'n/a'} MiB"
                       + "".join(cautions), guc_releases=releases, vram_bar_mib=bar_mib)
