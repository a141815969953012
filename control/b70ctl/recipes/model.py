"""The recipe: everything one appliance is made of, as data.

A recipe names the target and drafter, the image, the serve settings, what a host must have, the workloads the
replication check runs and the published claims it must reproduce. Known-bad combinations (each one a failure
somebody hit on real B70 hosts, see docs/facts.md) are refused here, at load time, with the reason, so no later stage
has to re-check them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from b70ctl.errors import first_problem
from b70ctl.escaping import path_part_problem
from b70ctl.recipes.tiny import TinySpec
from b70ctl.recipes.vllm_lines import line_refusal
from b70ctl.versions import version_at_least

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The longest context a recipe may give a server: 2^20 tokens, 64 times the longest a recipe asks for today (16,384),
# so a typo (1e21) is refused. Every request's max_tokens, and the prompt verify synthesizes in memory, must fit in
# the recipe's own context.
MAX_MODEL_LEN_TOKENS = 2**20
# Methods that draft a whole block in one pass (parallel drafting): vLLM reserves k slots per request of a step.
PARALLEL_DRAFTING = ("dflash", "dspark")
# Methods vLLM drafts with no model of its own: ngram from the prompt and the output so far, mtp with the target's own
# multi-token-prediction layers, read from the target's checkpoint. For "mtp" without a model vLLM takes the target's:
# "use the draft model from the same model" (vllm/config/speculative.py SpeculativeConfig.__post_init__ in 0.30.0 and
# 0.32.0; vllm/v1/worker/gpu/spec_decode/mtp/config.py default_model in 0.34.0).
DRAFTER_FREE = ("ngram", "mtp")


def env_problem(name: str, value: str) -> str | None:
    """What is wrong with one environment entry, or None. One rule for serve.env, --env and tuned settings: each
    entry becomes one NAME=VALUE line of the unit's docker env-file, so a line break would add lines of its own."""
    if not ENV_NAME.fullmatch(name):
        return f"{name!r}: not an environment variable name (letters, digits, _; not first a digit): fix the name"
    if any(ord(character) < 32 or ord(character) == 127 for character in value):
        return f"{name}: the value holds a line break or control character: give one line"
    return None


def site_env_problem(name: str, value: object) -> str | None:
    """env_problem for a site's entry as YAML or JSON gives it (vllm_serve_extra_env): a string or a number (a
    YAML 8 or 0.9 is meant as text), never a boolean, an object, a list or null."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return f"{name}: {value!r} is not a string or a number: quote it"
    return env_problem(name, str(value))


class Strict(BaseModel):
    """Unknown keys are refused, and so are values of the wrong type: YAML reads `true`, `yes` and `off` as booleans,
    so `tensor_parallel_size: true` would otherwise become 1 and `max_model_len: yes` fail as "below 16"; a
    quoted '2' is a string. Numbers must be written as numbers, and finite: YAML reads `.inf` and `.nan` as floats,
    and a claim's tolerance of .inf is always met (a NaN is never ordered, so a bound of it meant nothing)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ModelSpec(Strict):
    """A model the appliance serves: downloaded from a hub at a pinned revision, or generated on the controller."""

    repo: str | None = Field(None, description="Hub repo id, e.g. Qwen/Qwen3.8-27B-FP8")
    revision: str | None = Field(None, description="Branch or tag to resolve; the lock pins the 40-hex commit")
    include: list[str] = Field(default_factory=lambda: ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])
    generated: Literal["target", "draft-exact", "draft-perturbed"] | None = Field(
        None, description="Generated on the host by b70ctl (the embedded default) instead of downloaded"
    )
    quantization: str | None = None
    weights_gib: float = Field(0.0, ge=0, description="Size of the weights in memory, for the per-card fit check")
    has_linear_attention: bool = Field(
        False, description="Target has GDN linear-attention layers (Qwen3.8): rules out adaptive verification"
    )
    needs_conversion: bool = Field(False, description="Drafter config must be converted for the pinned vLLM")
    block_size: int | None = Field(
        None, ge=1, description="Drafter: its config.json block_size (tokens drafted per pass); k above it is "
                                "refused, and convert checks the downloaded config against it")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.repo is None) == (self.generated is None):
            raise ValueError("give exactly one of repo (download) or generated (made on the host)")
        return self


class ImageBuild(Strict):
    context: str = Field(description="Directory under images/ holding the Dockerfile")
    base: str = Field(description="Base image reference; the lock pins its digest")
    patch_series: str | None = Field(None, description="Patch series file applied on top of the base's vLLM")


class ImageVariant(Strict):
    """Another image a recipe can run, named for what differs (e.g. the compute runtime inside it)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    compute_runtime: str = Field(description="Level Zero GPU driver (UMD) this variant bundles")
    why: str = Field(min_length=1, description="Why a site would choose it, and from whom the advice comes")
    buildable: bool = Field(description="Whether the appliance can build this variant today")
    not_buildable_reason: str | None = None

    @model_validator(mode="after")
    def _says_why_not(self) -> ImageVariant:
        if not self.buildable and not self.not_buildable_reason:
            raise ValueError(f"image variant {self.name!r}: say why it cannot be built (not_buildable_reason)")
        return self


class ImageSpec(Strict):
    reference: str = Field(description="Repository of the serving image, e.g. ghcr.io/rmacy/qwen38-fp8-dspark")
    compute_runtime: str | None = Field(
        None, description="Level Zero GPU driver (compute-runtime, the UMD) the image bundles: the image's, not "
                          "the host's, is the one vLLM runs")
    compute_runtime_source: str | None = Field(None, description="Where the bundled version is stated")
    variants: list[ImageVariant] = Field(default_factory=list)
    tag: str | None = Field(None, description="Informational only: images are pulled by the digest in the lock")
    source: Literal["pull", "build"] = "pull"
    build: ImageBuild | None = None

    @model_validator(mode="after")
    def _build_has_context(self) -> ImageSpec:
        if self.source == "build" and self.build is None:
            raise ValueError("source 'build' needs a build section (context, base)")
        if self.tag == "latest":
            raise ValueError("tag 'latest' is not a pin; name a release tag (the lock pins its digest)")
        return self


class SpeculativeSettings(Strict):
    method: Literal["dflash", "dspark", "draft_model", "ngram", "eagle3", "mtp"]
    num_speculative_tokens: int = Field(ge=1, le=16)
    draft_sample_method: Literal["greedy", "probabilistic"] | None = None
    enable_adaptive_verification: bool = False
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest n-gram matched")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest n-gram matched")

    @model_validator(mode="after")
    def _prompt_lookup(self) -> SpeculativeSettings:
        # vLLM reads prompt_lookup_* for ngram only, and refuses min > max (vllm/config/speculative.py at v0.32.0).
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method != "ngram" and lookup != (None, None):
            raise ValueError(f"prompt_lookup_min/max apply to method 'ngram' only, not {self.method!r}")
        if None not in lookup and lookup[0] > lookup[1]:  # type: ignore[operator]
            raise ValueError(f"prompt_lookup_min {lookup[0]} is above prompt_lookup_max {lookup[1]}: vLLM refuses it")
        return self


class ServeSettings(Strict):
    served_model_name: str
    tensor_parallel_size: int = Field(1, ge=1)
    baseline_tensor_parallel_size: int | None = Field(
        None, ge=1, description="TP of the target-only baseline the greedy outputs are compared with; "
        "None: the speculative server's")
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_model_len: int = Field(ge=16, le=MAX_MODEL_LEN_TOKENS)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    max_num_seqs: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    kv_cache_dtype: str | None = None
    mamba_ssm_cache_dtype: str | None = None
    async_scheduling: bool = False
    enforce_eager: bool = False
    trust_remote_code: bool = False
    enable_prefix_caching: bool | None = Field(
        None, description="--enable-prefix-caching or --no-enable-prefix-caching; None leaves vLLM's default (on for "
                          "hybrid models like Qwen3.8 from 0.28.1)")
    language_model_only: bool = Field(
        False, description="--language-model-only: a multimodal checkpoint's text model alone, no vision encoder "
                           "loaded or budgeted")
    speculative: SpeculativeSettings | None = None
    worker_card_visibility: Literal["all", "own"] = Field(
        "all",
        description="'own': each tensor-parallel worker starts with ZE_AFFINITY_MASK naming its own card only, so "
        "compute-runtime 26.09+ mirrors no peer device memory in host RAM (route a's patch 0006, "
        "B70_WORKER_OWN_CARD=1; run on dual B70 at TP=2 by SergiioB's intel-arc-pro-b70-inference-cookbook, "
        "patches/patch_vllm_worker_affinity.py, confirmed in its issue #8). 'all': every worker sees the group's "
        "cards, as vLLM does",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the vLLM process")
    one_token_prompt_guard: Literal["none", "float16", "disable_esimd_page_attn"] = Field(
        "none",
        description="BF16 one-token prompts crash llm-scaler's ESIMD paged-attention decode kernel (route a on "
        "XPU): a one-token prompt's prefill reaches it on the speculative server too, so both servers are served "
        "FP16, or with DISABLE_ESIMD_PAGE_ATTN=1. Other routes have no such kernel: the guard does nothing there",
    )


    @field_validator("env")
    @classmethod
    def _env_lines(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            problem = env_problem(name, value)
            if problem is not None:
                raise ValueError(problem)
        return env


class HostRequirements(Strict):
    accelerator: Literal["xpu", "cpu"]
    gpu_pci_ids: list[str] = Field(default_factory=list, description="Accepted vendor:device ids, e.g. 8086:e223")
    gpu_count: int = Field(0, ge=0)
    cpu_cores_min: int = Field(1, ge=1, description="CPU recipes: cores the host must have, one per TP rank")
    vram_gib_per_gpu: float = Field(0, ge=0)
    ram_gb_min: float = Field(ge=0, description="RAM the host must have installed, in GB as memory is sold "
                              "(2^30 bytes); a host meets it when MemTotal is at least what such a host shows")
    ram_gb_min_source: str = Field(min_length=1, description="Where the minimum comes from")
    disk_gib_min: float = Field(ge=0)
    kernel_min: str | None = None


class Workload(Strict):
    """One throughput workload of the replication check, run at concurrency 1."""

    name: str
    description: str
    api: Literal["completions", "chat"] = "completions"
    prompts: list[str] = Field(default_factory=list)
    prompt_tokens: int | None = Field(None, ge=1, description="Synthesize a prompt of exactly this many tokens")
    max_tokens: int = Field(ge=2)
    temperature: float = Field(0.0, ge=0)
    ignore_eos: bool = True
    server: Literal["endpoint", "baseline"] = Field(
        "endpoint", description="Where the workload runs: the served endpoint, or the target-only baseline, so a "
                                "claim can compare the two measured in the same run")
    warmup_requests: int = Field(1, ge=0)
    min_requests: int = Field(3, ge=1)
    max_requests: int = Field(10, ge=1)
    target_relative_halfwidth: float = Field(0.02, gt=0, description="Stop when the median's CI is within ±this")

    @field_validator("name")
    @classmethod
    def _name_is_a_file_name(cls, name: str) -> str:
        # raw/throughput/<name>/ holds the workload's data: a name like "../../x" or "/abs" would write elsewhere.
        problem = path_part_problem(name)
        if problem is not None:
            raise ValueError(f"workload name {name[:80]!r} is {problem}: rename the workload (throughput.workloads[]"
                             ".name), e.g. long_prompt")
        return name

    @model_validator(mode="after")
    def _has_prompt(self) -> Workload:
        if not self.prompts and self.prompt_tokens is None:
            raise ValueError(f"workload {self.name!r} needs prompts or prompt_tokens")
        if self.max_requests < self.min_requests:
            raise ValueError(f"workload {self.name!r}: max_requests < min_requests")
        return self


class Probe(Strict):
    """A question whose answer a working model cannot get wrong: guards against images that serve garbage."""

    prompt: str
    expect_any: list[str] = Field(min_length=1)
    max_tokens: int = Field(32, ge=1)


# A Python REPL line a working model continues with its value: the code canary of the gate against silent garbage.
CODE_CANARY_PROMPT = ">>> sum(i*i for i in range(4))\n"


def _code_canary() -> Probe:
    return Probe(prompt=CODE_CANARY_PROMPT, expect_any=["14"], max_tokens=8)


class GateSettings(Strict):
    """The gate against silent garbage (checks/gate.py): greedy answers that must not change when the same prompt is
    asked again (a prefix-cache hit), after a long cached prefix, or after a restart, and a code canary. Every field
    has a default: a recipe needs no gate section."""

    repetition_prompts: int = Field(2, ge=1, description="How many of correctness.prompts are asked repeatedly")
    repetitions: int = Field(3, ge=2, description="Requests per prompt: the first cold, the later ones from the cache")
    cache_probe_tokens: int = Field(
        2304, ge=16, description="Prompt tokens of the prefix-cache probe: past one KV block and past 2048 tokens "
                                 "(the field's MTP + prefix caching corruption starts past a 2048-token block); "
                                 "capped at serve.max_model_len minus max_tokens, and the result says so")
    cache_probe_requests: int = Field(3, ge=2, description="Requests of the long prompt: one cold, the rest cached")
    max_tokens: int | None = Field(None, ge=1, description="Tokens per answer; None: correctness.max_tokens")
    canary: Probe = Field(default_factory=_code_canary, description="A question with a known answer")
    assert_canary: bool | None = Field(
        None, description="Whether the canary's answer is judged; None: for a real checkpoint, not for a generated "
                          "tiny target (its text is nonsense)")


class CorrectnessSettings(Strict):
    prompts: list[str] = Field(min_length=1)
    max_tokens: int = Field(64, ge=1)
    probes: list[Probe] = Field(default_factory=list)
    # Degenerate repetition: the output's tail is one short n-gram over and over.
    degenerate_max_period: int = Field(4, ge=1)
    degenerate_min_fraction: float = Field(0.6, gt=0, le=1)
    gate: GateSettings = Field(default_factory=GateSettings)


class Tolerance(Strict):
    relative: float = Field(0.0, ge=0)
    absolute: float = Field(0.0, ge=0)

    def slack(self, reference: float) -> float:
        return max(abs(reference) * self.relative, self.absolute)


class Claim(Strict):
    """A published figure the recipe must reproduce. `metric` is a key of the report's measurements; with
    `divided_by` the claim is on the ratio of two of them (e.g. the speculative rate over the target-only rate
    measured in the same run, which holds on any machine where a bound in tok/s would not)."""

    id: str
    description: str
    metric: str
    divided_by: str | None = None
    op: Literal[">=", "<=", "between", "per_position"]
    value: float | None = None
    low: float | None = None
    high: float | None = None
    values: list[float] | None = None
    tolerance: Tolerance = Tolerance()
    source: str = Field(min_length=1, description="Who published the figure, in words a reader can find")
    url: str | None = Field(None, pattern=r"^https?://\S+$", description="Where the figure was published")
    quote: str | None = Field(None, min_length=1, description="The published line the figure is read from, verbatim")

    @model_validator(mode="after")
    def _operands(self) -> Claim:
        needed = {">=": ("value",), "<=": ("value",), "between": ("low", "high"), "per_position": ("values",)}
        missing = [name for name in needed[self.op] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"claim {self.id!r} with op {self.op!r} needs {', '.join(missing)}")
        # An unquoted " #" in YAML starts a comment: "intel/llm-scaler PR #620" would arrive as "...PR".
        if re.search(r"(\bPR|\bpull request|\bissue|\bseed|#)\s*$", self.source, re.IGNORECASE):
            raise ValueError(f"claim {self.id!r}: source {self.source!r} ends mid-reference: quote it in the YAML "
                             "(an unquoted ' #' starts a comment)")
        if self.divided_by is not None and self.op == "per_position":
            raise ValueError(f"claim {self.id!r}: divided_by takes one figure, not per-position rates")
        return self

    def describe_bound(self) -> str:
        """The bound as people read it, with its tolerance: what `recipes show`, every verdict and the fleet report
        print. With both a relative and an absolute tolerance the larger applies (Tolerance.slack), and both are
        named."""
        tol = self.tolerance
        parts = ([f"{tol.relative:.0%}"] if tol.relative else []) + ([f"±{tol.absolute:g}"] if tol.absolute else [])
        tolerance = (f" (tolerance {parts[0]} or {parts[1]}, the larger)" if len(parts) == 2
                     else f" (tolerance {parts[0]})" if parts else "")
        if self.op == "between":
            return f"{self.low:g} .. {self.high:g}{tolerance}"
        if self.op == "per_position":
            return " ".join(f"{value:.2f}" for value in self.values or []) + tolerance
        return f"{self.op} {self.value:g}{tolerance}"


class IntRange(Strict):
    """Every integer from low to high, both included."""

    low: int
    high: int

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if self.high < self.low:
            raise ValueError(f"range {self.low}..{self.high}: high is below low")
        return self

    def values(self) -> list[int]:
        return list(range(self.low, self.high + 1))


# The oneCCL variables of a profile that tuning may move (b70host/topology.py CCL_PROFILES writes the profiles). Only
# the P2P profile's message-size thresholds: they choose between algorithms that all work over peer access. The
# no-P2P profile's SIMPLE thresholds stay at 4 GiB: a lower one sends collectives down the peer IPC path that fails
# without P2P (zeMemOpenIpcHandle, docs/facts.md, P2P and the no-P2P path).
ONECCL_TUNABLE = re.compile(r"^CCL_[A-Z0-9_]+_THRESHOLD$")
# Knobs only an ngram candidate has (tune.ngram): which method, and its n-gram window.
NGRAM_KNOBS = ("method", "prompt_lookup_min", "prompt_lookup_max")
# Candidates a tune may serve: each is a server start (minutes on a B70 host), so a grid larger than this is a
# space nobody can afford to measure.
MAX_TUNE_CANDIDATES = 64


def _distinct(name: str, values: list[int]) -> None:
    if len(values) != len(set(values)):
        raise ValueError(f"{name}: a value is listed twice")


def _k_values(k: IntRange | list[int]) -> list[int]:
    return k.values() if isinstance(k, IntRange) else list(k)


class NgramSpace(Strict):
    """ngram candidates besides the recipe's own method: vLLM drafts from n-grams of the prompt and the output so
    far, no draft model. Every combination of k and a lookup window with min <= max is tried (vLLM refuses
    min > max, so those pairs are left out)."""

    num_speculative_tokens: IntRange | list[int] = Field(description="A range {low, high}, or the values as a list")
    prompt_lookup_min: list[int] = Field(min_length=1, description="Shortest n-grams matched")
    prompt_lookup_max: list[int] = Field(min_length=1, description="Longest n-grams matched")

    @model_validator(mode="after")
    def _values(self) -> NgramSpace:
        if not _k_values(self.num_speculative_tokens):
            raise ValueError("tune.ngram.num_speculative_tokens: give at least one value")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _distinct(f"tune.ngram.{name}", _k_values(getattr(self, name)))
        if any(value < 1 for value in self.prompt_lookup_min + self.prompt_lookup_max):
            raise ValueError("tune.ngram: prompt lookup sizes start at 1 (vLLM's minimum)")
        if not self.windows():
            raise ValueError("tune.ngram: every prompt_lookup_min is above every prompt_lookup_max: vLLM refuses "
                             "min > max, so there is no window to try")
        return self

    def windows(self) -> list[tuple[int, int]]:
        return [(low, high) for low in self.prompt_lookup_min for high in self.prompt_lookup_max if low <= high]

    def grid(self) -> list[dict[str, int | str | None]]:
        return [{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}
                for k in _k_values(self.num_speculative_tokens) for low, high in self.windows()]


class TuneSpace(Strict):
    """What `b70ctl tune` may change on a host and the values it tries (a grid: every combination), with its
    budget. Knobs not named here are never tuned. Every combination must give a recipe the validator accepts."""

    num_speculative_tokens: IntRange | list[int] | None = Field(
        None, description="A range {low, high}, or the values as a list")
    draft_sample_method: list[Literal["greedy", "probabilistic"]] = Field(default_factory=list)
    max_num_batched_tokens: list[int] = Field(default_factory=list)
    prefix_caching: list[Literal["on", "off"]] = Field(
        default_factory=list, description="Serve with prefix caching on and/or off. A candidate with it on is served "
                                          "with the cache on whatever the host's record, so the gate's prefix-cache "
                                          "probe runs against it; a winner with it on is the host's record that the "
                                          "probe passed there (b70_tuned.yml)")
    ngram: NgramSpace | None = Field(
        None, description="Also try method ngram (no draft model) with these values: the method is then the "
                          "recipe's own or ngram")
    oneccl_thresholds: dict[Literal["p2p", "no-p2p"], dict[str, list[int]]] = Field(
        default_factory=dict, description="Per oneCCL profile, threshold variables and the values tried; only "
                                          "the host's active profile applies")
    budget_requests: int = Field(ge=1, description="Most measured requests of the whole tune, the final "
                                                   "re-measurement included (warm-ups are not counted)")
    first_rung_requests: int = Field(1, ge=1, description="Requests per workload of every candidate in the "
                                                          "first round; each later round doubles it")
    final_requests: int = Field(3, ge=1, description="Requests per workload of the winner and the recipe's "
                                                     "default, measured back to back at the end")

    @field_validator("prefix_caching", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare on/off as a boolean: take it back as the word the recipe's author wrote."""
        if isinstance(value, list):
            return [("on" if item else "off") if isinstance(item, bool) else item for item in value]
        return value

    @model_validator(mode="after")
    def _values(self) -> TuneSpace:
        listed_k = self.num_speculative_tokens if isinstance(self.num_speculative_tokens, list) else None
        for name, values in (("num_speculative_tokens", listed_k or []),
                             ("draft_sample_method", self.draft_sample_method),
                             ("max_num_batched_tokens", self.max_num_batched_tokens),
                             ("prefix_caching", self.prefix_caching)):
            if listed_k == [] and name == "num_speculative_tokens":
                raise ValueError("tune.num_speculative_tokens: give at least one value")
            if len(values) != len(set(values)):
                raise ValueError(f"tune.{name}: a value is listed twice")
        if "no-p2p" in self.oneccl_thresholds:
            raise ValueError("tune.oneccl_thresholds: the no-p2p profile's thresholds must stay as they are (every "
                             "collective through host memory; a lower threshold takes the peer IPC path that fails "
                             "without P2P): tune the p2p profile only")
        for profile, variables in self.oneccl_thresholds.items():
            for variable, values in variables.items():
                if not ONECCL_TUNABLE.match(variable):
                    raise ValueError(f"tune.oneccl_thresholds.{profile}: {variable!r} is not a oneCCL threshold "
                                     "(CCL_..._THRESHOLD): only message-size thresholds are tuned")
                if not values or any(value < 0 for value in values) or len(values) != len(set(values)):
                    raise ValueError(f"tune.oneccl_thresholds.{profile}.{variable}: give distinct sizes >= 0")
        return self

    def knobs(self, profile: str | None = None) -> dict[str, list[int | str]]:
        """Knob name -> values tried, in a fixed order; oneCCL variables only for the host's active profile. With
        an ngram section: `method` (ngram; the recipe's own method is the other value) and the lookup window."""
        knobs: dict[str, list[int | str]] = {}
        if self.ngram is not None:
            knobs["method"] = ["ngram"]
        k = self.num_speculative_tokens
        ngram_k = _k_values(self.ngram.num_speculative_tokens) if self.ngram is not None else []
        if k is not None or ngram_k:
            own_k: list[int | str] = list(_k_values(k)) if k is not None else []
            knobs["num_speculative_tokens"] = own_k + [value for value in ngram_k if value not in own_k]
        if self.draft_sample_method:
            knobs["draft_sample_method"] = list(self.draft_sample_method)
        if self.max_num_batched_tokens:
            knobs["max_num_batched_tokens"] = list(self.max_num_batched_tokens)
        if self.prefix_caching:
            knobs["prefix_caching"] = list(self.prefix_caching)
        by_profile = {str(name): values for name, values in self.oneccl_thresholds.items()}
        for variable, values in sorted(by_profile.get(profile or "", {}).items()):
            knobs[variable] = list(values)
        if self.ngram is not None:
            knobs["prompt_lookup_min"] = list(self.ngram.prompt_lookup_min)
            knobs["prompt_lookup_max"] = list(self.ngram.prompt_lookup_max)
        return knobs

    def grid(self, profile: str | None = None) -> list[dict[str, int | str | None]]:
        """Every combination of the knobs' values for the recipe's own method, the first knob varying slowest;
        then the ngram section's combinations (their k and window; draft sampling off, ngram has no draft model to
        sample). A knob a combination leaves out keeps the recipe's value."""
        own = {name: values for name, values in self.knobs(profile).items() if name not in NGRAM_KNOBS}
        if self.num_speculative_tokens is not None:
            own["num_speculative_tokens"] = list[int | str](_k_values(self.num_speculative_tokens))
        else:
            own.pop("num_speculative_tokens", None)
        combinations: list[dict[str, int | str | None]] = [{}]
        for name, values in own.items():
            combinations = [{**combination, name: value} for combination in combinations for value in values]
        if self.ngram is not None:
            unsampled = {"draft_sample_method": None} if self.draft_sample_method else {}
            combinations += [{**overrides, **unsampled} for overrides in self.ngram.grid()]
        return combinations


class Recipe(Strict):
    schema_version: Literal[1] = 1
    name: str
    description: str
    route: Literal["patched", "native", "cpu"]
    vllm_version: str
    target: ModelSpec
    drafter: ModelSpec | None = None
    tiny: TinySpec | None = Field(None, description="How the embedded default generates its models")
    image: ImageSpec
    serve: ServeSettings
    host: HostRequirements
    workloads: list[Workload]
    correctness: CorrectnessSettings
    claims: list[Claim]
    tune: TuneSpace | None = Field(None, description="The knobs `b70ctl tune` may change, and its budget")

    @model_validator(mode="after")
    def _known_bad(self) -> Recipe:
        spec = self.serve.speculative
        if spec is not None and spec.method == "dspark":
            if not version_at_least(self.vllm_version, "0.25.0"):
                raise ValueError(
                    f"method 'dspark' needs vLLM >= 0.25.0 (native DSpark), this recipe pins {self.vllm_version}; "
                    "use route 'patched' with method 'dflash' on 0.21"
                )
            if self.serve.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
                raise ValueError(
                    "method 'dspark' runs only on Model Runner V2: remove VLLM_USE_V2_MODEL_RUNNER=0 from serve.env"
                )
        refusal = line_refusal(self.vllm_version, spec.method if spec else None,
                               spec.draft_sample_method if spec else None, self.serve.env)
        if refusal is not None:
            raise ValueError(refusal)
        if spec is not None and spec.enable_adaptive_verification and self.target.has_linear_attention:
            raise ValueError(
                "enable_adaptive_verification is rejected by vLLM for targets with GDN linear-attention layers "
                "(Qwen3.8): set it to false"
            )
        if self.host.accelerator == "xpu" and self.serve.tensor_parallel_size > self.host.gpu_count:
            raise ValueError(
                f"serve.tensor_parallel_size {self.serve.tensor_parallel_size} is larger than host.gpu_count "
                f"{self.host.gpu_count}: lower TP or require more GPUs"
            )
        largest_tp = max(self.serve.tensor_parallel_size, self.serve.baseline_tensor_parallel_size or 1)
        if self.host.accelerator == "cpu" and largest_tp > self.host.cpu_cores_min:
            raise ValueError(
                f"tensor parallel size {largest_tp} is larger than host.cpu_cores_min {self.host.cpu_cores_min}: "
                "vLLM's CPU backend binds each TP rank to its own core; lower TP or require more cores"
            )
        if self.serve.worker_card_visibility == "own" and (self.route != "patched" or self.host.accelerator != "xpu"):
            raise ValueError(
                "serve.worker_card_visibility 'own' needs route a's image (route 'patched' on XPU), whose patch "
                "0006 starts each worker with its own card: set it to 'all' for this recipe"
            )
        if spec is not None and spec.method not in DRAFTER_FREE and self.drafter is None:
            raise ValueError(f"speculative method {spec.method!r} needs a drafter")
        if spec is not None and spec.method in PARALLEL_DRAFTING:
            self._drafting_budget(spec)
        self._context_budget()
        generated = [m for m in (self.target, self.drafter) if m is not None and m.generated]
        if generated and self.tiny is None:
            raise ValueError("generated models need a tiny section (the generator's spec)")
        names = [w.name for w in self.workloads]
        if len(names) != len(set(names)):
            raise ValueError("workload names must be unique")
        claim_ids = [c.id for c in self.claims]
        if len(claim_ids) != len(set(claim_ids)):
            raise ValueError("claim ids must be unique")
        return self

    def _context_budget(self) -> None:
        """Every request fits in serve.max_model_len: vLLM refuses a prompt plus max_tokens longer than the context
        (its error is the request's failure, after verify built the prompt), and max_tokens sets each request's
        deadline, so a max_tokens of 1e21 would leave it none."""
        context = self.serve.max_model_len
        requests = [(f"workloads.{index} ({workload.name})", workload.prompt_tokens or 1, workload.max_tokens)
                    for index, workload in enumerate(self.workloads)]
        requests.append(("correctness", 1, self.correctness.max_tokens))
        requests += [(f"correctness.probes.{index}", 1, probe.max_tokens)
                     for index, probe in enumerate(self.correctness.probes)]
        gate = self.correctness.gate
        requests += [("correctness.gate", 1, gate.max_tokens or self.correctness.max_tokens),
                     ("correctness.gate.canary", 1, gate.canary.max_tokens)]
        for where, prompt_tokens, max_tokens in requests:
            if prompt_tokens + max_tokens > context:
                asked = (f"prompt_tokens {prompt_tokens} + max_tokens {max_tokens}" if prompt_tokens > 1
                         else f"max_tokens {max_tokens} and a prompt")
                raise ValueError(f"{where}: {asked} do not fit in serve.max_model_len {context}: lower them, or "
                                 "raise max_model_len")

    def _drafting_budget(self, spec: SpeculativeSettings) -> None:
        """DFlash/DSpark draft a block of k per pass. k above the drafter's block size collapses acceptance (k=7 on
        a block-5 drafter: 4.4%, vllm PR #41834); vLLM keeps k slots per request out of a step's token budget and
        refuses the config when max_num_batched_tokens - k x max_num_seqs leaves no token to schedule (vllm
        #50708; vllm/config/vllm.py _set_max_num_scheduled_tokens)."""
        k = spec.num_speculative_tokens
        block = self.drafter.block_size if self.drafter is not None else None
        if block is not None and k > block:
            raise ValueError(f"num_speculative_tokens {k} is above the drafter's block_size {block}: acceptance "
                             f"collapses past the block (vllm PR #41834); set num_speculative_tokens <= {block}")
        batched, seqs = self.serve.max_num_batched_tokens, self.serve.max_num_seqs
        if batched is not None and seqs is not None and batched - k * seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens {batched} - num_speculative_tokens {k} x max_num_seqs {seqs} = "
                f"{batched - k * seqs}: vLLM {spec.method} keeps k slots per sequence and refuses a step with no "
                f"token left (vllm #50708); raise max_num_batched_tokens above {k * seqs} or lower max_num_seqs or k")

    def with_request_cap(self, max_requests: int) -> Recipe:
        """This recipe with every workload measured at most `max_requests` times (and at least as often as that
        allows): a quick check. Below a workload's min_requests its median's interval widens past the recipe's
        target, which the report states; the verdicts still judge what was measured."""
        workloads = [workload.model_copy(update={"min_requests": min(workload.min_requests, max_requests),
                                                 "max_requests": min(workload.max_requests, max_requests)})
                     for workload in self.workloads]
        return self.model_copy(update={"workloads": workloads})

    @model_validator(mode="after")
    def _tune_space(self) -> Recipe:
        """A tune may only try what this recipe's vLLM has, and every candidate must be a recipe this validator
        accepts: each is re-validated whole, so a tuned override can never bring back a refused combination."""
        tune = self.tune
        if tune is None:
            return self
        spec = self.serve.speculative
        if spec is None and (tune.num_speculative_tokens is not None or tune.draft_sample_method
                             or tune.ngram is not None):
            raise ValueError("tune: num_speculative_tokens, draft_sample_method and ngram need serve.speculative")
        if tune.ngram is not None and spec is not None and spec.method == "ngram":
            raise ValueError("tune.ngram: the recipe's own method is ngram already; the section adds ngram "
                             "candidates to a recipe that drafts with a model")
        if tune.draft_sample_method:
            if spec is not None and spec.method == "ngram":
                raise ValueError("tune.draft_sample_method: ngram drafts without a model, there is nothing to sample")
            # vLLM 0.21 names the values greedy | gumbel and applies them under Model Runner V2 only
            # (vllm/config/speculative.py at v0.21.0); 0.29 and 0.32 have greedy | probabilistic.
            if not version_at_least(self.vllm_version, "0.29.0"):
                raise ValueError(f"tune.draft_sample_method: vLLM {self.vllm_version} has no 'probabilistic' draft "
                                 "sampling (0.21 has greedy | gumbel, Model Runner V2 only): leave it out")
            if self.serve.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
                raise ValueError("tune.draft_sample_method applies under Model Runner V2 only, and serve.env sets "
                                 "VLLM_USE_V2_MODEL_RUNNER=0: leave it out")
        if tune.oneccl_thresholds:
            if self.host.accelerator != "xpu":
                raise ValueError("tune.oneccl_thresholds: oneCCL runs on XPU hosts only")
            if self.serve.tensor_parallel_size < 2:
                raise ValueError("tune.oneccl_thresholds: at tensor parallel size 1 there are no collectives")
        profiles: list[str | None] = [*tune.oneccl_thresholds] or [None]
        grids = [tune.grid(profile) for profile in profiles]
        largest = max(len(grid) for grid in grids)
        if largest > MAX_TUNE_CANDIDATES:
            raise ValueError(f"tune: {largest} candidates, more than {MAX_TUNE_CANDIDATES} (each is a server start): "
                             "narrow the ranges")
        measured_workloads = sum(1 for workload in self.workloads if workload.server == "endpoint")
        first_rung = largest * tune.first_rung_requests * measured_workloads
        final = 2 * tune.final_requests * measured_workloads
        if first_rung + final > tune.budget_requests:
            raise ValueError(f"tune.budget_requests {tune.budget_requests} does not cover one round of every "
                             f"candidate and the final re-measurement ({first_rung} + {final} requests): raise it")
        for grid in grids:
            for overrides in grid:
                try:
                    self.with_overrides(overrides)
                except ValidationError as error:
                    shown = ", ".join(f"{name}={value}" for name, value in overrides.items())
                    raise ValueError(f"tune: the candidate {shown} is a recipe this validator refuses: "
                                     f"{first_problem(error)}") from None
        return self

    def with_overrides(self, overrides: Mapping[str, int | str | None]) -> Recipe:
        """This recipe with a tune's overrides applied, validated whole (and without a tune section of its own).
        oneCCL variables are host environment, not recipe fields: the serve context carries them."""
        data = self.model_dump(mode="python")
        data["tune"] = None
        spec = self.serve.speculative
        for name, value in overrides.items():
            if name == "method" and spec is not None and value not in (spec.method, "ngram"):
                # ngram needs no other model, so it is the one method a tune may switch a recipe to.
                raise ValueError(f"override method={value!r}: a tune keeps the recipe's method ({spec.method}) "
                                 "or tries ngram")
            if name in ("method", "num_speculative_tokens", "draft_sample_method", "prompt_lookup_min",
                        "prompt_lookup_max"):
                if data["serve"]["speculative"] is None:
                    raise ValueError(f"override {name}: the recipe does not speculate")
                data["serve"]["speculative"][name] = value
            elif name == "max_num_batched_tokens":
                data["serve"][name] = value
            elif name == "prefix_caching":
                if value not in ("on", "off", None):
                    raise ValueError(f"override prefix_caching={value!r}: give on or off")
                if value is not None:
                    data["serve"]["enable_prefix_caching"] = value == "on"
            elif not ONECCL_TUNABLE.match(name):
                raise ValueError(f"override {name!r}: not a knob b70ctl tunes")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                # It becomes a line of the unit's env-file: a size in bytes, nothing else.
                raise ValueError(f"override {name}: the value is not a size in bytes (an integer >= 0)")
        if overrides.get("method") == "ngram" and spec is not None and spec.method != "ngram":
            # The drafter's own settings do not carry over to n-gram drafting: nothing is sampled or verified
            # adaptively without a draft model.
            data["serve"]["speculative"].update(draft_sample_method=None, enable_adaptive_verification=False)
        return Recipe.model_validate(data)

    def workload(self, name: str) -> Workload:
        for workload in self.workloads:
            if workload.name == name:
                return workload
        raise KeyError(name)
