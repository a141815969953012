"""The decode rate's upper bound from memory bandwidth, and each measured rate as a fraction of it.

One decode step reads the target's weights once and the KV cache of the whole context once; it yields the mean
acceptance length in tokens (1 + accepted drafts per step; 1 without speculation). So

    bound tok/s = bandwidth / (weight bytes + KV bytes per context token x context tokens) x mean acceptance length

per memory domain: each card reads its own shard from its own memory in parallel (weights and KV heads split
across the tensor-parallel group), while CPU ranks share the one memory of the host. Left out, each of which only
raises the bound: the drafter's weights and its own KV cache, activations, the input embedding table (one row of
it is read per token, unless it is tied to the output head), replicated tensors, and the state of linear-attention
layers. The bound is a ceiling the engine cannot pass, not a rate it should reach.

Bandwidth: a B70's from docs/facts.md for xpu recipes; for cpu recipes the serving machine's, measured there by a
copy (b70host/roofline_inputs.py). An input that is missing leaves the bound "not measured", saying why.
"""

from __future__ import annotations

import statistics

from b70ctl.recipes.model import Recipe
from b70ctl.report.model import (
    Environment,
    Report,
    Roofline,
    RooflineInput,
    TargetShape,
    WorkloadResult,
    WorkloadRoofline,
)
from b70ctl.report.stats import median

B70_BANDWIDTH_BYTES_PER_S = 608e9
B70_BANDWIDTH_SOURCE = 'Arc Pro B70: about 608 GB/s per card (docs/facts.md, "Hardware")'
B70_MODEL_NAME = "B70"

# Bytes of one KV-cache element by the dtype vLLM stores it in (--kv-cache-dtype, else the served dtype).
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1, "fp8_ds_mla": 1, "fp8_inc": 1, "int8": 1}


def bandwidth_input(recipe: Recipe, environment: Environment) -> RooflineInput:
    """Bytes per second one memory domain delivers, and where that figure comes from."""
    if recipe.host.accelerator == "cpu":
        measured = environment.memory_bandwidth
        if measured is None:
            return RooflineInput(value=None, unit="bytes/s", source=(
                "not measured: " + (environment.memory_bandwidth_unavailable or
                                    "the serving machine's memory bandwidth was not recorded (the appliance's "
                                    "replication_check measures it on the host; `b70ctl verify --model-dir` when "
                                    "the server runs on the machine verify runs on)")))
        return RooflineInput(value=measured.bytes_per_s, unit="bytes/s",
                             source=f"measured on the serving machine: {measured.method}")
    gpu_model = environment.gpu_model
    if gpu_model and B70_MODEL_NAME not in gpu_model:
        return RooflineInput(value=None, unit="bytes/s", source=(
            f"not measured: the host's GPUs are {gpu_model}, and docs/facts.md gives the bandwidth of the B70 only"))
    where = "" if gpu_model else "; the host's GPUs were not recorded, the recipe's card is assumed"
    return RooflineInput(value=B70_BANDWIDTH_BYTES_PER_S, unit="bytes/s", source=B70_BANDWIDTH_SOURCE + where)


def memory_domains(recipe: Recipe) -> int:
    """Memories read in parallel by one step: each card's own on GPUs, the host's one memory on a CPU."""
    return recipe.serve.tensor_parallel_size if recipe.host.accelerator == "xpu" else 1


def _shape_missing(environment: Environment) -> str:
    return "not measured: " + (environment.target_shape_unavailable or
                               "the served target's files were not read (no target_shape in the host facts; "
                               "`b70ctl verify --model-dir` reads them when the server runs on this machine)")


def weight_input(environment: Environment, domains: int) -> RooflineInput:
    shape = environment.target_shape
    if shape is None:
        return RooflineInput(value=None, unit="bytes", source=_shape_missing(environment))
    read = shape.weight_bytes - (0 if shape.tie_word_embeddings else shape.embedding_bytes)
    apart = ("" if shape.tie_word_embeddings or not shape.embedding_bytes else
             f", less the input embedding table ({shape.embedding_bytes:,} bytes: one row is read per token)")
    split = f", over {domains} cards" if domains > 1 else ""
    return RooflineInput(value=read / domains, unit="bytes", source=(
        f"{shape.weight_bytes:,} bytes of weight tensors in {shape.weight_files} safetensors file(s) of "
        f"{shape.directory}{apart}{split}"))


def kv_element_bytes(recipe: Recipe, shape: TargetShape) -> tuple[int | None, str]:
    """Bytes of one KV-cache element and the setting it follows: --kv-cache-dtype, else --dtype, else the
    checkpoint's dtype."""
    for setting, value in (("kv_cache_dtype", recipe.serve.kv_cache_dtype), ("dtype", recipe.serve.dtype),
                           ("config.json dtype", shape.dtype)):
        if value and value != "auto":
            size = DTYPE_BYTES.get(value.removeprefix("torch.").lower())
            return size, f"{setting} {value}"
    return None, "no dtype known"


def kv_input(recipe: Recipe, report: Report, domains: int) -> RooflineInput:
    """KV-cache bytes one context token adds in the full-attention layers, per memory domain."""
    shape = report.environment.target_shape
    if shape is None:
        return RooflineInput(value=None, unit="bytes/token", source=_shape_missing(report.environment))
    element, dtype_source = kv_element_bytes(recipe, shape)
    if element is None:
        return RooflineInput(value=None, unit="bytes/token",
                             source=f"not measured: the KV-cache dtype's size is unknown ({dtype_source})")
    # vLLM splits the KV heads across the TP group and replicates them when there are fewer heads than ranks.
    heads = max(1, shape.num_key_value_heads // domains)
    per_layer = 2 * heads * shape.head_dim * element
    return RooflineInput(value=float(per_layer * shape.full_attention_layers), unit="bytes/token", source=(
        f"K and V: 2 x {heads} KV head(s){' per card' if domains > 1 else ''} x head_dim {shape.head_dim} x "
        f"{element} byte(s) ({dtype_source}) x {shape.full_attention_layers} full-attention layer(s) "
        f"(config.json)"))


def sliding_kv_bytes(recipe: Recipe, shape: TargetShape | None, domains: int, context: float) -> float:
    """KV bytes the sliding-window layers read in one step: their window, not the whole context."""
    if shape is None or not shape.sliding_attention_layers or not shape.sliding_window:
        return 0.0
    element, _ = kv_element_bytes(recipe, shape)
    heads = max(1, shape.num_key_value_heads // domains)
    return (2 * heads * shape.head_dim * (element or 0) * shape.sliding_attention_layers
            * min(context, shape.sliding_window))


def mean_context_tokens(result: WorkloadResult) -> float | None:
    """The context a decode step of this workload reads on average: each request's prompt plus half its output."""
    contexts = []
    for sample in result.requests:
        prompt = sample.prompt_tokens if sample.prompt_tokens is not None else (
            sample.engine.prompt_tokens if sample.engine is not None else None)
        if prompt is not None:
            contexts.append(prompt + sample.completion_tokens / 2)
    return statistics.fmean(contexts) if contexts else None


def decode_bound(bandwidth_bytes_per_s: float, bytes_per_step: float, acceptance: float) -> float:
    """The module's formula: steps per second the memory allows, times the tokens each step yields."""
    return bandwidth_bytes_per_s / bytes_per_step * acceptance


def workload_roofline(result: WorkloadResult, recipe: Recipe, shape: TargetShape | None, domains: int,
                      bandwidth: RooflineInput, weights: RooflineInput, kv: RooflineInput) -> WorkloadRoofline:
    measured = result.decode_tok_s.median if result.decode_tok_s and result.timing_source == "engine" else None
    spec = result.spec_decode
    if recipe.serve.speculative is None:
        acceptance: float | None = 1.0
    else:
        acceptance = spec.mean_acceptance_length if spec is not None and not spec.polluted else None
    context = mean_context_tokens(result)
    figures = WorkloadRoofline(workload=result.name, mean_context_tokens=context, mean_acceptance_length=acceptance,
                               measured_tok_s=measured)
    missing = [reason for reason, absent in (
        (bandwidth.source, bandwidth.value is None), (weights.source, weights.value is None),
        (kv.source, kv.value is None),
        ("no prompt token count (the context length is unknown)", context is None),
        ("no mean acceptance length (" + (spec.pollution_reason or "counters polluted" if spec is not None
                                          else result.metrics_error or "no spec-decode counters") + ")",
         acceptance is None)) if absent]
    if missing:
        reasons = dict.fromkeys(reason.removeprefix("not measured: ") for reason in missing)
        return figures.model_copy(update={"not_measured": "; ".join(reasons)})
    assert bandwidth.value and weights.value is not None and kv.value is not None and context and acceptance
    figures.kv_bytes_per_step = kv.value * context + sliding_kv_bytes(recipe, shape, domains, context)
    figures.bytes_per_step = weights.value + figures.kv_bytes_per_step
    if figures.bytes_per_step <= 0:
        return figures.model_copy(update={"not_measured": "no bytes read per step: the target has no weights"})
    figures.bound_tok_s = decode_bound(bandwidth.value, figures.bytes_per_step, acceptance)
    if measured is None:
        figures.not_measured = ("no decode rate on the engine's clock (" +
                                (result.timing_note or result.error or "no timed request") + ")")
    else:
        figures.efficiency = measured / figures.bound_tok_s
    return figures


def compute_roofline(report: Report, recipe: Recipe) -> Roofline:
    """The bound and the efficiency of every workload the speculative server served (the target-only baseline's
    workloads are another server: left out)."""
    domains = memory_domains(recipe)
    shape = report.environment.target_shape
    bandwidth = bandwidth_input(recipe, report.environment)
    weights, kv = weight_input(report.environment, domains), kv_input(recipe, report, domains)
    served_by_baseline = {workload.name for workload in recipe.workloads if workload.server == "baseline"}
    workloads = [workload_roofline(result, recipe, shape, domains, bandwidth, weights, kv)
                 for result in (report.throughput.workloads if report.throughput else [])
                 if result.name not in served_by_baseline]
    efficiencies = [w.efficiency for w in workloads if w.efficiency is not None]
    not_measured = None
    if not efficiencies:
        not_measured = next((w.not_measured for w in workloads if w.not_measured),
                            "no throughput workload was measured")
    return Roofline(memory="host" if recipe.host.accelerator == "cpu" else "card", memory_domains=domains,
                    bandwidth_bytes_per_s=bandwidth, weight_bytes=weights,
                    kv_bytes_per_token=kv, workloads=workloads,
                    efficiency=median(efficiencies) if efficiencies else None, not_measured=not_measured)


def weights_bound(bandwidth: RooflineInput, weights: RooflineInput, acceptance: float | None) -> float | None:
    """The bound with the KV cache's reads left out (each step still reads the weights once): higher than the
    per-workload bound, which also counts the context, so still a ceiling. None when an input is missing."""
    if bandwidth.value is None or not weights.value or acceptance is None:
        return None
    return decode_bound(bandwidth.value, weights.value, acceptance)
