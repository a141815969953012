"""Per-card VRAM, host RAM and GPU count of a recipe on a host, as pure functions over the Recipe and the facts
(host/fit.py puts them together with the kernel, the disk and the firmware).

Per card, with tensor parallelism splitting the target and every card holding the whole drafter:

    VRAM x gpu_memory_utilization  >=  target weights / TP + drafter weights + runtime reserve + KV cache budget

vLLM hands whatever is left after weights and profiling to the KV cache; when that is below what the served
context needs it refuses to start, so the budget is checked before a multi-GB download.

Host RAM: recipes state the RAM a host must have installed in GB as memory is sold (a "64 GB" host has 64 GiB of
DIMMs: memory vendors count 1 GB = 2^30 bytes, JEDEC). /proc/meminfo's MemTotal is always less than that: the
kernel's page array (one 64-byte struct page per 4 KiB page, 1/64 of memory) and what firmware, the kernel image
and a crash kernel reserve are never counted, so a 64 GB host shows about 62.6 GiB. A host meets an N GB minimum
when MemTotal is at least what an N GB host shows: N GiB less the page array less RESERVED_FRACTION_MAX.
"""

from __future__ import annotations

from typing import Any

from b70ctl.documents import Pinned
from b70ctl.recipes.model import Recipe
from b70ctl.versions import version_at_least

GIB = 1024 ** 3
# vLLM's default when a recipe leaves gpu_memory_utilization unset.
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Activations, sampler and collective buffers outside weights and KV cache during profiling (an estimate: the
# measured peak on B70 is not published; it keeps 1 GiB per card free for them).
RUNTIME_RESERVE_GIB = 1.0
# Smallest KV cache worth serving with: below about 1 GiB a 27B hybrid model holds only a few thousand tokens.
KV_CACHE_GIB_MIN = 1.0
# x86-64: one 64-byte struct page per 4 KiB page, allocated before the kernel counts MemTotal.
MEMMAP_FRACTION = 64 / 4096
# Firmware reservations (ACPI, the memory below 1 MiB, holes around the PCI window), the kernel image and a crash
# kernel (Ubuntu's kdump-tools reserve 512 MiB-1 GiB on 4-64 GiB hosts, 2 GiB above): at most 5% of installed RAM.
RESERVED_FRACTION_MAX = 0.05
# First compute-runtime release that mirrors device allocations in host RAM with a peer GPU visible.
PEER_MIRROR_FROM = "26.09"


class Fit(Pinned):
    fits: bool
    reason: str


class CardFit(Fit):
    vram_gib_per_gpu: float | None
    vram_source: str
    gpu_memory_utilization: float
    usable_vram_gib: float
    target_weights_gib_per_gpu: float
    drafter_weights_gib: float
    runtime_reserve_gib: float
    kv_cache_gib_available: float
    kv_cache_gib_required: float


class RamFit(Fit):
    ram_gib: float | None = None  # MemTotal in GiB
    peer_mirror_gib: float = 0.0  # host RAM compute-runtime 26.09+ pins to mirror device memory (see ram_fit)
    compute_runtime: str | None = None  # the image's UMD the mirror is reckoned for
    ram_gb_min: float  # installed RAM the recipe needs, GB as sold
    memtotal_gib_min: float  # the least MemTotal a host with ram_gb_min installed shows
    ram_gb_min_source: str


class GpuCountFit(Fit):
    accepted_pci_ids: list[str]
    usable_gpu_count: int
    gpu_count_required: int


def kv_cache_gib(tokens: int, attention_layers: int, kv_heads: int, head_dim: int, bytes_per_element: float) -> float:
    """KV cache for `tokens` tokens of full-attention layers (K and V each kv_heads x head_dim per layer).
    Linear-attention (GDN) layers keep a fixed-size state instead and are not counted here."""
    return tokens * attention_layers * 2 * kv_heads * head_dim * bytes_per_element / GIB


def card_fit(recipe: Recipe, vram_gib_per_gpu: float | None, vram_source: str = "recipe",
             kv_cache_gib_required: float = KV_CACHE_GIB_MIN) -> CardFit:
    """The per-card budget of a recipe on cards of `vram_gib_per_gpu` (None: the recipe's own figure)."""
    serve = recipe.serve
    utilization = serve.gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    target_per_gpu = recipe.target.weights_gib / serve.tensor_parallel_size
    drafter = recipe.drafter.weights_gib if recipe.drafter is not None else 0.0
    if recipe.host.accelerator == "cpu":
        return CardFit(fits=True, reason="CPU recipe: no GPU memory to budget", vram_gib_per_gpu=None,
                       vram_source="none", gpu_memory_utilization=utilization, usable_vram_gib=0.0,
                       target_weights_gib_per_gpu=target_per_gpu, drafter_weights_gib=drafter,
                       runtime_reserve_gib=0.0, kv_cache_gib_available=0.0, kv_cache_gib_required=0.0)
    if vram_gib_per_gpu is None:
        vram_gib_per_gpu, vram_source = recipe.host.vram_gib_per_gpu, "recipe"
    usable = vram_gib_per_gpu * utilization
    available = usable - target_per_gpu - drafter - RUNTIME_RESERVE_GIB
    fits = available >= kv_cache_gib_required
    budget = (f"{vram_gib_per_gpu:.1f} GiB x {utilization:.2f} = {usable:.1f} GiB per card; target "
              f"{recipe.target.weights_gib:.1f} GiB / TP {serve.tensor_parallel_size} = {target_per_gpu:.1f} GiB, "
              f"drafter {drafter:.1f} GiB, reserve {RUNTIME_RESERVE_GIB:.1f} GiB leave {available:.1f} GiB for the "
              f"KV cache (need {kv_cache_gib_required:.1f} GiB)")
    if fits:
        reason = budget
    else:
        reason = (f"does not fit: {budget}: raise tensor_parallel_size, quantize the target, or raise "
                  f"gpu_memory_utilization")
    return CardFit(fits=fits, reason=reason, vram_gib_per_gpu=vram_gib_per_gpu, vram_source=vram_source,
                   gpu_memory_utilization=utilization, usable_vram_gib=usable,
                   target_weights_gib_per_gpu=target_per_gpu,
                   drafter_weights_gib=drafter, runtime_reserve_gib=RUNTIME_RESERVE_GIB,
                   kv_cache_gib_available=available, kv_cache_gib_required=kv_cache_gib_required)


def memtotal_gib_min(installed_gb: float) -> float:
    """The least MemTotal (GiB) a host with `installed_gb` GB of RAM (as sold, 2^30 bytes each) shows."""
    return installed_gb * (1 - MEMMAP_FRACTION - RESERVED_FRACTION_MAX)


def peer_mirror_gib(recipe: Recipe, device_gib_per_gpu: float, visible_gpus: int) -> float:
    """Host RAM compute-runtime 26.09+ pins when a peer GPU is visible: a host-RAM mirror of every large device
    allocation, ~1 GiB per GiB of device memory with ZE_AFFINITY_MASK=0,1 and none with one GPU visible
    (intel/compute-runtime #953, #986, #968; intel/torch-xpu-ops #5428; intel/llm-scaler #618 with 26.14 at TP=2).
    vLLM fills each card to gpu_memory_utilization, so that much per visible card is mirrored; the server sees
    the TP ranks' GPUs (`visible_gpus`: the host's usable ones, at most TP), unless each worker sees only its own
    card (serve.worker_card_visibility: own)."""
    umd = recipe.image.compute_runtime
    if recipe.serve.worker_card_visibility == "own":
        visible_gpus = 1
    if recipe.host.accelerator != "xpu" or visible_gpus < 2 or umd is None:
        return 0.0
    if not version_at_least(umd, PEER_MIRROR_FROM):
        return 0.0
    return device_gib_per_gpu * visible_gpus


def ram_fit(recipe: Recipe, ram_total_bytes: int | None, mirror_gib: float = 0.0) -> RamFit:
    """MemTotal (bytes) against the recipe's installed-RAM minimum, converted to what such a host shows, plus the
    peer mirror (`mirror_gib`, peer_mirror_gib) the image's compute runtime pins."""
    minimum_gb = recipe.host.ram_gb_min
    floor_gib = memtotal_gib_min(minimum_gb) + mirror_gib
    common = dict(ram_gb_min=minimum_gb, memtotal_gib_min=floor_gib, ram_gb_min_source=recipe.host.ram_gb_min_source,
                  peer_mirror_gib=mirror_gib, compute_runtime=recipe.image.compute_runtime)
    if ram_total_bytes is None:
        return RamFit(fits=False, reason="host RAM unknown (/proc/meminfo unreadable)", ram_gib=None, **common)
    ram_gib = ram_total_bytes / GIB
    shown = f"host RAM: MemTotal {ram_gib:.1f} GiB"
    base = f": {floor_gib - mirror_gib:.1f} GiB, " if mirror_gib else ", "
    needed = (f"{floor_gib:.1f} GiB{base}the least MemTotal of a host with {minimum_gb:g} GB installed (RAM is sold "
              f"in GB of 2^30 bytes; the kernel and firmware keep up to "
              f"{(MEMMAP_FRACTION + RESERVED_FRACTION_MAX):.1%})")
    if mirror_gib:
        needed += (f" plus {mirror_gib:.1f} GiB that compute-runtime {recipe.image.compute_runtime} pins to mirror "
                   f"the device memory of GPUs that see a peer (measured: ~1 GiB per GiB of device memory, "
                   "intel/compute-runtime #986; 55 GiB for a 2-GPU inference server, #968; 26.09+, also #953, "
                   "intel/torch-xpu-ops #5428, intel/llm-scaler #618; Intel recommends 26.05 until fixed; the "
                   "checkpoint's page cache is reclaimable and not counted)")
    if (recipe.serve.worker_card_visibility == "own" and recipe.serve.tensor_parallel_size > 1
            and recipe.image.compute_runtime and version_at_least(recipe.image.compute_runtime, PEER_MIRROR_FROM)):
        needed += (f" (no peer mirror for compute-runtime {recipe.image.compute_runtime}: each worker sees its own "
                   "card only, serve.worker_card_visibility: own)")
    if ram_gib >= floor_gib:
        return RamFit(fits=True, reason=f"{shown} >= {needed}", ram_gib=ram_gib, **common)
    ways_out = "add RAM or choose a smaller recipe"
    if mirror_gib:
        ways_out = ("add RAM, give each worker its own card (serve.worker_card_visibility: own, route a), run an "
                    "image with compute-runtime 26.05 or choose a smaller recipe")
    return RamFit(fits=False, ram_gib=ram_gib, **common,
                  reason=f"{shown} < {needed}: recipe {recipe.name} needs {minimum_gb:g} GB of RAM installed "
                         f"({recipe.host.ram_gb_min_source}){' and the mirror' if mirror_gib else ''}: {ways_out}")


def usable_gpus(recipe: Recipe, facts: dict[str, Any]) -> list[dict[str, Any]]:
    """The host's GPUs this recipe can use: bound to xe and of an accepted PCI id."""
    accepted = {pci_id.lower() for pci_id in recipe.host.gpu_pci_ids}
    return [gpu for gpu in facts.get("gpus", []) if gpu.get("xe_bound")
            and (not accepted or (gpu.get("pci_id") or "").lower() in accepted)]


def gpu_count_fit(recipe: Recipe, facts: dict[str, Any], required: int | None = None,
                  binding_pending: bool = False) -> GpuCountFit:
    """Enough GPUs of the recipe's ids bound to xe: the recipe's count, or `required` (the inventory's b70_gpus),
    which may not be fewer than the recipe's tensor-parallel size and GPU count.
    `binding_pending`: the kernel plan installs the kernel that binds them, so the cards are counted bound or not."""
    if recipe.host.accelerator != "xpu":
        required = 0
    elif required is None:
        required = recipe.host.gpu_count
    accepted_ids = {pci_id.lower() for pci_id in recipe.host.gpu_pci_ids}
    usable = (usable_gpus(recipe, facts) if not binding_pending else
              [gpu for gpu in facts.get("gpus", [])
               if not accepted_ids or (gpu.get("pci_id") or "").lower() in accepted_ids])
    accepted = list(recipe.host.gpu_pci_ids)
    tensor_parallel, recipe_gpus = recipe.serve.tensor_parallel_size, recipe.host.gpu_count
    if recipe.host.accelerator == "xpu" and required < max(tensor_parallel, recipe_gpus):
        reason = (f"recipe {recipe.name} runs tensor-parallel {tensor_parallel} on {recipe_gpus} GPU(s), but b70_gpus "
                  f"is {required}: set b70_gpus: {recipe_gpus} on a host with that many cards, or choose a recipe "
                  f"for {required} GPU(s) (b70ctl recipes list)")
        return GpuCountFit(fits=False, reason=reason, accepted_pci_ids=accepted, usable_gpu_count=len(usable),
                           gpu_count_required=required)
    if len(usable) >= required:
        reason = f"{len(usable)} usable GPU(s) of {', '.join(accepted) or 'any id'}, {required} required"
        return GpuCountFit(fits=True, reason=reason, accepted_pci_ids=accepted, usable_gpu_count=len(usable),
                           gpu_count_required=required)
    found = ", ".join(f"{gpu['model']} {gpu['pci_id']} {gpu['pci_address']} driver {gpu['driver'] or 'none'}"
                      for gpu in facts.get("gpus", [])) or "no Intel discrete GPU"
    reason = (f"recipe {recipe.name} needs {required} GPU(s) of {', '.join(accepted)} bound to xe, host has "
              f"{len(usable)} ({found}): fix the driver binding or choose a recipe for this hardware")
    return GpuCountFit(fits=False, reason=reason, accepted_pci_ids=accepted, usable_gpu_count=len(usable),
                       gpu_count_required=required)


def host_vram_gib(gpus: list[dict[str, Any]]) -> tuple[float | None, str]:
    """Smallest card's VRAM: the xe-reported physical size when visible, else the model's nominal size."""
    sizes = [(gpu["vram_bytes"] / GIB, "sysfs") if gpu.get("vram_bytes") else (gpu.get("vram_gib_nominal"), "model")
             for gpu in gpus]
    known = [(size, source) for size, source in sizes if size is not None]
    if not known:
        return None, "recipe"
    return min(known)
