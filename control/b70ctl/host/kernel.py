"""Does this host need the distribution's B70 kernel (and firmware) before its GPUs can serve the recipe? A pure
decision over the facts facts.py collects under a root prefix and the release matrix (releases.yaml), which the
host_kernel role acts on: install the named packages, then reboot (b70_allow_reboot) or stop saying so.

- Needed when a GPU of the recipe's PCI ids is not bound to xe and the running kernel is older than the kernel
  series the release's package brings (24.04: the HWE meta-package, 6.17; 26.04: the archive's linux-generic,
  7.0), or when the loaded GuC is one the field shows resetting engines (host/firmware.py: 70.58.0), or the
  Battlemage firmware files are missing: then linux-firmware comes too.
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
from b70ctl.host.firmware import GUC_BROKEN
from b70ctl.host.releases import Release, ReleaseMatrix, load_matrix
from b70ctl.recipes.model import Recipe
from b70ctl.versions import version_at_least


class KernelPlan(Pinned):
    needed: bool
    reason: str
    packages: list[str]
    reboot_required: bool
    kernel_release: str | None
    release: str | None  # the codename the packages are for


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
    broken_guc = [(gpu, release_found) for gpu in gpus
                  if (release_found := ((gpu.get("firmware") or {}).get("guc") or {}).get("found_release"))
                  in GUC_BROKEN]
    missing_files = sorted(name for name, entry in (facts.get("firmware_files") or {}).items()
                           if not entry.get("present"))
    kernel_current = kernel_at_least(running, release.kernel.series or "")
    problems: list[str] = []
    packages: list[str] = []
    if unbound and not kernel_current:
        problems.append(f"GPU(s) {', '.join(gpu.get('pci_address') or '?' for gpu in unbound)} not bound to xe "
                        f"under kernel {running or '?'} (older than {release.title}'s {release.kernel.series} from "
                        f"{release.kernel.package})")
        packages.append(release.kernel.package or "")
    for gpu, found in broken_guc:
        problems.append(f"GPU {gpu.get('pci_address')} loaded GuC {found}, which resets engines under load "
                        f"({GUC_BROKEN[found]})")
    if missing_files:
        problems.append(f"firmware {', '.join(missing_files)} missing")
    if problems:
        packages.append(release.firmware.package or "")
        return KernelPlan(needed=True, reason="; ".join(problems), packages=packages, reboot_required=True,
                          kernel_release=running, release=release.codename)
    if unbound:
        return not_needed(f"kernel {running} is already {release.title}'s {release.kernel.series} or newer, yet "
                          f"GPU(s) {', '.join(gpu.get('pci_address') or '?' for gpu in unbound)} are not bound to "
                          "xe: no kernel package fixes that (check `dmesg | grep xe`, a blacklist, xe.force_probe)",
                          release)
    return not_needed(f"{len(gpus)} GPU(s) bound to xe under kernel {running or '?'}, firmware good", release)
