"""Does a recipe fit this host? Every verdict in one place: the release (with --hosts), GPU count and driver binding,
per-card VRAM, host RAM, the GuC firmware and VRAM BAR, the running kernel, the model store's free space.

`b70ctl host fit` prints it for one host (its facts under --root, or from --facts); preflight asks it for every
host of a play at once (`--hosts -`), with what only the play knows: the inventory's GPU count and the host's
release, from which each host's kernel plan (host/kernel.py) is made in the same run. The model store's free space
comes with the facts preflight reads (facts.py --free-space-of).
While a kernel plan is pending, the checks that the new kernel settles (xe binding, firmware, the kernel release
itself) wait for it: host_kernel checks them after the reboot.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import Field, SerializeAsAny

from b70ctl.documents import Document, Pinned
from b70ctl.host.firmware import firmware_fit
from b70ctl.host.kernel import KernelPlan, kernel_at_least, kernel_plan
from b70ctl.host.memory import (
    GIB,
    KV_CACHE_GIB_MIN,
    CardFit,
    Fit,
    GpuCountFit,
    RamFit,
    card_fit,
    gpu_count_fit,
    host_vram_gib,
    peer_mirror_gib,
    ram_fit,
    usable_gpus,
)
from b70ctl.host.releases import ReleaseMatrix, load_matrix, release_verdict
from b70ctl.host_documents import FactsDocument
from b70ctl.recipes.model import Recipe, site_env_problem
from b70ctl.serve.unit import MODEL_STORE_DIR, SERVICE_USER


class HostFit(Pinned):
    recipe: str
    fits: bool
    reasons: list[str] = Field(description="Each verdict that failed, with its fix")
    gpus: GpuCountFit
    card: CardFit
    ram: RamFit
    firmware: SerializeAsAny[Fit] | None = None  # host/firmware.py FirmwareFit: GuC release and VRAM BAR
    kernel: Fit | None = Field(None, description="The running kernel against the recipe's kernel_min")
    disk: Fit | None = Field(None, description="The model store's free space against the recipe's disk_gib_min")
    settings: Fit | None = Field(None, description="With --hosts: the inventory's settings against the rules of the "
                                                  "unit files, mounts and environment files they are written into")
    release: Fit | None = Field(None, description="With --hosts: the host's release against the release matrix")
    packages: Fit | None = Field(None, description="With --hosts: the host package lock has every group the play "
                                                   "installs on this host")
    kernel_plan: KernelPlan | None = Field(None, description="With --hosts: what the host_kernel role installs first")


class PlayHost(Document):
    """One host of a play, as preflight hands it to `b70ctl host fit --hosts -`."""

    host: str = Field(min_length=1, description="The inventory name")
    recipe: str = Field(min_length=1, description="b70_recipe: a recipe name or the path of a recipe file")
    facts: FactsDocument = Field(description="The host package's GPU inventory (b70host.facts)")
    gpus: int | None = Field(None, ge=0, description="b70_gpus: the GPUs the host serves with (default the recipe's)")
    distribution: str = Field(description="Ansible's distribution fact (Ubuntu, Debian)")
    codename: str = Field(description="Ansible's distribution_release fact (noble, resolute)")
    test_host: bool = Field(False, description="b70_test_host: a systemd test host, whose distribution may be one of "
                                               "test_host_distributions")
    test_host_distributions: list[str] = Field(default_factory=list,
                                               description="Distributions accepted on test hosts beside the matrix")
    service_user: str = Field(description="b70_service_user: the units' User=")
    model_store_dir: str = Field(description="b70_model_store_dir: mounted into the serving containers")
    extra_env: dict[str, Any] = Field(default_factory=dict,
                                      description="vllm_serve_extra_env: lines of the units' environment files")
    manage_gpu: bool = Field(True, description="b70_manage_intel_gpu: the play installs the GPU runtime")


# What the host package lock says of each release's groups: {codename: {group: None when resolved, else why not}}.
LockedGroups = dict[str, dict[str, str | None]]


def settings_fit(host: PlayHost) -> Fit:
    """The inventory's settings that reach a unit file, a mount or an environment file, each against the rule of
    the place it reaches (serve/unit.py, recipes/model.py): a quote or a line break can never break or extend what
    is written from them. Judged before anything else: nothing else is safe to act on otherwise."""
    problems = []
    if not re.fullmatch(SERVICE_USER, host.service_user):
        problems.append(f"b70_service_user {json.dumps(host.service_user)} holds characters it may not: a user name "
                        "(lower-case letters, digits, _ and -, up to 32, first a letter or _): set b70_service_user "
                        "to such a value")
    if not re.fullmatch(MODEL_STORE_DIR, host.model_store_dir):
        problems.append(f"b70_model_store_dir {json.dumps(host.model_store_dir)} holds characters it may not: an "
                        "absolute path of letters, digits and . _ + - (no spaces, quotes, ':' or ..): set "
                        "b70_model_store_dir to such a value")
    for name, value in host.extra_env.items():
        problem = site_env_problem(name, value)
        if problem is not None:
            problems.append(f"vllm_serve_extra_env {problem}")
    if problems:
        return Fit(fits=False, reason="; ".join(problems))
    return Fit(fits=True, reason=f"b70_service_user, b70_model_store_dir and {len(host.extra_env)} "
                                 "vllm_serve_extra_env entries are safe to write")


def newer_kernel_fix(matrix: ReleaseMatrix) -> str:
    """The way to a newer kernel, from the release matrix: each provisioned release's kernel package."""
    packages = "; ".join(f"{release.version}: {release.kernel.package}" for release in matrix.releases
                         if release.support == "supported" and release.kernel is not None and release.kernel.package)
    return f"boot a newer kernel of the distribution ({packages}) and make it the GRUB default"


def kernel_fit(recipe: Recipe, facts: dict[str, Any], matrix: ReleaseMatrix | None = None) -> Fit | None:
    minimum = recipe.host.kernel_min
    if minimum is None:
        return None
    running = facts.get("kernel_release")
    if kernel_at_least(running, minimum):
        return Fit(fits=True, reason=f"kernel {running} is {minimum} or newer")
    return Fit(fits=False, reason=f"kernel {running or '?'} is older than {minimum}, the oldest recipe {recipe.name} "
                                  f"works with: {newer_kernel_fix(matrix or load_matrix())}")


def disk_fit(recipe: Recipe, free_bytes: int) -> Fit:
    free_gib, needed = free_bytes / GIB, recipe.host.disk_gib_min
    shown = f"{free_gib:.1f} GiB free for the model store, recipe {recipe.name} needs {needed:g} GiB"
    if free_gib >= needed:
        return Fit(fits=True, reason=shown)
    return Fit(fits=False, reason=f"{shown}: free space there, or set b70_model_store_dir to a larger filesystem")


def host_fit(recipe: Recipe, facts: dict[str, Any], kv_cache_gib_required: float = KV_CACHE_GIB_MIN, *,
             gpus_required: int | None = None, kernel_plan_needed: bool = False,
             matrix: ReleaseMatrix | None = None) -> HostFit:
    """Every verdict over the host's facts; the model store's free space is judged when the facts carry it
    (facts.py --free-space-of, as preflight reads them)."""
    gpus = gpu_count_fit(recipe, facts, gpus_required, binding_pending=kernel_plan_needed)
    usable = usable_gpus(recipe, facts)
    vram, source = host_vram_gib(usable[: max(recipe.serve.tensor_parallel_size, 1)])
    card = card_fit(recipe, vram, source, kv_cache_gib_required)
    visible = min(len(usable), recipe.serve.tensor_parallel_size)
    ram = ram_fit(recipe, facts.get("ram_total_bytes"), peer_mirror_gib(recipe, card.usable_vram_gib, visible))
    # The firmware and the kernel come with a pending kernel plan: host_kernel checks them after the reboot.
    firmware = None if kernel_plan_needed else firmware_fit(recipe, facts)
    kernel = None if kernel_plan_needed else kernel_fit(recipe, facts, matrix)
    free_bytes = (facts.get("free_space") or {}).get("free_bytes")
    disk = None if free_bytes is None else disk_fit(recipe, free_bytes)
    parts: list[Fit | None] = [gpus, card, ram, firmware, kernel, disk]
    failed = [part.reason for part in parts if part is not None and not part.fits]
    return HostFit(recipe=recipe.name, fits=not failed, reasons=failed, gpus=gpus, card=card, ram=ram,
                   firmware=firmware, kernel=kernel, disk=disk)


def release_fit(host: PlayHost, matrix: ReleaseMatrix) -> Fit:
    verdict = release_verdict(host.distribution, host.codename, matrix=matrix)
    if verdict.supported:
        return Fit(fits=True, reason=verdict.message)
    if host.test_host and host.distribution in host.test_host_distributions:
        return Fit(fits=True, reason=f"{host.distribution} {host.codename}: accepted on a test host")
    accepted = "/".join(host.test_host_distributions)
    return Fit(fits=False, reason=verdict.message + (f" ({accepted} is accepted only on test hosts, b70_test_host: "
                                                     "true)" if accepted else ""))


def packages_fit(host: PlayHost, locked: LockedGroups, kernel_needed: bool) -> Fit:
    """Every package group the play will install on this host is in the host package lock, resolved. Judged here,
    before anything is installed or rebooted: a group found unresolved later stops a host half-provisioned."""
    wanted = (["kernel"] if kernel_needed else []) + (["gpu_runtime"] if host.manage_gpu else []) + \
        ["container_engine"]
    fix = (f"run `b70ctl lock resolve --host-packages --series {host.codename}` on a controller that reaches "
           "those indexes, keep the lock it writes (b70_host_packages_lock), and run the play again")
    groups = locked.get(host.codename)
    if groups is None:
        return Fit(fits=False, reason=f"the host package lock has no packages for {host.codename}: {fix}")
    problems = [f"{group} ({groups[group] or 'not resolved'})" if group in groups else f"{group} (not in the lock)"
                for group in wanted if group not in groups or groups[group] is not None]
    if problems:
        return Fit(fits=False, reason=f"{host.codename}: the host package lock cannot install "
                                      f"{'; '.join(problems)}: it was resolved where that source could not be "
                                      f"read, and nothing here can install those packages: {fix}")
    return Fit(fits=True, reason=f"{host.codename}: the host package lock has {', '.join(wanted)}")


def play_fit(host: PlayHost, recipe: Recipe, matrix: ReleaseMatrix, locked: LockedGroups | None = None) -> HostFit:
    """One host of a play: its release first (on a release the appliance does not provision, nothing else is
    judged), then the kernel plan, the host package lock (when given) and every verdict of host_fit."""
    settings = settings_fit(host)
    release = release_fit(host, matrix)
    facts = host.facts.model_dump()
    plan = kernel_plan(recipe, facts, host.distribution, host.codename, matrix)
    fit = host_fit(recipe, facts, gpus_required=host.gpus,
                   kernel_plan_needed=plan.needed, matrix=matrix)
    packages = packages_fit(host, locked, plan.needed) if locked is not None and release.fits else None
    settings_reasons = [] if settings.fits else [settings.reason]
    reasons = [release.reason] if not release.fits else \
        fit.reasons + ([plan.refused] if plan.refused else []) + ([packages.reason] if packages and not packages.fits
                                                                  else [])
    return fit.model_copy(update={"fits": not (settings_reasons or not release.fits or not fit.fits or plan.refused
                                               or (packages is not None and not packages.fits)),
                                  "reasons": settings_reasons + reasons, "settings": settings, "release": release,
                                  "kernel_plan": plan, "packages": packages})
