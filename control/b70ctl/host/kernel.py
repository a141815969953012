"""Does this host need the distribution's B70 kernel (and firmware) before its GPUs can serve the recipe? A pure
decision over the facts facts.py collects under a root prefix and the release matrix (releases.yaml), which the
host_kernel role acts on: install the named packages, then reboot (b70_allow_reboot) or stop saying so.

- Needed when a GPU of the recipe's PCI ids is not bound to xe and the running kernel is older than the kernel
  series the release's package brings (24.04: the HWE meta-package, 6.17; 26.04: the archive's linux-generic,
  7.0), or when the loaded GuC is one it refuses (host/firmware.py: below 70.54, or 70.58.0), or the Battlemage
  firmware files are missing: then linux-firmware comes too.
- Never a reboot into a GuC it refuses. When the GuC file the kernel would load next (facts.py reads its header,
  decompressed, in the firmware loader's order) is good, a reboot alone is planned. When it is refused and the
  release's firmware package carries a refused GuC too (releases.yaml `guc`), the release's `guc_override` (a good
  blob by sha256) goes to /lib/firmware/updates before the reboot; without one, nothing is installed: the plan is
  `refused`, host fit stops the play at preflight, and the line names the fix.
- Not needed when the GPUs are bound and the firmware is good (a converged host, the test hosts' trees), on CPU
  recipes, on a host without any of the recipe's GPUs (a kernel adds no card), and on a distribution or release the
  matrix does not provision (Debian test hosts under the appliance's own matrix: their kernel is the machine's;
  preflight refuses real ones). Given a matrix naming Debian's kernel (tests/fixtures/releases-testhosts.yaml), a
  test host whose emulated GPUs are unbound is planned for like any host, so the install path runs there too.
- A host already running the release's kernel series whose GPUs are still unbound is not something a kernel
  package fixes (xe.force_probe, a blacklist, dmesg): the plan says so instead of rebooting it again and again.
"""

from __future__ import annotations

from typing import Any

from b70ctl.documents import Pinned
from b70ctl.host.firmware import GUC_CLEARED, guc_caution, guc_refusal
from b70ctl.host.releases import GucOverride, Release, ReleaseMatrix, load_matrix
from b70ctl.recipes.model import Recipe
from b70ctl.versions import version_at_least

GUC_FILE = "xe/bmg_guc_70.bin"


class KernelPlan(Pinned):
    needed: bool
    reason: str
    packages: list[str]
    reboot_required: bool
    kernel_release: str | None
    release: str | None  # the codename the packages are for
    # Set when the only plan there is would reboot into a GuC it refuses: nothing is installed or rebooted, and
    # host fit stops the play at preflight with this line (it names the fix).
    refused: str | None = None
    # The good GuC blob host_kernel installs in /lib/firmware/updates before the reboot, when the release's own
    # firmware package carries a refused one (releases.yaml guc_override).
    guc_override: GucOverride | None = None


def kernel_at_least(running: str | None, series: str) -> bool:
    """'6.17.0-1009-intel' against '6.17': the numeric part before the first '-' (Ubuntu's ABI suffix)."""
    if not running:
        return False
    numeric = running.split("-", 1)[0]
    try:
        return version_at_least(numeric, series)
    except ValueError:
        return False


def kernel_plan(recipe: Recipe, facts: dict[str, Any], distribution: str, codename: str,
                matrix: ReleaseMatrix | None = None) -> KernelPlan:
    matrix = matrix or load_matrix()
    running = facts.get("kernel_release")

    def not_needed(reason: str, release: Release | None = None) -> KernelPlan:
        return KernelPlan(needed=False, reason=reason, packages=[], reboot_required=False, kernel_release=running,
                          release=release.codename if release else None)

    if recipe.host.accelerator != "xpu":
        return not_needed(f"recipe {recipe.name} runs on the CPU: no GPU kernel to provision")
    release = matrix.find(codename, distribution)
    if release is None or release.support != "supported" or release.kernel is None or release.firmware is None:
        return not_needed(f"{distribution} {codename or '(no codename)'} is not a release the appliance provisions "
                          f"kernels for: the running kernel {running or '?'} is left as it is")
    accepted = {pci_id.lower() for pci_id in recipe.host.gpu_pci_ids}
    gpus = [gpu for gpu in facts.get("gpus", []) if not accepted or (gpu.get("pci_id") or "").lower() in accepted]
    if not gpus:
        return not_needed(f"no GPU {', '.join(sorted(accepted)) or ''} is present: a kernel adds no card", release)
    unbound = [gpu for gpu in gpus if not gpu.get("xe_bound")]
    refused_guc = [(gpu, refusal) for gpu in gpus
                   if (refusal := guc_refusal(((gpu.get("firmware") or {}).get("guc") or {}).get("found_release")))]
    guc_file = (facts.get("firmware_files") or {}).get(GUC_FILE) or {}
    file_release = guc_file.get("release_version")
    file_path = guc_file.get("path") or f"/lib/firmware/{guc_file.get('file') or GUC_FILE}"
    missing_files = sorted(name for name, entry in (facts.get("firmware_files") or {}).items()
                           if not entry.get("present"))
    kernel_current = kernel_at_least(running, release.kernel.series or "")
    problems: list[str] = []
    packages: list[str] = []
    firmware_needed = bool(missing_files)
    if unbound and not kernel_current:
        problems.append(f"GPU(s) {', '.join(gpu.get('pci_address') or '?' for gpu in unbound)} not bound to xe "
                        f"under kernel {running or '?'} (older than {release.title}'s {release.kernel.series} from "
                        f"{release.kernel.package})")
        packages.append(release.kernel.package or "")
        firmware_needed = True  # a new kernel comes with the firmware of its release
    if refused_guc:
        loaded = "; ".join(f"GPU {gpu.get('pci_address')} loaded {refusal}" for gpu, refusal in refused_guc)
        if file_release is not None and guc_refusal(file_release) is None:
            # A good GuC is already installed and not yet loaded: a reboot is all it takes.
            problems.append(f"{loaded}; {file_path} carries GuC {file_release}: a reboot loads it")
        else:
            locked = release.firmware.guc
            override = release.firmware.guc_override
            if locked is not None and (locked_refusal := guc_refusal(locked.release)) is not None and \
                    override is not None and guc_refusal(override.guc) is None:
                # Install the good blob where the kernel looks first, then reboot: the archive's firmware stays
                # installed (and takes its updates), and the kernel loads this one.
                return KernelPlan(
                    needed=True, reboot_required=True, packages=[p for p in packages if p], kernel_release=running,
                    release=release.codename, guc_override=override,
                    reason="; ".join(problems + [
                        f"{loaded}; {release.firmware.package}'s own GuC is refused too "
                        f"({locked_refusal.split(' (')[0]}): installing "
                        f"GuC {override.guc} ({override.read_from.split(';')[0]}) as {override.host_path}, where "
                        "the kernel looks first"] + [f"caution: {caution}" for caution in [guc_caution(override.guc)]
                                                     if caution]))
            if locked is not None and (locked_refusal := guc_refusal(locked.release)) is not None:
                # The reboot loop of a stock 26.04 host: its archive firmware carries the refused GuC, so
                # installing it and rebooting would load the same GuC again.
                return KernelPlan(
                    needed=False, reboot_required=False, packages=[], kernel_release=running,
                    release=release.codename, reason=loaded,
                    refused=(f"{loaded}, and {release.title}'s {release.firmware.package} carries {locked_refusal} "
                             f"(read from {locked.read_from}): a reboot into it would load the same GuC again. "
                             f"Fix: put upstream linux-firmware's {GUC_FILE} (GuC {GUC_CLEARED[-1]} or newer) in "
                             f"/lib/firmware/updates/xe/ (the kernel looks there first), run update-initramfs -u, "
                             "then run the play again"))
            problems.append(f"{loaded}; {file_path} carries GuC {file_release or 'not known (not readable here)'}; "
                            f"{release.firmware.package} carries GuC "
                            f"{locked.release if locked else 'not known'}")
            firmware_needed = True
    if missing_files:
        problems.append(f"firmware {', '.join(missing_files)} missing")
    if problems:
        if firmware_needed:
            packages.append(release.firmware.package or "")
        return KernelPlan(needed=True, reason="; ".join(problems), packages=[p for p in packages if p],
                          reboot_required=True, kernel_release=running, release=release.codename)
    if unbound:
        return not_needed(f"kernel {running} is already {release.title}'s {release.kernel.series} or newer, yet "
                          f"GPU(s) {', '.join(gpu.get('pci_address') or '?' for gpu in unbound)} are not bound to "
                          "xe: no kernel package fixes that (check `dmesg | grep xe`, a blacklist, xe.force_probe)",
                          release)
    return not_needed(f"{len(gpus)} GPU(s) bound to xe under kernel {running or '?'}, firmware good", release)
