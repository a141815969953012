"""Real vLLM (CPU build) serving the generated tiny Qwen3: a TP=1 baseline and three speculative servers at the
recipe's TP (2).

Started once per test session, side by side, and stopped at the end. Models are generated into the user's
cache (once per spec), so a second run skips the ~50 s of generation.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from b70ctl.checks.client import Endpoint
from b70ctl.recipes import load_recipe
from b70ctl.serve.local import LocalServer
from b70ctl.verify.embedded import default_cache_dir, ensure_models, start_servers

VARIANTS = ["baseline", "draft-exact", "draft-perturbed", "ngram"]
LOG_TAIL_LINES = 40

# The session's servers, for the failure reports below.
_started: dict[str, LocalServer] = {}


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test carries each server's state and the tail of its log: a server that died (killed for memory,
    an engine crash) is otherwise seen only as a refused connection or a stalled stream."""
    report = yield
    if report.failed and _started:
        for name, server in _started.items():
            state = "running" if server.process and server.process.poll() is None else (
                f"exited with code {server.process.returncode}" if server.process else "never started")
            try:
                tail = server.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            except OSError as error:
                tail = [f"(log unreadable: {error})"]
            report.sections.append((f"vLLM server {name}: {state}, {server.log_path}", "\n".join(tail)))
    return report


@pytest.fixture(scope="session")
def cpu_tiny():
    return load_recipe("cpu-tiny")


@pytest.fixture(scope="session")
def tiny_models(cpu_tiny) -> Path:
    models_dir = default_cache_dir() / "tiny-models"
    ensure_models(cpu_tiny, models_dir)
    return models_dir


@pytest.fixture(scope="session")
def local_servers(tiny_models, tmp_path_factory) -> dict[str, LocalServer]:
    """{variant: LocalServer} started here, once per session; empty when B70CTL_TEST_SERVERS names running ones."""
    if os.environ.get("B70CTL_TEST_SERVERS"):
        yield {}
        return
    servers = start_servers(VARIANTS, tiny_models, tmp_path_factory.mktemp("vllm-logs"))
    _started.update(servers)
    yield servers
    _started.clear()
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def vllm_urls(local_servers):
    """{variant: base URL} for baseline, draft-exact (acceptance ~100%), draft-perturbed, ngram.

    B70CTL_TEST_SERVERS="baseline=http://127.0.0.1:8101,draft-exact=...,..." reuses servers already running
    (started with `python -m b70ctl.verify.embedded serve`), which saves minutes when iterating on one test."""
    given = os.environ.get("B70CTL_TEST_SERVERS")
    if given:
        urls = dict(item.split("=", 1) for item in given.split(","))
        missing = set(VARIANTS) - set(urls)
        assert not missing, f"B70CTL_TEST_SERVERS lacks {sorted(missing)}"
        return urls
    return {name: server.url for name, server in local_servers.items()}


@pytest.fixture(scope="session")
def endpoints(vllm_urls, cpu_tiny) -> dict[str, Endpoint]:
    """{variant: Endpoint} with the recipe's served model name."""
    return {name: Endpoint(url, model=cpu_tiny.serve.served_model_name, timeout_s=120)
            for name, url in vllm_urls.items()}
