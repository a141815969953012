"""The serve command of the two B70 recipes on the P2P and no-P2P fixture hosts, flag by flag against
docs/facts.md.

The host's topology comes the way it does on a real host: facts read from the fixture's sysfs tree, topology.py
deciding and writing <root>/etc/b70/topology.json (what the gpu_topology role runs, with the recipe's TP size as
b70_gpus defaults to), and `load_topology` reading it back (what `b70ctl serve render --topology` does).

Each expectation below carries its source: a quote of docs/facts.md, or of the document it summarises (the
`vllm serve` line of the Doopeworld/Qwen3.8-27B-DSpark-vLLM model card) where docs/facts.md names only part of a
command, or, for the few values docs/facts.md does not prescribe, what decides them. A failure prints that source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.errors import BadInput
from b70ctl.host_documents import TopologyDocument, load_topology
from b70ctl.recipes import load_recipe
from b70ctl.serve.local import LocalServer, bound_cores
from b70ctl.serve.render import ServeCommand, ServeContext, render_container, render_serve, render_xpu_container
from b70ctl.serve.unit import env_file_text
from b70host.topology import TOPOLOGY_PATH, TopologyRefused, topology
from sysfs_trees import build_tree

REPO = Path(__file__).resolve().parents[2]
CONTEXT = ServeContext(model_dir="/models/target", drafter_dir="/models/drafter", host="0.0.0.0", port=8000)

PRESENT = object()  # a flag without a value (--async-scheduling)
ABSENT = None  # must not appear at all


class Fact(NamedTuple):
    """One expectation: `kind` is flag (vLLM argv), spec (--speculative-config, parsed), env, or docker (an option
    of `docker run`, its values in order); `value` ABSENT means the key must not appear."""

    kind: str
    key: str
    value: Any
    source: str


# ---- the BF16 one-token guard: on the speculative server and the baseline of route a
ONE_TOKEN_CRASH = "/work/shared/FACTS.md, Known failures (CORRECTED 2026-12-02): the seed's replication hit it " \
    "on the SPECULATIVE recipe (\"entered the ESIMD decode kernel before drafting\"): the prefill of a one-token " \
    "prompt has max_query_len == 1, the kernel's gate in the multi-arc patch; ... Workarounds: FP16, or " \
    "DISABLE_ESIMD_PAGE_ATTN=1 (free for speculative decode). The seed, " \
    "/work/shared/seeds/000_693d97fa2a0e0e9d.txt: \"A raw completion containing only one prompt token entered " \
    "the ESIMD decode kernel before drafting and failed\""
UPSTREAM_HAS_NO_ESIMD_GATE = "the variable is read by intel/llm-scaler's vllm/patches/vllm_for_multi_arc.patch " \
    "(25095b4, line 19779: `os.environ.get(\"DISABLE_ESIMD_PAGE_ATTN\") != \"1\"`), beside " \
    "`attn_metadata.max_query_len == 1`; no vllm-project/vllm file in the searched source index reads it: route b " \
    "is upstream vLLM, which has no such kernel"

# ---- route a: pr620-fp8-tp2 (docs/facts.md, "Serving (route a: the PR #620 recipe)")
ROUTE_A_SERVE = "Serving (route a): serve: `--tensor-parallel-size 2 --gpu-memory-utilization 0.90 --max-model-len " \
    "8192 --max-num-batched-tokens 4096 --max-num-seqs 1 --block-size 64 --dtype bfloat16 --mamba-ssm-cache-dtype " \
    "float16 --async-scheduling --speculative-config {\"method\":\"dflash\",\"model\":\"/models/drafter\"," \
    "\"num_speculative_tokens\":4}`"
ROUTE_A_ENV = "Serving (route a): env: ZE_AFFINITY_MASK=0,1 VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_AOT_COMPILE=0 " \
    "VLLM_XPU_ENABLE_XPU_GRAPH=0 ..."
ROUTE_A = [
    Fact("flag", "--tensor-parallel-size", "2", ROUTE_A_SERVE),
    Fact("flag", "--gpu-memory-utilization", "0.90", ROUTE_A_SERVE),
    Fact("flag", "--max-model-len", "8192", ROUTE_A_SERVE),
    Fact("flag", "--max-num-batched-tokens", "4096", ROUTE_A_SERVE),
    Fact("flag", "--max-num-seqs", "1", ROUTE_A_SERVE),
    Fact("flag", "--block-size", "64", ROUTE_A_SERVE),
    Fact("flag", "--dtype", "bfloat16", ROUTE_A_SERVE),
    Fact("flag", "--mamba-ssm-cache-dtype", "float16", ROUTE_A_SERVE),
    Fact("flag", "--async-scheduling", PRESENT, ROUTE_A_SERVE),
    Fact("spec", "method", "dflash", ROUTE_A_SERVE),
    Fact("spec", "model", "/models/drafter", ROUTE_A_SERVE),
    Fact("spec", "num_speculative_tokens", 4, ROUTE_A_SERVE),
    Fact("spec", "enable_adaptive_verification", ABSENT,
         "Serving (route b): `enable_adaptive_verification` is rejected with Qwen3.8's GDN layers"),
    Fact("flag", "--kv-cache-dtype", ABSENT,
         "Known failures: FP8 KV cache crashed the ESIMD kernel on some images (route a sets no KV dtype)"),
    Fact("flag", "--served-model-name", "qwen3.8-27b-fp8", "not in docs/facts.md: the recipe's served_model_name"),
    Fact("env", "VLLM_USE_V2_MODEL_RUNNER", "0", ROUTE_A_ENV),
    Fact("env", "VLLM_USE_AOT_COMPILE", "0", ROUTE_A_ENV),
    Fact("env", "VLLM_XPU_ENABLE_XPU_GRAPH", "0", ROUTE_A_ENV),
    Fact("env", "DISABLE_ESIMD_PAGE_ATTN", "1", ONE_TOKEN_CRASH),
    Fact("env", "DSPARK_ADAPTIVE_BLOCK", ABSENT,
         "Serving (route a): optional confidence truncation behind DSPARK_ADAPTIVE_BLOCK=1, off by default"),
]

# ---- route b: dspark-int4-tp1 (docs/facts.md, "Serving (route b: native vLLM)")
DOOPEWORLD = "Serving (route b): Doopeworld recipe: GPTQ-Int4 target on ONE B70, `--kv-cache-dtype fp8 --block-size " \
    "64 --max-model-len 16384 --max-num-seqs 16`, spec config {\"method\":\"dspark\",\"num_speculative_tokens\":7," \
    "\"draft_sample_method\":\"probabilistic\"}"
MODEL_CARD = "the Doopeworld/Qwen3.8-27B-DSpark-vLLM model card, Usage: `vllm serve ... --dtype bfloat16 " \
    "--max-model-len 16384 --max-num-seqs 16 --gpu-memory-utilization 0.90 --kv-cache-dtype fp8 --block-size 64 " \
    "--trust-remote-code --speculative-config '{\"method\": \"dspark\", \"model\": ..., ...}'`"
ROUTE_B_NO_ENV = "Serving (route b) prescribes no env var: route a's V1-runner set is not carried over"
ROUTE_B = [
    Fact("flag", "--tensor-parallel-size", ABSENT, DOOPEWORLD + " (vLLM's default TP is 1)"),
    Fact("flag", "--kv-cache-dtype", "fp8", DOOPEWORLD),
    Fact("flag", "--block-size", "64", DOOPEWORLD),
    Fact("flag", "--max-model-len", "16384", DOOPEWORLD),
    Fact("flag", "--max-num-seqs", "16", DOOPEWORLD),
    Fact("flag", "--dtype", "bfloat16", MODEL_CARD),
    Fact("flag", "--gpu-memory-utilization", "0.90", MODEL_CARD),
    Fact("flag", "--trust-remote-code", PRESENT, MODEL_CARD),
    Fact("flag", "--max-num-batched-tokens", ABSENT, MODEL_CARD + " (not set there)"),
    Fact("flag", "--async-scheduling", ABSENT, MODEL_CARD + " (not set there)"),
    Fact("spec", "method", "dspark",
         "Serving (route b): DSpark landed natively in vLLM 0.25.0 (`\"method\": \"dspark\"`, ...)"),
    Fact("spec", "num_speculative_tokens", 7,
         DOOPEWORLD + "; k=4 and k=6 measured worse than k=7"),
    Fact("spec", "draft_sample_method", "probabilistic",
         DOOPEWORLD + "; probabilistic 52 t/s vs greedy 42 t/s"),
    Fact("spec", "model", "/models/drafter", MODEL_CARD),
    Fact("spec", "enable_adaptive_verification", ABSENT,
         "Serving (route b): `enable_adaptive_verification` is rejected with Qwen3.8's GDN layers"),
    Fact("flag", "--served-model-name", "qwen3.8-27b-int4", "not in docs/facts.md: the recipe's served_model_name"),
    Fact("flag", "--no-enable-prefix-caching", PRESENT,
         "docs/facts.md: every server of a recipe that speculates on a hybrid target (`has_linear_attention`) on vLLM "
         ">= 0.28.1 is rendered with `--no-enable-prefix-caching` until the gate's prefix-cache probe passed"),
    Fact("env", "VLLM_USE_V2_MODEL_RUNNER", ABSENT,
         "Serving (route b): It runs only on Model Runner V2: never set VLLM_USE_V2_MODEL_RUNNER=0 with dspark"),
    Fact("env", "VLLM_USE_AOT_COMPILE", ABSENT, ROUTE_B_NO_ENV),
    Fact("env", "VLLM_XPU_ENABLE_XPU_GRAPH", ABSENT, ROUTE_B_NO_ENV),
    Fact("env", "DISABLE_ESIMD_PAGE_ATTN", ABSENT, UPSTREAM_HAS_NO_ESIMD_GATE),
]

# ---- what every render carries from the ServeContext (where it runs, not how): not docs/facts.md's
CONTEXT_FLAGS = [
    Fact("flag", "--model", "/models/target", "not in docs/facts.md: ServeContext.model_dir"),
    Fact("flag", "--host", "0.0.0.0", "not in docs/facts.md: ServeContext.host"),
    Fact("flag", "--port", "8000", "not in docs/facts.md: ServeContext.port"),
    Fact("flag", "--api-key", ABSENT,
         "not in docs/facts.md: the key goes in VLLM_API_KEY, never in argv (ps shows it)"),
]

# ---- the XPU container (docs/facts.md, "Serving (route a)", docker line)
DOCKER = "Serving (route a): docker: --device /dev/dri/cardN and renderDN for each GPU, -v " \
    "/dev/dri/by-path:/dev/dri/by-path:ro, --network host --shm-size 32g --ipc=host"
# ---- the nodes by path (docs/facts.md, the line after it): docker/cli opts validatePath splits `--device` on ':'
# (`strings.SplitN(val, ":", 3)` ... `bad mode specified: %s`), which a by-path name holds three of: this
# project's CI ran the unit with `--device /dev/dri/by-path/pci-...` and docker answered "docker: bad mode
# specified: 00.0-card." So: one bind mount per node at its by-path name, which compute-runtime's
# Drm::discoverDevices lists ("/dev/dri/by-path", `-render` entries) before any renderD128 fallback.
BY_PATH = "docs/facts.md Serving (route a): --mount type=bind,source=<by-path>,target=<by-path> plus " \
    "--device-cgroup-rule 'c 226:* rwm' and --cap-drop MKNOD; no whole-folder by-path mount"
DRM_NODE_ACCESS = [
    Fact("docker", "--device-cgroup-rule", ["c 226:* rwm"], BY_PATH),
    Fact("docker", "--cap-drop", ["MKNOD"], BY_PATH + " (the rule covers every DRM minor)"),
    Fact("docker", "--device", ABSENT, BY_PATH + ": docker: bad mode specified: 00.0-card."),
]
# ---- the compile caches on the host (/work/shared/FACTS.md, "Field reports": "B70 stacks mount compile caches (vLLM's
# torch.compile cache, ~/.cache/neo_compiler_cache, triton) so a restart does not JIT again")
CACHES = "/work/shared/FACTS.md, Field reports: B70 stacks mount compile caches (vLLM's torch.compile cache, " \
    "~/.cache/neo_compiler_cache, triton) so a restart does not JIT again"
VLLM_CACHE = CACHES + "; vLLM's envs.py: VLLM_CACHE_ROOT (default ~/.cache/vllm) holds the torch.compile cache"
NEO = CACHES + "; intel/compute-runtime default_cache_config.cpp: `neoCachePersistent = \"NEO_CACHE_PERSISTENT\"`, " \
    "`neoCacheMaxSize = \"NEO_CACHE_MAX_SIZE\"`, `neoCacheDir = \"NEO_CACHE_DIR\"`; enabled only when " \
    "NEO_CACHE_PERSISTENT != 0 (compilerCacheDefaultEnabled), and `if (!NEO::pathExists(ret.cacheDir)) ... " \
    "ret.enabled = false` (so the role creates the directory); `neoCacheMaxSizeDefault = ... gigaByte`"
TRITON = CACHES + "; triton reads TRITON_CACHE_DIR (default ~/.triton/cache)"
CACHE_MOUNTS = ["/var/cache/b70/compile/vllm:/var/cache/b70/vllm", "/var/cache/b70/compile/neo:/var/cache/b70/neo",
                "/var/cache/b70/compile/triton:/var/cache/b70/triton"]
COMPILE_CACHES = [
    Fact("env", "VLLM_CACHE_ROOT", "/var/cache/b70/vllm", VLLM_CACHE),
    Fact("env", "NEO_CACHE_PERSISTENT", "1", NEO),
    Fact("env", "NEO_CACHE_DIR", "/var/cache/b70/neo", NEO),
    Fact("env", "NEO_CACHE_MAX_SIZE", str(4 * 2**30), NEO + " (the role's vllm_serve_compile_cache_neo_max_bytes)"),
    Fact("env", "TRITON_CACHE_DIR", "/var/cache/b70/triton", TRITON),
]

CONTAINER = [
    Fact("docker", "-v", CACHE_MOUNTS,
         BY_PATH + "; " + CACHES + " (the role's vllm_serve_compile_cache_dir, /var/cache/b70/compile)"),
    *DRM_NODE_ACCESS,
    *COMPILE_CACHES,
    Fact("docker", "--network", ["host"], DOCKER),
    Fact("docker", "--shm-size", ["32g"], DOCKER),
    Fact("docker", "--ipc", ["host"], DOCKER),
]

# ---- the oneCCL profiles (docs/facts.md, "Serving (route a)" env line and "P2P and the no-P2P path")
P2P_ENV = "Serving (route a): env: ... CCL_TOPO_P2P_ACCESS=1 CCL_ZE_IPC_EXCHANGE=drmfd CCL_SYCL_ALLGATHERV_TMP_BUF=0 " \
    "CCL_SYCL_ALLREDUCE_TMP_BUF=0 CCL_ENABLE_SYCL_KERNELS=1 CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD=131072 " \
    "CCL_SYCL_ALLGATHERV_SCALEOUT_THRESHOLD=1048576"
FALLBACK = "P2P and the no-P2P path: The fallback confirmed on dual B70: CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD, " \
    "CCL_SYCL_REDUCE_SCATTER_SIMPLE_THRESHOLD, CCL_SYCL_ALLGATHERV_SIMPLE_THRESHOLD all = 4294967296, " \
    "CCL_SYCL_ALLTOALL_TMP_BUF=1, docker --cap-add SYS_PTRACE --ipc=host"
SIMPLE_THRESHOLDS = ("CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD", "CCL_SYCL_REDUCE_SCATTER_SIMPLE_THRESHOLD",
                     "CCL_SYCL_ALLGATHERV_SIMPLE_THRESHOLD")
P2P_ONLY = {"CCL_ZE_IPC_EXCHANGE": "drmfd", "CCL_SYCL_ALLGATHERV_TMP_BUF": "0", "CCL_SYCL_ALLREDUCE_TMP_BUF": "0",
            "CCL_ENABLE_SYCL_KERNELS": "1", "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": "131072",
            "CCL_SYCL_ALLGATHERV_SCALEOUT_THRESHOLD": "1048576"}
P2P_PROFILE = [
    Fact("env", "CCL_TOPO_P2P_ACCESS", "1", P2P_ENV),
    *(Fact("env", key, value, P2P_ENV) for key, value in P2P_ONLY.items()),
    *(Fact("env", key, ABSENT, FALLBACK + " (the no-P2P set, not for a P2P group)") for key in SIMPLE_THRESHOLDS),
    Fact("env", "CCL_SYCL_ALLTOALL_TMP_BUF", ABSENT, FALLBACK + " (the no-P2P set, not for a P2P group)"),
    Fact("docker", "--cap-add", ABSENT, FALLBACK + " (SYS_PTRACE is the no-P2P path's)"),
]
NO_P2P_PROFILE = [
    *(Fact("env", key, "4294967296", FALLBACK) for key in SIMPLE_THRESHOLDS),
    Fact("env", "CCL_SYCL_ALLTOALL_TMP_BUF", "1", FALLBACK),
    Fact("docker", "--cap-add", ["SYS_PTRACE"], FALLBACK),
    Fact("env", "CCL_TOPO_P2P_ACCESS", "0",
         "P2P and the no-P2P path: Without P2P, TP=2 start fails with `zeMemOpenIpcHandle "
         "ZE_RESULT_ERROR_INVALID_ARGUMENT`; setting CCL_TOPO_P2P_ACCESS=0 alone still failed (so: 0, never 1, "
         "and never alone)"),
    *(Fact("env", key, ABSENT, P2P_ENV + " (the P2P set: peer IPC between the cards)") for key in P2P_ONLY),
]

# ---- the GPUs the server gets, by their /dev/dri/by-path names: DRM minor numbers follow probe order (B70 owners'
# reports: "simpledrm can take card0; B70s seen as card2/card3 ... llm-scaler maps GPUs through /dev/dri/by-path").
# The switch host's B70s are 0000:05:00.0 and 0000:09:00.0, the root-port host's 0000:03:00.0 and 0000:06:00.0
# (tests/fixtures/sysfs.py); a TP=1 recipe gets the first card only.
def by_path(*addresses: str) -> list[str]:
    return [f"/dev/dri/by-path/pci-{address}-{kind}" for address in addresses for kind in ("card", "render")]


def bind_mounts(*addresses: str) -> list[str]:
    return [f"type=bind,source={node},target={node}" for node in by_path(*addresses)]


def two_b70(*addresses: str) -> list[Fact]:
    return [Fact("env", "ZE_AFFINITY_MASK", "0,1", ROUTE_A_ENV),
            Fact("docker", "--mount", bind_mounts(*addresses), BY_PATH)]


def first_b70(address: str) -> list[Fact]:
    return [Fact("env", "ZE_AFFINITY_MASK", "0",
                 "not in docs/facts.md for TP=1: the topology's group, the first B70 (route a's mask is 0,1 for "
                 "its two)"),
            Fact("docker", "--mount", bind_mounts(address), BY_PATH + " (the one GPU of TP=1)")]


# b70-igpu: the CPU's UHD 770 is card0/renderD128 (i915), the B70 (0000:03:00.0) card1/renderD129.
B70_BESIDE_AN_IGPU = [
    Fact("env", "ZE_AFFINITY_MASK", "0", "the container sees only the B70, Level Zero device 0"),
    Fact("docker", "--mount", bind_mounts("0000:03:00.0"),
         BY_PATH + "; Hardware: Arc Pro B70 = Battlemage G31, PCI id 8086:e223 (the iGPU is not one)"),
]
TWO_B70 = two_b70("0000:05:00.0", "0000:09:00.0")
FIRST_B70 = first_b70("0000:05:00.0")

# (recipe, fixture host, expected oneCCL profile, every fact of that render). No fixture host proves P2P (no probe
# opened peer memory), so TP=2 gets the no-p2p set even on the switch host the kernel's P2PDMA allows (the rule
# does not predict oneCCL's IPC path: https://github.com/SergiioB/intel-arc-pro-b70-inference-cookbook/issues/8).
CASES = [
    ("pr620-fp8-tp2", "b70x2-switch", "no-p2p", CONTEXT_FLAGS + ROUTE_A + CONTAINER + NO_P2P_PROFILE + TWO_B70),
    ("pr620-fp8-tp2", "b70x2-root-ports", "no-p2p",
     CONTEXT_FLAGS + ROUTE_A + CONTAINER + NO_P2P_PROFILE + two_b70("0000:03:00.0", "0000:06:00.0")),
    # TP=1 has no peer traffic: topology.py picks the no-p2p set whatever the PCIe tree (harmless, docs/facts.md has no
    # TP=1 oneCCL set); the P2P host's switch must not turn on P2P for it.
    ("dspark-int4-tp1", "b70x2-switch", "no-p2p", CONTEXT_FLAGS + ROUTE_B + CONTAINER + NO_P2P_PROFILE + FIRST_B70),
    ("dspark-int4-tp1", "b70x2-root-ports", "no-p2p",
     CONTEXT_FLAGS + ROUTE_B + CONTAINER + NO_P2P_PROFILE + first_b70("0000:03:00.0")),
    ("dspark-int4-tp1", "b70-igpu", "no-p2p",
     CONTEXT_FLAGS + ROUTE_B + CONTAINER + NO_P2P_PROFILE + B70_BESIDE_AN_IGPU),
]
CASE_IDS = [f"{recipe}@{host}" for recipe, host, _, _ in CASES]

# The docker options that take a separate value; every other option is `--name` or `--name=value`.
DOCKER_VALUE_OPTIONS = {"--device", "--mount", "-v", "--network", "--shm-size", "--cap-add", "--cap-drop",
                        "--device-cgroup-rule"}


def written_topology(tmp_path: Path, scenario: str, tensor_parallel_size: int) -> tuple[str, TopologyDocument]:
    """The fixture host's sysfs tree and the topology.json topology.py writes into it, read back as the serve
    renderer reads it."""
    root = build_tree(tmp_path, scenario)
    topology(root, tensor_parallel_size, probe="never", write=True)
    return root, load_topology(Path(root) / TOPOLOGY_PATH.lstrip("/"))


def flags(argv: list[str]) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for index, item in enumerate(argv):
        if item.startswith("--"):
            assert item not in parsed, f"{item} given twice: {argv}"
            following = argv[index + 1] if index + 1 < len(argv) else None
            parsed[item] = PRESENT if following is None or following.startswith("--") else following
    return parsed


def docker_options(docker_args: list[str]) -> dict[str, list[str]]:
    options: dict[str, list[str]] = {}
    index = 0
    while index < len(docker_args):
        item = docker_args[index]
        if item in DOCKER_VALUE_OPTIONS:
            name, value = item, docker_args[index + 1]
            index += 2
        else:
            assert item.startswith("-"), f"stray docker argument {item!r}: {docker_args}"
            name, _, value = item.partition("=")
            index += 1
        options.setdefault(name, []).append(value)
    return options


def observed(command: ServeCommand) -> dict[str, dict[str, Any]]:
    parsed = flags(command.argv)
    spec = json.loads(parsed["--speculative-config"]) if "--speculative-config" in parsed else {}
    return {"flag": parsed, "spec": spec, "env": dict(command.env), "docker": docker_options(command.docker_args)}


@pytest.mark.parametrize("recipe_name, scenario, profile, facts", CASES, ids=CASE_IDS)
def test_serve_command_matches_facts(tmp_path: Path, recipe_name: str, scenario: str, profile: str,
                                     facts: list[Fact]) -> None:
    recipe = load_recipe(recipe_name)
    root, host = written_topology(tmp_path, scenario, recipe.serve.tensor_parallel_size)
    assert host.profile == profile, host.reasons
    command = render_xpu_container(recipe, CONTEXT, host)
    seen = observed(command)

    wrong = []
    for fact in facts:
        actual = seen[fact.kind].get(fact.key, ABSENT)
        if fact.kind == "docker" and fact.key == "--mount" and actual is not ABSENT:
            actual = sorted(actual)
            expected = sorted(fact.value)
        else:
            expected = fact.value
        if actual != expected:
            wrong.append(f"{fact.kind} {fact.key}: rendered {actual!r}, expected {expected!r}\n"
                         f"    source: {fact.source}")
    assert not wrong, "\n".join(wrong)

    # Nothing un-prescribed: every flag, spec key, env var and docker option rendered is one of the table's.
    for kind in ("flag", "spec", "env", "docker"):
        accounted = {fact.key for fact in facts if fact.kind == kind and fact.value is not ABSENT}
        if kind == "flag":
            accounted.add("--speculative-config")  # its value is checked key by key as `spec`
        assert set(seen[kind]) == accounted, f"{kind}: rendered but not in docs/facts.md: {set(seen[kind]) - accounted}"

    # Every device node is a B70's: the fixture's /dev/dri/by-path link of a function with PCI id 8086:e223
    # (docs/facts.md, Hardware: "Arc Pro B70 = Battlemage G31, PCI id 8086:e223 ... on-board PCIe bridge 8086:e2f0: not
    # a GPU"), and each card comes with both its card and render node, named by path.
    links = Path(root) / "dev/dri/by-path"
    devices = [dict(part.split("=", 1) for part in mount.split(","))["source"]
               for mount in seen["docker"]["--mount"]]
    addresses = set()
    for node in devices:
        link = links / Path(node).name
        assert Path(node).parent == Path("/dev/dri/by-path") and link.is_symlink(), node
        address, kind = link.name[len("pci-"):].rsplit("-", 1)
        addresses.add(address)
        pci = Path(root) / "sys/bus/pci/devices" / address
        assert ((pci / "vendor").read_text().strip(), (pci / "device").read_text().strip()) == ("0x8086", "0xe223")
    assert len(devices) == 2 * len(addresses) == 2 * recipe.serve.tensor_parallel_size


@pytest.mark.parametrize("recipe_name, scenario, profile, facts", CASES, ids=CASE_IDS)
def test_the_one_token_guard_is_on_both_servers_of_route_a(tmp_path: Path, recipe_name: str, scenario: str,
                                                           profile: str, facts: list[Fact]) -> None:
    """The one-token prompt's prefill takes the ESIMD kernel on the speculative server too, so on route a both
    servers carry the guard; route b (upstream vLLM) gets none on either. Apart from the speculative config, the
    baseline is the same server, so greedy outputs of the two are compared on the same settings."""
    recipe = load_recipe(recipe_name)
    _, host = written_topology(tmp_path, scenario, recipe.serve.tensor_parallel_size)
    speculative = render_xpu_container(recipe, CONTEXT, host)
    baseline = render_xpu_container(recipe, CONTEXT.model_copy(update={"speculative": False}), host)
    assert recipe.serve.dtype == "bfloat16"
    # Route a's recipe carries the guard; route b's none (there is no kernel to guard against upstream).
    assert recipe.serve.one_token_prompt_guard == ("disable_esimd_page_attn" if recipe.route == "patched" else "none")
    assert flags(baseline.argv)["--dtype"] == flags(speculative.argv)["--dtype"] == "bfloat16", \
        ONE_TOKEN_CRASH + " (the env workaround keeps BF16)"
    if recipe.route == "patched":
        assert speculative.env["DISABLE_ESIMD_PAGE_ATTN"] == baseline.env["DISABLE_ESIMD_PAGE_ATTN"] == "1", \
            ONE_TOKEN_CRASH
    else:
        assert "DISABLE_ESIMD_PAGE_ATTN" not in speculative.env | baseline.env, UPSTREAM_HAS_NO_ESIMD_GATE
    assert baseline.env == speculative.env
    cut = speculative.argv.index("--speculative-config")
    assert baseline.argv == speculative.argv[:cut] + speculative.argv[cut + 2:]
    assert baseline.docker_args == speculative.docker_args


def test_the_float16_guard_serves_both_route_a_servers_fp16() -> None:
    """The other workaround of the same line ("Workarounds: FP16, ..."): on route a both servers are served FP16
    and neither gets the env; route b keeps the recipe's BF16 (upstream vLLM has no ESIMD kernel to avoid)."""
    for name, dtype in (("pr620-fp8-tp2", "float16"), ("dspark-int4-tp1", "bfloat16")):
        recipe = load_recipe(name)
        recipe = recipe.model_copy(update={"serve": recipe.serve.model_copy(
            update={"one_token_prompt_guard": "float16"})})
        speculative = render_serve(recipe, CONTEXT)
        baseline = render_serve(recipe, CONTEXT.model_copy(update={"speculative": False}))
        reason = ONE_TOKEN_CRASH if dtype == "float16" else UPSTREAM_HAS_NO_ESIMD_GATE
        assert flags(speculative.argv)["--dtype"] == flags(baseline.argv)["--dtype"] == dtype, reason
        assert "DISABLE_ESIMD_PAGE_ATTN" not in speculative.env | baseline.env


def test_no_guard_when_the_recipe_says_none() -> None:
    recipe = load_recipe("pr620-fp8-tp2")
    recipe = recipe.model_copy(update={"serve": recipe.serve.model_copy(update={"one_token_prompt_guard": "none"})})
    for speculative in (True, False):
        command = render_serve(recipe, CONTEXT.model_copy(update={"speculative": speculative}))
        assert flags(command.argv)["--dtype"] == "bfloat16" and "DISABLE_ESIMD_PAGE_ATTN" not in command.env


def test_the_compile_cache_directory_is_the_role_s_and_can_be_turned_off(tmp_path: Path) -> None:
    """The host directory and the NEO cap come from the vllm_serve role (its defaults are render.py's); '' mounts
    nothing and sets none of the cache variables. A relative or ':'-bearing directory cannot be a docker -v."""
    recipe = load_recipe("dspark-int4-tp1")
    _, host = written_topology(tmp_path, "b70-igpu", recipe.serve.tensor_parallel_size)
    defaults = yaml.safe_load((REPO / "roles/vllm_serve/defaults/main.yml").read_text())
    assert CONTEXT.compile_cache_dir == defaults["vllm_serve_compile_cache_dir"]
    assert CONTEXT.neo_cache_max_bytes == defaults["vllm_serve_compile_cache_neo_max_bytes"]
    moved = render_xpu_container(recipe, CONTEXT.model_copy(update={"compile_cache_dir": "/srv/cache/",
                                                                    "neo_cache_max_bytes": 2**30}), host)
    volumes = docker_options(moved.docker_args)["-v"]
    assert "/srv/cache/neo:/var/cache/b70/neo" in volumes and moved.env["NEO_CACHE_MAX_SIZE"] == str(2**30), NEO
    off = render_xpu_container(recipe, CONTEXT.model_copy(update={"compile_cache_dir": ""}), host)
    assert "-v" not in docker_options(off.docker_args)
    assert not {fact.key for fact in COMPILE_CACHES} & set(off.env)
    for bad in ("relative/dir", "/a:b"):
        with pytest.raises(ValueError, match="compile_cache_dir"):
            ServeContext(model_dir="/m", compile_cache_dir=bad)


def test_serve_render_cli_prints_the_rendered_command(tmp_path: Path) -> None:
    """`b70ctl serve render --recipe X --topology FILE` on the no-P2P host: the topology file written by `b70ctl
    host topology --write`, the JSON the vllm_serve role consumes."""
    root = build_tree(tmp_path, "b70x2-root-ports")
    runner = CliRunner()
    written = runner.invoke(app, ["host", "topology", "--root", root, "--tensor-parallel-size", "2",
                                  "--probe", "never", "--write", "--json"])
    assert written.exit_code == 0, written.output
    path = Path(root) / TOPOLOGY_PATH.lstrip("/")
    result = runner.invoke(app, ["serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", str(path), "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert set(printed) == {"argv", "env", "docker_args", "prefix_caching"}
    assert printed == render_xpu_container(load_recipe("pr620-fp8-tp2"), CONTEXT, load_topology(path)).model_dump()
    # Spot checks straight on the CLI's JSON (the full table is above).
    seen = observed(ServeCommand.model_validate(printed))
    assert seen["flag"]["--tensor-parallel-size"] == "2" and seen["spec"]["num_speculative_tokens"] == 4
    assert seen["env"]["ZE_AFFINITY_MASK"] == "0,1" and seen["env"]["CCL_TOPO_P2P_ACCESS"] == "0"
    assert seen["env"]["CCL_SYCL_ALLTOALL_TMP_BUF"] == "1" and seen["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert seen["docker"]["--cap-add"] == ["SYS_PTRACE"] and seen["docker"]["--ipc"] == ["host"]
    # The role passes its compile cache directory and NEO cap; a directory docker -v cannot take is exit 2.
    moved = runner.invoke(app, ["serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", str(path), "--json",
                                "--compile-cache-dir", "/srv/b70-cache", "--neo-cache-max-bytes", "1024"])
    assert moved.exit_code == 0, moved.output
    moved_seen = observed(ServeCommand.model_validate(json.loads(moved.stdout)))
    assert "/srv/b70-cache/triton:/var/cache/b70/triton" in moved_seen["docker"]["-v"], TRITON
    assert moved_seen["env"]["NEO_CACHE_MAX_SIZE"] == "1024", NEO
    bad = runner.invoke(app, ["serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", str(path),
                              "--compile-cache-dir", "cache"])
    # BadInput (main() turns it into exit 2), naming the flag and the fix.
    assert isinstance(bad.exception, BadInput) and "--compile-cache-dir" in str(bad.exception), bad.output
    assert "give an absolute directory" in str(bad.exception)


def test_serve_render_cli_needs_the_topology_for_xpu() -> None:
    result = CliRunner().invoke(app, ["serve", "render", "--recipe", "pr620-fp8-tp2"])
    assert result.exit_code != 0
    assert "--topology" in str(result.exception) + result.output


def test_tp2_on_a_one_card_host_is_refused(tmp_path: Path) -> None:
    """`host topology --write` refuses to write such a group; the document topology.py prints (the gpu_topology
    role writes that itself) still holds it, and the renderer refuses it too."""
    root = build_tree(tmp_path, "b70-igpu")
    with pytest.raises(TopologyRefused, match="tensor-parallel size 2 but 1 usable GPU"):
        topology(root, 2, probe="never", write=True)
    printed = topology(root, 2, probe="never")
    host = TopologyDocument.model_validate({key: value for key, value in printed.items()
                                            if key not in ("changed", "path")})
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        render_xpu_container(load_recipe("pr620-fp8-tp2"), CONTEXT, host)


# ---- the embedded default: cpu-tiny at TP=2 on vLLM CPU (docs/facts.md, "Added after the first release")
CPU_TP2 = "Added after the first release: vLLM 0.32 CPU serves tensor parallel on this kind of machine: " \
    "`--tensor-parallel-size 2 --distributed-executor-backend mp` with `VLLM_CPU_OMP_THREADS_BIND=\"0|1\"` (one core " \
    "per rank, gloo), with draft_model k=4 speculation"
CPU_BASELINE = "Added after the first release: Beside it a TP=1 target-only baseline on the same 2 cores: ... greedy " \
    "outputs 5/5 token-identical (TP=2 speculative vs TP=1 baseline)"
OMP_BIND_PER_RANK = "vLLM 0.32 utils/ompmultiprocessing.py: `omp_cpuids_list = vllm_mask.split(\"|\")` ... `assert " \
    "len(omp_cpuids_list) == self.local_world_size` (one CPU list per rank; \"auto\" when unset)"
CPU_SPECULATIVE = [
    Fact("flag", "--tensor-parallel-size", "2", CPU_TP2),
    Fact("flag", "--distributed-executor-backend", "mp", CPU_TP2),
    Fact("env", "VLLM_CPU_OMP_THREADS_BIND", "0|1", CPU_TP2),
    Fact("spec", "method", "draft_model", CPU_TP2),
    Fact("spec", "num_speculative_tokens", 4, CPU_TP2),
]
CPU_BASELINE_FACTS = [
    Fact("flag", "--tensor-parallel-size", ABSENT, CPU_BASELINE + " (vLLM's default TP is 1)"),
    Fact("flag", "--distributed-executor-backend", ABSENT, CPU_BASELINE + " (one worker)"),
    Fact("env", "VLLM_CPU_OMP_THREADS_BIND", ABSENT, OMP_BIND_PER_RANK + ": \"0|1\" names two ranks, TP=1 has one"),
    Fact("flag", "--speculative-config", ABSENT, CPU_BASELINE + " (target-only)"),
]


def mismatches(command: ServeCommand, facts: list[Fact]) -> list[str]:
    seen = observed(command)
    return [f"{fact.kind} {fact.key}: rendered {seen[fact.kind].get(fact.key, ABSENT)!r}, expected {fact.value!r}\n"
            f"    source: {fact.source}" for fact in facts if seen[fact.kind].get(fact.key, ABSENT) != fact.value]


def test_cpu_tiny_serves_tp2_speculative_beside_a_tp1_baseline() -> None:
    recipe = load_recipe("cpu-tiny")
    speculative = render_serve(recipe, CONTEXT)
    baseline = render_serve(recipe, CONTEXT.model_copy(update={"speculative": False}))
    wrong = mismatches(speculative, CPU_SPECULATIVE) + mismatches(baseline, CPU_BASELINE_FACTS)
    assert not wrong, "\n".join(wrong)
    ranks = int(flags(speculative.argv)["--tensor-parallel-size"])
    assert len(speculative.env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == ranks, OMP_BIND_PER_RANK
    # Otherwise the same target server: same model, dtype, length and env but for the rank binding.
    drop = {"--tensor-parallel-size", "--distributed-executor-backend", "--speculative-config"}
    assert {k: v for k, v in flags(speculative.argv).items() if k not in drop} == flags(baseline.argv)
    assert {k: v for k, v in speculative.env.items() if k != "VLLM_CPU_OMP_THREADS_BIND"} == baseline.env


def test_cpu_container_gives_the_tp_ranks_shared_memory() -> None:
    """The TP ranks exchange activations through vLLM's shared-memory communicator (vLLM 0.32
    distributed/device_communicators/cpu_communicator.py: `init_shm_manager` for the tp group) and the executor
    talks to its workers through shared-memory message queues: both live in the container's /dev/shm, which docker
    caps at 64 MiB unless told."""
    recipe = load_recipe("cpu-tiny")
    for speculative in (True, False):
        command = render_container(recipe, CONTEXT.model_copy(update={"speculative": speculative}), None)
        options = docker_options(command.docker_args)
        assert options["--shm-size"] == ["1g"] and options["--network"] == ["host"]
        assert command.argv == render_serve(recipe, CONTEXT.model_copy(update={"speculative": speculative})).argv


def test_a_local_server_refuses_cores_this_machine_does_not_give_it(tmp_path: Path) -> None:
    """vLLM 0.32 envs.py: "CPU core ids bound by OpenMP threads, e.g., "0-31", "0,1,2", "0-31,33". CPU cores of
    different ranks are separated by '|'." A rank bound to a core the process may not use is refused before start,
    naming the cores."""
    assert bound_cores("0|1") == {0, 1} and bound_cores("0-2,5|7") == {0, 1, 2, 5, 7} and bound_cores("auto") == set()
    absent = max(os.sched_getaffinity(0)) + 1
    command = ServeCommand(argv=[], env={"VLLM_CPU_OMP_THREADS_BIND": f"0|{absent}"})
    server = LocalServer("tp2", command, python="/nonexistent/python", port=1, log_path=tmp_path / "tp2.log")
    with pytest.raises(BadInput, match=rf"CPU cores \[{absent}\]"):
        server.start()
    assert server.process is None


def docker_cli_path_error(value: str) -> str | None:
    """docker/cli opts validatePath, the rule `-v` and `--device` values pass through: more than two ':' is "bad
    format for path", three parts make the third the mode (rw/ro/... for volumes, r/w/m for devices)."""
    if value.count(":") > 2:
        return f"bad format for path: {value}"
    parts = value.split(":", 2)
    if len(parts) == 3 and not set(parts[2].split(",")) <= {"ro", "rw", "z", "Z", "r", "w", "m", "rwm"}:
        return f"bad mode specified: {parts[2]}"
    return None


@pytest.mark.parametrize("recipe_name, scenario, profile, facts", CASES, ids=CASE_IDS)
def test_every_rendered_path_option_is_one_docker_accepts(tmp_path: Path, recipe_name: str, scenario: str,
                                                          profile: str, facts: list[Fact]) -> None:
    """The by-path names hold three ':' each: passed as `--device` they made docker exit 125 ("docker: bad mode
    specified: 00.0-card.", this project's CI). No `-v` or `--device` value may trip docker's own rule."""
    assert docker_cli_path_error("/dev/dri/by-path/pci-0000:03:00.0-card") == "bad mode specified: 00.0-card"
    recipe = load_recipe(recipe_name)
    _, host = written_topology(tmp_path, scenario, recipe.serve.tensor_parallel_size)
    options = docker_options(render_xpu_container(recipe, CONTEXT, host).docker_args)
    for name in ("-v", "--device"):
        for value in options.get(name, []):
            assert docker_cli_path_error(value) is None, (name, value)


# ---- prefix caching with speculation on a hybrid target ----------------------------------------------------------
def _prefix_flags(argv: list[str]) -> list[str]:
    return [flag for flag in argv if flag in ("--enable-prefix-caching", "--no-enable-prefix-caching")]


@pytest.mark.parametrize(("recipe_name", "expected"), [
    # Qwen3.8 (GDN + attention) speculating on 0.29 and 0.30: vLLM's own default would be on (0.29.0
    # config/model.py is_prefix_caching_supported: "Generative hybrid models support prefix caching").
    ("dspark-int4-tp1", ["--no-enable-prefix-caching"]),
    ("mtp3-int4-tp2", ["--no-enable-prefix-caching"]),  # the record ran with it on: off until the probe passed
    ("mtp8-fp8-tp2", ["--no-enable-prefix-caching"]),  # the recipe's own choice, no note
    ("pr620-fp8-tp2", []),  # vLLM 0.21: before hybrid models had it on by default
    ("cpu-tiny", []),  # not hybrid
])
def test_a_speculating_hybrid_target_serves_without_prefix_caching_until_the_probe_passed(
        recipe_name: str, expected: list[str]) -> None:
    recipe = load_recipe(recipe_name)
    command = render_serve(recipe, CONTEXT)
    assert _prefix_flags(command.argv) == expected
    forced = recipe.serve.enable_prefix_caching is not False and expected == ["--no-enable-prefix-caching"]
    assert (command.prefix_caching is not None) == forced
    if forced:
        assert command.prefix_caching.startswith("off: a hybrid target speculating on vLLM >= 0.28.1")
    # The target-only baseline is the same server without speculation: the same setting, the same note.
    baseline = render_serve(recipe, CONTEXT.model_copy(update={"speculative": False}))
    assert (_prefix_flags(baseline.argv), baseline.prefix_caching) == (expected, command.prefix_caching)


def test_after_the_probe_passed_the_recipe_decides_and_the_command_line_says_so() -> None:
    passed = CONTEXT.model_copy(update={"prefix_cache_probe_passed": True})
    record = render_serve(load_recipe("mtp3-int4-tp2"), passed)
    assert _prefix_flags(record.argv) == ["--enable-prefix-caching"]
    assert record.prefix_caching.startswith("on: the gate's prefix-cache probe passed")
    dspark = render_serve(load_recipe("dspark-int4-tp1"), passed)
    assert _prefix_flags(dspark.argv) == [] and dspark.prefix_caching is None  # vLLM's default, on



def test_the_role_s_probe_flag_reaches_the_render(tmp_path: Path) -> None:
    root, _ = written_topology(tmp_path, "b70x2-switch", 1)
    path = Path(root) / TOPOLOGY_PATH.lstrip("/")
    runner = CliRunner()
    for extra, expected in (([], ["--no-enable-prefix-caching"]), (["--prefix-cache-probe-passed"], [])):
        done = runner.invoke(app, ["serve", "render", "--recipe", "dspark-int4-tp1", "--topology", str(path),
                                   "--json", *extra])
        assert done.exit_code == 0, done.output
        assert _prefix_flags(json.loads(done.stdout)["argv"]) == expected
    render_yml = (REPO / "roles/vllm_serve/tasks/render.yml").read_text()
    assert "(['--prefix-cache-probe-passed'] if vllm_serve_prefix_cache_probe_passed | bool else [])" in render_yml


def test_the_report_says_why_prefix_caching_is_off() -> None:
    """serve.json's prefix_caching reaches the report's configuration section through the host's environment."""
    from datetime import UTC, datetime

    from b70ctl.report.markdown import render_markdown
    from b70ctl.report.model import Environment, Report

    recipe = load_recipe("dspark-int4-tp1")
    why = render_serve(recipe, CONTEXT).prefix_caching
    report = Report(tool_version="test", recipe=recipe.name, endpoint="http://127.0.0.1:8000",
                    started_at=datetime.now(UTC), environment=Environment(serve_prefix_caching=why))
    assert f"Prefix caching: {why}." in render_markdown(report, recipe)


def test_one_card_per_worker_reaches_the_unit_s_environment_file(tmp_path: Path) -> None:
    """serve.worker_card_visibility: own is B70_WORKER_OWN_CARD=1 in the container's env (the unit's --env-file),
    which route a's patch 0006 reads in the executor and in the XPU worker; the host's mask stays the group's."""
    recipe = load_recipe("pr620-fp8-tp2")
    _, host = written_topology(tmp_path, "b70x2-switch", recipe.serve.tensor_parallel_size)
    shared = render_xpu_container(recipe, CONTEXT, host)
    own = recipe.model_validate({**recipe.model_dump(), "serve": {**recipe.serve.model_dump(),
                                                                  "worker_card_visibility": "own"}})
    command = render_xpu_container(own, CONTEXT, host)
    assert "B70_WORKER_OWN_CARD" not in shared.env
    assert command.env == {**shared.env, "B70_WORKER_OWN_CARD": "1"}
    assert command.env["ZE_AFFINITY_MASK"] == "0,1" and command.argv == shared.argv
    assert "\nB70_WORKER_OWN_CARD=1\n" in env_file_text(command.env, "test")
