"""The replication report of one endpoint (report.json): one pydantic model, schema versioned.

Everything `b70ctl verify` measures lands here, next to the raw data's file names (DIR/raw/), so a verdict can
be audited. The fleet report reads these; older schema versions are upgraded by `upgrade_report_json`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, Literal

from pydantic import Field

from b70ctl.documents import Document as Model

REPORT_SCHEMA_VERSION: Final = 4

Verdict = Literal["met", "not_met", "not_measured"]


class SubCheck(Model):
    """One pass/fail item with the reason it failed (None when it passed)."""

    name: str
    passed: bool
    reason: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class SmokeResult(Model):
    passed: bool
    checks: list[SubCheck]


class PromptComparison(Model):
    """Greedy output of one prompt against the target-only baseline, compared token id by token id."""

    prompt: str
    identical: bool
    tokens_compared: int
    first_divergence: int | None = Field(None, description="Index of the first differing token id, if any")
    expected_context: str | None = Field(None, description="Baseline text around the divergence")
    actual_context: str | None = Field(None, description="Served text around the divergence")
    expected_token_ids: list[int] = Field(default_factory=list)
    actual_token_ids: list[int] = Field(default_factory=list)


class GarbageFinding(Model):
    """An output that says the server is serving garbage: empty, degenerate repetition, or a failed probe."""

    prompt: str
    kind: Literal["empty", "degenerate_repetition", "probe_failed"]
    detail: str


class CorrectnessResult(Model):
    passed: bool
    baseline: str = Field(description="Baseline endpoint URL or reference file it was compared with")
    identical: int
    total: int
    identical_fraction: float
    comparisons: list[PromptComparison]
    garbage: list[GarbageFinding] = Field(default_factory=list)
    reason: str | None = None


class Difference(Model):
    """Where two greedy answers to one prompt part: the first differing position and the token on each side."""

    prompt: str = Field(description="The prompt, or what it was when it is too long to show")
    position: int = Field(description="Index of the first differing generated token")
    expected_token: int | None = Field(description="The earlier (cold) answer's token; None: it ended there")
    got_token: int | None = Field(description="The later answer's token; None: it ended there")
    expected_text: str | None = Field(None, description="The earlier answer around the position, the token in [[ ]] "
                                                        "(None: the server has no /detokenize)")
    got_text: str | None = Field(None, description="The later answer around the position")


class GateCheck(Model):
    """One check of the gate against silent garbage. passed None: not run, `detail` says why."""

    name: str
    passed: bool | None
    detail: str
    first_difference: Difference | None = None


class GateAnswer(Model):
    """One prompt's greedy answer as a serve gave it."""

    name: str = Field(description="Which check asked it, e.g. repetition-0, prefix-cache, canary")
    prompt: str | list[int] = Field(description="The prompt as sent: text, or token ids")
    max_tokens: int = Field(ge=1)
    token_ids: list[int]
    text: str = ""


class GateAnswers(Model):
    """The cold greedy answers of one serve (raw/gate/answers.json): a caller that serves the same recipe again
    compares the next serve's answers with them (checks/gate.py compare_after_restart)."""

    schema_version: Literal[1] = 1
    recipe: str
    served_model: str
    nonce: str = Field(description="What made this run's long prompt new to the cache; a replay reuses it")
    recorded_at: datetime
    answers: list[GateAnswer]


class GateResult(Model):
    """The gate against silent garbage: identity across repetitions, the prefix cache and restarts, a code canary
    and no run of one token. Any check that ran and failed fails the gate."""

    passed: bool
    checks: list[GateCheck]
    answers: GateAnswers | None = Field(None, exclude=True, description="This run's cold answers, for a caller to "
                                                                        "keep (also in raw/gate/answers.json)")


class Summary(Model):
    """Robust summary of one figure across requests. ci_* is a distribution-free confidence interval for the
    median (order statistics of the binomial), at `confidence`."""

    n: int
    median: float
    min: float
    max: float
    mad: float
    ci_low: float
    ci_high: float
    confidence: float = 0.95


class EngineTiming(Model):
    """One request as the engine timed it: deltas of vLLM's per-request histograms around it (checks/metrics.py)."""

    decode_time_s: float = Field(description="First to last token on the engine's clock")
    generation_tokens: int
    prefill_time_s: float | None = None
    ttft_s: float | None = Field(None, description="Arrival at the engine to the first token")
    queue_time_s: float | None = None
    prompt_tokens: int | None = None
    prompt_tokens_cached: int | None = Field(None, description="Prompt tokens the engine did not compute")
    decode_steps: int | None = Field(None, description="Engine steps after the first token (one ITL observation "
                                                       "each; a step can emit several tokens)")

    @property
    def decode_tok_s(self) -> float | None:
        if self.generation_tokens < 2 or self.decode_time_s <= 0:
            return None
        return (self.generation_tokens - 1) / self.decode_time_s


Delivery = Literal["ok", "distorted", "unchecked"]
TimingSource = Literal["engine", "client"]


class RequestSample(Model):
    """One measured request. The unprefixed figures are the engine's when the server exposes per-request timing
    (`timing_source`), the client's otherwise; `client_*` is what arrived over the network, kept beside them.
    Token counts come from the token ids in the stream; usage is the cross-check."""

    timing_source: TimingSource = "client"
    decode_tok_s: float | None
    peak_tok_s: float | None = Field(description="Most tokens in a 1 s window of the arrivals (a stream shorter "
                                                 "than 1 s: its tokens over its duration); None when delivery "
                                                 "was distorted")
    ttft_s: float
    prefill_tok_s: float | None = None
    completion_tokens: int
    usage_completion_tokens: int | None
    prompt_tokens: int | None
    chunks: int
    raw_file: str | None = Field(None, description="Per-chunk arrival times and token ids, under raw/")
    engine: EngineTiming | None = None
    engine_unavailable: str | None = Field(None, description="Why the engine's timing is missing")
    client_decode_tok_s: float | None = None
    client_peak_tok_s: float | None = None
    client_ttft_s: float | None = None
    delivery: Delivery = "unchecked"
    delivery_reason: str | None = None
    prompt_tokens_cached: int | None = None


class Percentiles(Model):
    """Latency percentiles over every token of a workload (not every chunk)."""

    n: int
    median_ms: float
    p90_ms: float
    p99_ms: float


class BenchKeys(Model):
    """The keys `vllm bench serve --save-result` writes, for the users who compare with it (acceptance rate in
    percent, as vLLM's benchmark writes it). Times from the engine when it timed the requests."""

    median_ttft_ms: float | None = None
    median_tpot_ms: float | None = None
    median_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    spec_decode_acceptance_rate: float | None = None
    spec_decode_acceptance_length: float | None = None
    spec_decode_num_drafts: int | None = None
    spec_decode_draft_tokens: int | None = None
    spec_decode_accepted_tokens: int | None = None
    spec_decode_per_position_acceptance_rates: list[float] = Field(default_factory=list)


class SpecDecodeStats(Model):
    """From deltas of vLLM's counters around this workload's requests (docs/facts.md, Measuring)."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position_acceptance: list[float]
    generation_tokens: float | None = None
    polluted: bool = False
    pollution_reason: str | None = None


class WorkloadResult(Model):
    name: str
    description: str
    temperature: float
    max_tokens: int
    prompt_tokens: int | None = None
    requests: list[RequestSample]
    decode_tok_s: Summary | None
    peak_tok_s: Summary | None
    ttft_s: Summary | None
    prefill_tok_s: Summary | None = None
    converged: bool = Field(description="Median's CI reached the target half-width before the request cap")
    token_count_mismatches: int = Field(0, description="Requests whose token-id count differs from usage")
    spec_decode: SpecDecodeStats | None = None
    metrics_error: str | None = Field(None, description="Why /metrics could not give the spec-decode figures")
    error: str | None = None
    timing_source: TimingSource | Literal["mixed"] = "client"
    timing_note: str | None = Field(None, description="Why some or all figures are the client's")
    client_decode_tok_s: Summary | None = None
    distorted_requests: int = Field(0, description="Requests whose arrival disagreed with the engine's timing")
    itl_ms: Percentiles | None = Field(None, description="Client: each chunk gap spread over its tokens")
    engine_tpot_ms: Percentiles | None = Field(None, description="Engine: decode time over tokens after the first")
    prompt_tokens_cached: int | None = Field(None, description="Cached prompt tokens of the measured requests")
    bench: BenchKeys = Field(default_factory=BenchKeys)

    @property
    def peak(self) -> float | None:
        """The peak a user pastes, one definition for every table: the best request's most tokens in a 1 s window.
        It is what the recipes' peak claims read (`throughput.<workload>.peak_tok_s.max`: PR #620's 85.9 is its
        best run's peak) and llama-benchy's peak over a run; the median of the per-request peaks stays in the
        workload's own distribution table."""
        return self.peak_tok_s.max if self.peak_tok_s else None


# The column that shows WorkloadResult.peak, named so wherever a table has one.
PEAK_LABEL = "peak tok/s, best request"


class ThroughputResult(Model):
    passed: bool
    workloads: list[WorkloadResult]
    max_requests: int | None = Field(
        None, description="At most this many requests per workload (verify --max-requests): a quick check, not the "
                          "recipe's sample size")


class ClaimVerdict(Model):
    claim_id: str
    description: str
    metric: str
    verdict: Verdict
    measured: float | list[float] | None
    bound: str = Field(description="What was required, tolerance included, as text")
    source: str
    url: str | None = Field(None, description="Where the claim was published")
    reason: str | None = None


class DiagnosedFailure(Model):
    """A known failure the report's own findings match (b70ctl diagnose's catalogue), with its fix."""

    id: str
    title: str
    fix: str
    evidence: list[str] = Field(default_factory=list, description="The findings that matched")


class MemoryBandwidth(Model):
    """The serving machine's memory bandwidth as a copy measured it there (b70host/roofline_inputs.py)."""

    bytes_per_s: float = Field(gt=0)
    method: str
    buffer_bytes: int = Field(gt=0)
    repeats: int = Field(ge=1)


class TargetShape(Model):
    """The served target as its files on the serving host say (b70host/roofline_inputs.py): the bytes of its weight
    tensors and what the KV cache's size per token follows from (config.json, transformers' Qwen3Config names)."""

    directory: str
    weight_files: int = Field(ge=1)
    weight_bytes: int = Field(ge=0, description="Every weight tensor, from the safetensors headers")
    embedding_bytes: int = Field(0, ge=0, description="The input embedding table among them")
    tie_word_embeddings: bool = False
    num_hidden_layers: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    dtype: str | None = None
    full_attention_layers: int = Field(ge=0)
    sliding_attention_layers: int = Field(0, ge=0)
    sliding_window: int | None = None


class RooflineInputs(Model):
    """roofline_inputs.json: what b70host/roofline_inputs.py printed on the serving host, each input or why it is
    missing; `b70ctl verify --roofline-inputs` records it in the report's environment."""

    memory_bandwidth: MemoryBandwidth | None = None
    memory_bandwidth_unavailable: str | None = None
    target_shape: TargetShape | None = None
    target_shape_unavailable: str | None = None


class Environment(Model):
    """What was served and where. Filled from the endpoint itself, and from host facts when verify is given
    them (the appliance passes --host-facts); every field is optional because a bare endpoint tells little."""

    served_model: str | None = None
    vllm_version: str | None = None
    hostname: str | None = None
    appliance_hash: str | None = None
    image_digest: str | None = None
    model_revision: str | None = None
    drafter_revision: str | None = None
    kernel: str | None = None
    xe_guc_firmware: str | None = None
    xe_huc_firmware: str | None = None
    compute_runtime: str | None = None
    gpu_count: int | None = None
    gpu_model: str | None = None
    p2p_profile: str | None = None
    p2p_profile_reason: str | None = Field(
        None, description="Why that oneCCL profile (topology.json profile_reason; a serve-gate fallback says so)")
    served_speculative_positions: int | None = Field(None, description="k as the server's /metrics shows it")
    serve_command: str | None = Field(None, description="The host's rendered vLLM command line, when known")
    serve_exec_start: str | None = Field(None, description="The serving unit's ExecStart= value, as the unit holds it")
    serve_prefix_caching: str | None = Field(
        None, description="Why the render turned prefix caching on or off (serve.json prefix_caching), when it did")
    rehearsal: list[str] | None = Field(None, description="A rehearsal's overlay (serve/rehearsal.yaml): what it "
                                        "served differently from a B70 host; absent on a real host")
    hardware_root: str | None = Field(
        None, description="Set when the GPU facts were read under a root prefix other than /: the hardware was "
                          "emulated (a fixture's sysfs tree there), and kernel and firmware are the fixture's")
    memory_bandwidth: MemoryBandwidth | None = Field(
        None, description="Measured on the serving machine; the bandwidth of a CPU-served recipe's roofline")
    target_shape: TargetShape | None = Field(None, description="The served target's weights and KV-cache shape")
    memory_bandwidth_unavailable: str | None = Field(None, description="Why memory_bandwidth is missing")
    target_shape_unavailable: str | None = Field(None, description="Why target_shape is missing")
    extra: dict[str, Any] = Field(default_factory=dict)


# Environment fields that are not facts of the serving host: what the server says of itself (verify asks it:
# served_model, vLLM's /version, k on /metrics), the roofline's inputs (measured with each run, kept out of
# host_facts.json and the fingerprint) and the free-form rest. Every other field is a host fact: verify fills it from
# the host's facts, the fleet report from host_facts.json where a report lacks it.
NOT_HOST_FACTS = frozenset({"served_model", "served_speculative_positions", "vllm_version", "extra",
                            "memory_bandwidth", "target_shape", "memory_bandwidth_unavailable",
                            "target_shape_unavailable"})
HOST_FACT_FIELDS = tuple(name for name in Environment.model_fields if name not in NOT_HOST_FACTS)


class RooflineInput(Model):
    """One input of the roofline: its value (None: not known) and where it came from, or why it is missing."""

    value: float | None
    unit: str
    source: str


class WorkloadRoofline(Model):
    """One workload's decode rate against the memory-bandwidth bound of its decode steps."""

    workload: str
    mean_context_tokens: float | None = Field(None, description="Prompt plus half the output, over the requests")
    mean_acceptance_length: float | None = Field(None, description="Tokens per decode step (1 without drafts)")
    kv_bytes_per_step: float | None = Field(None, description="KV cache read in one step, per memory domain")
    bytes_per_step: float | None = Field(None, description="Weights plus KV cache read in one step, per domain")
    bound_tok_s: float | None = None
    measured_tok_s: float | None = Field(None, description="Median decode rate on the engine's clock")
    efficiency: float | None = Field(None, description="measured_tok_s / bound_tok_s")
    not_measured: str | None = Field(None, description="Why the bound or the efficiency is missing")


class Roofline(Model):
    """The decode rate's upper bound from memory bandwidth: each step reads the target's weights and the KV cache
    of the context once, so it cannot take less than bytes_per_step / bandwidth, and yields the mean acceptance
    length in tokens. The drafter's weights and activations are left out, which only raises the bound: it stays
    an upper bound. report/roofline.py computes it."""

    memory: Literal["card", "host"] = Field(description="Whose memory is read: each GPU card's, or the host's")
    memory_domains: int = Field(description="Memories read in parallel: one per card (TP) on GPUs, one on a CPU")
    bandwidth_bytes_per_s: RooflineInput = Field(description="Per memory domain")
    weight_bytes: RooflineInput = Field(description="Weights read per step, per memory domain")
    kv_bytes_per_token: RooflineInput = Field(description="KV cache per context token, per memory domain")
    workloads: list[WorkloadRoofline] = Field(default_factory=list)
    efficiency: float | None = Field(None, description="Median of the workloads' efficiencies")
    not_measured: str | None = Field(None, description="Why no workload has an efficiency")


class Report(Model):
    schema_version: Literal[4] = REPORT_SCHEMA_VERSION
    tool_version: str
    recipe: str
    endpoint: str
    baseline: str | None = None
    started_at: datetime
    finished_at: datetime | None = None
    partial: bool = Field(False, description="The run stopped before every check finished")
    partial_reason: str | None = None
    environment: Environment = Field(default_factory=Environment)
    smoke: SmokeResult | None = None
    correctness: CorrectnessResult | None = None
    gate: GateResult | None = Field(None, description="The gate against silent garbage (run with correctness)")
    throughput: ThroughputResult | None = None
    measurements: dict[str, float | list[float]] = Field(
        default_factory=dict, description="Flat figures claims refer to, e.g. throughput.short.decode_tok_s.median"
    )
    verdicts: list[ClaimVerdict] = Field(default_factory=list)
    diagnosis: list[DiagnosedFailure] = Field(default_factory=list, description="Known failures its findings match")
    roofline: Roofline | None = Field(None, description="Measured decode rates against the memory-bandwidth bound")
    passed: bool = False
