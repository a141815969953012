"""What a log says beside its failure: the versions it shows, the serve settings it echoes, the call that failed,
and its decisive lines (errors, exceptions, result codes) with the layer of the stack each belongs to.

Pure: each function reads one line. The matcher (match.py) feeds them only the lines its prefilter lets through,
so every pattern here has a literal part (the prefilter is built from the literals).
"""

from __future__ import annotations

import re
from typing import Final

from b70ctl.diagnose.model import LogKind

# Versions, each with the shapes logs print it in: vLLM's banner and engine line, pip/collect_env listings, the xe
# driver's firmware line, sycl-ls's driver column, image tags.
VERSION_PATTERNS: Final[dict[str, re.Pattern[str]]] = {
    "vllm": re.compile(r"(?:vLLM version|vllm version|vllm==|█  version|LLM engine \(v)\s*v?(\d+\.\d+\.\d+[\w.+-]*)"),
    "torch": re.compile(r"(?:PyTorch version|torch version|torch==|Torch version)[:= ]\s*(\d+\.\d+\.\d+[\w.+-]*)"),
    "kernel": re.compile(r"(?:Linux version |uname -r[^\d]*)(\d+\.\d+\.\d+-\d+[\w.-]*)"),
    "guc": re.compile(r"GuC firmware[^\n]*?version (\d+\.\d+\.\d+)"),
    "compute-runtime": re.compile(r"(?:compute-runtime|libze-intel-gpu1|intel-opencl-icd)[ :=/v]+"
                                  r"(\d{2}\.\d{2}\.\d{5}(?:\.\d+)?)"),
    "level-zero-loader": re.compile(r"(?:libze1|level-zero loader|ze_loader)[ :=v]+(1\.\d+\.\d+)"),
    "oneccl": re.compile(r"(?:oneCCL|ccl version|CCL version)[^\d\n]{0,20}(20\d\d\.\d+(?:\.\d+)*)"),
    "image": re.compile(r"((?:intel/llm-scaler-vllm|vllm/vllm-openai-xpu|vllm-openai-xpu|llm-scaler-vllm):"
                        r"[\w.-]+)"),
}

# Settings as vLLM echoes them: `non-default args: {'max_model_len': 8192, ...}`, the engine's `key=value` config
# line, and command-line flags, read only in the lines that echo them (SETTINGS_LINE: a few literals for the
# prefilter instead of every setting's name).
SETTINGS_LINE: Final = re.compile(r"non-default args|with config:|vllm serve|vllm\.entrypoints|api_server")
SETTING_NAMES: Final = ("gpu_memory_utilization", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
                        "kv_cache_dtype", "quantization", "dtype", "max_num_seqs", "max_num_batched_tokens",
                        "block_size", "enforce_eager", "speculative_config")
_SETTING_WORDS = "|".join(SETTING_NAMES + tuple(name.replace("_", "-") for name in SETTING_NAMES))
SETTING_PATTERN: Final = re.compile(
    rf"(?:'({_SETTING_WORDS})': ('[^']*'|\{{[^}}]*\}}|[^,}}]+)"
    rf"|\b({_SETTING_WORDS})=('[^']*'|[^,\s)]+)"
    rf"|--({_SETTING_WORDS})[= ]([^\s]+))")

# The call that failed, named from the trace's frames and vLLM's own progress lines, in the order a start runs them.
CALL_PATTERNS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    ("load", re.compile(r"\bload_model\b|\bload_weights\b|Loading safetensors|Loading weights|model_loader")),
    ("first collective", re.compile(r"\ball_reduce\b|\ball_gather\b|init_device|initialize_model_parallel"
                                    r"|init_distributed_environment|zeMemOpenIpcHandle")),
    ("profile run", re.compile(r"\bprofile_run\b|determine_available_memory|_dummy_sampler_run|Memory profiling")),
    ("graph capture", re.compile(r"capture_model|Capturing (?:CUDA|XPU) graphs?|graph capture|cudagraph_capture")),
    ("warm-up", re.compile(r"\b_dummy_run\b|compile_or_warm_up_model|[Ww]arming up|warmup_model")),
)

# Decisive lines: where a failure shows itself whatever its cause. An exception's own line (not the traceback's
# frames), a runtime's result code, an engine or worker that died, a fatal signal, the kernel driver's errors.
DECISIVE_PATTERNS: Final[tuple[tuple[frozenset[LogKind], re.Pattern[str]], ...]] = (
    (frozenset({"serve"}), re.compile(r"(?:^|\]:? |\) |: )(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)"
                                      r"(?::|\s*$)")),
    (frozenset({"serve"}), re.compile(r"\b(?:ZE|UR)_RESULT_ERROR_\w+|backend failed with error|Native API returns"
                                      r"|EXCEPTION: ")),
    (frozenset({"serve"}), re.compile(r"Engine core initialization failed|Worker failed with error|Failed core proc"
                                      r"|Fatal Python error|terminate called after throwing|Segmentation fault"
                                      r"|core dumped|Aborted \(core")),
    (frozenset({"kernel"}), re.compile(r"\*ERROR\*|Engine reset|GPU hang|wedged|Fault response|AER: .*error"
                                       r"|Out of memory: Killed")),
)

# The layer a decisive line belongs to, by its shape; first match wins.
LAYER_SHAPES: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    ("host-memory", re.compile(r"MemoryError|Cannot allocate memory|DefaultCPUAllocator|Out of memory: Killed"
                               r"|OUT_OF_HOST_MEMORY|oom-kill")),
    ("container", re.compile(r"/dev/dri|Permission denied|Operation not permitted|No such device|docker")),
    ("oneccl", re.compile(r"oneCCL|\bccl\b|CCL_|ze_handle_manager|ze_call\.cpp|atl_")),
    ("level-zero", re.compile(r"\b(?:ZE|UR)_RESULT_\w+|level_zero|Level Zero|Native API|sycl|SYCL|\bUR\b")),
    ("torch", re.compile(r"torch\._inductor|torch\._dynamo|triton|Triton|undefined symbol|_C\.so|_xpu_C|"
                         r"torch\.compile|InductorError|BackendCompilerFailed")),
    ("model-loader", re.compile(r"safetensors|load_weights|load_model|quantization|[Qq]uant|checkpoint|"
                                r"config\.json|tokenizer")),
    ("vllm", re.compile(r"ValidationError|Value error|VllmConfig|ModelConfig|SchedulerConfig|CacheConfig|"
                        r"SpeculativeConfig|ParallelConfig|vllm|EngineCore")),
)
KERNEL_LAYER: Final = "kernel-driver"


def version_in(name: str, text: str) -> str | None:
    match = VERSION_PATTERNS[name].search(text)
    return None if match is None else next(group for group in match.groups() if group)


def settings_in(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for match in SETTING_PATTERN.finditer(text):
        groups = match.groups()
        name, value = next((groups[i], groups[i + 1]) for i in (0, 2, 4) if groups[i])
        found[name.replace("-", "_")] = value.strip().strip("'\"")
    return found


def is_decisive(kind: LogKind, text: str) -> bool:
    return any(kind in kinds and pattern.search(text) for kinds, pattern in DECISIVE_PATTERNS)


def layer_of(kind: LogKind, text: str) -> str | None:
    if kind == "kernel":
        return KERNEL_LAYER
    return next((layer for layer, pattern in LAYER_SHAPES if pattern.search(text)), None)


# What a line can tell beside the catalogue, one probe per pattern: ("version", name), ("settings", ""),
# ("call", name) or ("decisive", ""). The matcher sends a line only to the probes whose literals it holds.
Probe = tuple[str, str, re.Pattern[str]]


def probes() -> list[Probe]:
    return [*(("version", name, pattern) for name, pattern in VERSION_PATTERNS.items()),
            ("settings", "", SETTINGS_LINE),
            *(("call", name, pattern) for name, pattern in CALL_PATTERNS),
            *(("decisive", "", pattern) for _, pattern in DECISIVE_PATTERNS)]
