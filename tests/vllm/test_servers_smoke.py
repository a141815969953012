"""The real servers the other vllm tests rely on: each variant speculates the way it says it does."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from b70ctl.checks.client import VllmClient


def _spec_counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:{name}{{") or line.startswith(f"vllm:{name} "))


def test_variants_serve_and_speculate(endpoints):
    for name, endpoint in endpoints.items():
        with VllmClient(endpoint) as client:
            # Sentences of the corpus repeat their phrases, so the ngram proposer finds matches to draft from.
            result = client.stream("completions", "The scheduler", max_tokens=96, temperature=0.0,
                                   ignore_eos=True)
            assert result.error is None, (name, result.error)
            assert len(result.token_ids) == 96 == result.usage["completion_tokens"]
            drafts = _spec_counter(client.metrics_text(), "spec_decode_num_drafts_total")
            if name == "baseline":
                assert drafts == 0
            else:
                assert drafts > 0, f"{name} made no drafts"


def _workers(server) -> dict[str, str]:
    """{process title: cores it may run on} of the vLLM workers in the server's process group."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != server.process.pid:
                continue
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            status = (entry / "status").read_text()
        except (OSError, ProcessLookupError):
            continue
        if title.startswith("VLLM::Worker"):
            found[title] = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M).group(1)
    return found


def test_speculative_servers_run_two_tp_ranks_one_core_each(local_servers, cpu_tiny):
    """docs/facts.md (Added after the first release): vLLM 0.32 CPU serves `--tensor-parallel-size 2` with
    `VLLM_CPU_OMP_THREADS_BIND="0|1"` (one core per rank) beside a TP=1 target-only baseline. vLLM names each
    worker process `VLLM::Worker_TP<rank>` when TP > 1, `VLLM::Worker` otherwise (v1/executor/multiproc_executor.py),
    and OpenMP binds each rank to its cores (utils/ompmultiprocessing.py: OMP_PLACES, OMP_PROC_BIND)."""
    if not local_servers:
        pytest.skip("servers given by B70CTL_TEST_SERVERS: their processes are not ours to inspect")
    assert cpu_tiny.serve.tensor_parallel_size == 2
    for name, server in local_servers.items():
        workers = _workers(server)
        if name == "baseline":
            assert set(workers) == {"VLLM::Worker"}, (name, workers)
        else:
            assert workers == {"VLLM::Worker_TP0": "0", "VLLM::Worker_TP1": "1"}, (name, workers)
