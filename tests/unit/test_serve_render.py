"""The serve command of the B70 recipes on the P2P and no-P2P fixture hosts, flag by flag against FACTS.md."""

from __future__ import annotations

import json

import pytest
from sysfs_trees import build_tree

from b70ctl.host.facts import collect_facts
from b70ctl.host.model import TopologyDocument
from b70ctl.host.topology import analyse
from b70ctl.recipes import load_recipe
from b70ctl.serve.render import ServeContext, render_serve, render_xpu_container

CONTEXT = ServeContext(model_dir="/models/target", drafter_dir="/models/drafter", host="0.0.0.0", port=8000)

# FACTS.md, Serving (route a): the recipe's flags and env, and the oneCCL set of a P2P host.
PR620_FLAGS = {
    "--tensor-parallel-size": "2", "--gpu-memory-utilization": "0.90", "--max-model-len": "8192",
    "--max-num-batched-tokens": "4096", "--max-num-seqs": "1", "--block-size": "64", "--dtype": "bfloat16",
    "--mamba-ssm-cache-dtype": "float16",
}
PR620_ENV = {"ZE_AFFINITY_MASK": "0,1", "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_USE_AOT_COMPILE": "0",
             "VLLM_XPU_ENABLE_XPU_GRAPH": "0"}
P2P_CCL = {"CCL_TOPO_P2P_ACCESS": "1", "CCL_ZE_IPC_EXCHANGE": "drmfd", "CCL_SYCL_ALLGATHERV_TMP_BUF": "0",
           "CCL_SYCL_ALLREDUCE_TMP_BUF": "0", "CCL_ENABLE_SYCL_KERNELS": "1",
           "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": "131072", "CCL_SYCL_ALLGATHERV_SCALEOUT_THRESHOLD": "1048576"}
NO_P2P_CCL = {"CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD": "4294967296",
              "CCL_SYCL_REDUCE_SCATTER_SIMPLE_THRESHOLD": "4294967296",
              "CCL_SYCL_ALLGATHERV_SIMPLE_THRESHOLD": "4294967296", "CCL_SYCL_ALLTOALL_TMP_BUF": "1"}


def host_topology(tmp_path, scenario: str) -> TopologyDocument:
    document = analyse(collect_facts(build_tree(tmp_path, scenario)), tensor_parallel_size=2)
    return TopologyDocument.model_validate(json.loads(json.dumps(document)))


def flags(argv: list[str]) -> dict[str, str | None]:
    parsed: dict[str, str | None] = {}
    for index, item in enumerate(argv):
        if item.startswith("--"):
            following = argv[index + 1] if index + 1 < len(argv) else None
            parsed[item] = None if following is None or following.startswith("--") else following
    return parsed


def test_pr620_on_a_p2p_host(tmp_path):
    command = render_xpu_container(load_recipe("pr620-fp8-tp2"), CONTEXT, host_topology(tmp_path, "b70x2-switch"))
    parsed = flags(command.argv)
    for flag, value in PR620_FLAGS.items():
        assert parsed[flag] == value, flag
    assert "--async-scheduling" in parsed
    assert json.loads(parsed["--speculative-config"]) == {"method": "dflash", "model": "/models/drafter",
                                                          "num_speculative_tokens": 4}
    assert command.env.items() >= {**PR620_ENV, **P2P_CCL}.items()
    assert not NO_P2P_CCL.keys() & command.env.keys()
    # BF16 kept (the recipe's dtype); the one-token ESIMD crash is sidestepped by env instead.
    assert command.env["DISABLE_ESIMD_PAGE_ATTN"] == "1"
    devices = [command.docker_args[i + 1] for i, a in enumerate(command.docker_args) if a == "--device"]
    assert len(devices) == 4 and all(d.startswith("/dev/dri/") for d in devices)
    assert {d.rsplit("/", 1)[1][:4] for d in devices} == {"card", "rend"}
    joined = " ".join(command.docker_args)
    for option in ("-v /dev/dri/by-path:/dev/dri/by-path:ro", "--network host", "--shm-size 32g", "--ipc=host"):
        assert option in joined
    assert "SYS_PTRACE" not in joined


def test_pr620_on_a_host_without_p2p(tmp_path):
    command = render_xpu_container(load_recipe("pr620-fp8-tp2"), CONTEXT,
                                   host_topology(tmp_path, "b70x2-root-ports"))
    assert command.env.items() >= {**PR620_ENV, **NO_P2P_CCL, "CCL_TOPO_P2P_ACCESS": "0"}.items()
    assert "CCL_ZE_IPC_EXCHANGE" not in command.env
    joined = " ".join(command.docker_args)
    assert "--cap-add SYS_PTRACE" in joined and "--ipc=host" in joined


def test_native_dspark_never_turns_off_the_v2_runner(tmp_path):
    command = render_xpu_container(load_recipe("dspark-int4-tp1"), CONTEXT, host_topology(tmp_path, "b70-igpu"))
    parsed = flags(command.argv)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in command.env
    assert json.loads(parsed["--speculative-config"]) == {
        "method": "dspark", "model": "/models/drafter", "num_speculative_tokens": 7,
        "draft_sample_method": "probabilistic"}
    assert (parsed["--kv-cache-dtype"], parsed["--block-size"], parsed["--max-model-len"],
            parsed["--max-num-seqs"]) == ("fp8", "64", "16384", "16")
    assert "--tensor-parallel-size" not in parsed


def test_tp2_on_a_one_card_host_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        render_xpu_container(load_recipe("pr620-fp8-tp2"), CONTEXT, host_topology(tmp_path, "b70-igpu"))


def test_baseline_is_the_same_server_without_speculation():
    recipe = load_recipe("cpu-tiny")
    speculative = render_serve(recipe, CONTEXT)
    baseline = render_serve(recipe, CONTEXT.model_copy(update={"speculative": False}))
    assert "--speculative-config" in speculative.argv and "--speculative-config" not in baseline.argv
    assert speculative.argv[:speculative.argv.index("--speculative-config")] == baseline.argv
