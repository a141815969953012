"""The recipe: everything one appliance is made of, as data.

A recipe names the target and drafter, the image, the serve settings, what a host must have, the workloads the
replication check runs and the published claims it must reproduce. Known-bad combinations (each one a failure
somebody hit on real B70 hosts, see docs/facts.md) are refused here, at load time, with the reason, so no later stage
has to re-check them.
"""

from __future__ import annotations

import re

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from b70ctl.models.tiny import TinySpec
from b70ctl.versions import version_at_least


class Strict(BaseModel):
    """Unknown keys are refused, and so are values of the wrong type: YAML reads `true`, `yes` and `off` as booleans,
    so `tensor_parallel_size: true` would otherwise become 1 and `max_model_len: yes` fail as "below 16"; a
    quoted '2' is a string. Numbers must be written as numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSpec(Strict):
    """A model the appliance serves: downloaded from a hub at a pinned revision, or generated on the host."""

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

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.repo is None) == (self.generated is None):
            raise ValueError("give exactly one of repo (download) or generated (made on the host)")
        return self


class ImageBuild(Strict):
    context: str = Field(description="Directory under images/ holding the Dockerfile")
    base: str = Field(description="Base image reference; the lock pins its digest")
    patch_series: str | None = Field(None, description="Patch series file applied on top of the base's vLLM")


class ImageSpec(Strict):
    reference: str = Field(description="Repository of the serving image, e.g. ghcr.io/rmacy/qwen38-fp8-dspark")
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
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)


class ServeSettings(Strict):
    served_model_name: str
    tensor_parallel_size: int = Field(1, ge=1)
    baseline_tensor_parallel_size: int | None = Field(
        None, ge=1, description="TP of the target-only baseline the greedy outputs are compared with; "
        "None: the speculative server's")
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_model_len: int = Field(ge=16)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    max_num_seqs: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    kv_cache_dtype: str | None = None
    mamba_ssm_cache_dtype: str | None = None
    async_scheduling: bool = False
    enforce_eager: bool = False
    trust_remote_code: bool = False
    speculative: SpeculativeSettings | None = None
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the vLLM process")
    one_token_prompt_guard: Literal["none", "float16", "disable_esimd_page_attn"] = Field(
        "none",
        description="BF16 target-only one-token prompts crash the ESIMD decode kernel on XPU (speculation "
        "verifies k+1 tokens and never hits it): the target-only baseline is served FP16, or with "
        "DISABLE_ESIMD_PAGE_ATTN=1; the speculative server is left as it is",
    )


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
    max_tokens: int = 32


class CorrectnessSettings(Strict):
    prompts: list[str] = Field(min_length=1)
    max_tokens: int = Field(64, ge=1)
    probes: list[Probe] = Field(default_factory=list)
    # Degenerate repetition: the output's tail is one short n-gram over and over.
    degenerate_max_period: int = Field(4, ge=1)
    degenerate_min_fraction: float = Field(0.6, gt=0, le=1)


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
        if spec is not None and spec.method != "ngram" and self.drafter is None:
            raise ValueError(f"speculative method {spec.method!r} needs a drafter")
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

    def workload(self, name: str) -> Workload:
        for workload in self.workloads:
            if workload.name == name:
                return workload
        raise KeyError(name)
