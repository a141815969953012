"""Real vLLM (CPU build) serving the generated tiny Qwen3: one baseline and three speculative servers.

Started once per test session, side by side, and stopped at the end. Models are generated into the user's
cache (once per spec), so a second run skips the ~50 s of generation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from b70ctl.checks.client import Endpoint
from b70ctl.embedded import default_cache_dir, ensure_models, start_servers
from b70ctl.recipes import load_recipe

VARIANTS = ["baseline", "draft-exact", "draft-perturbed", "ngram"]


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def cpu_tiny():
    return load_recipe("cpu-tiny")


@pytest.fixture(scope="session")
def tiny_models(cpu_tiny) -> Path:
    models_dir = default_cache_dir() / "tiny-models"
    ensure_models(cpu_tiny, models_dir)
    return models_dir


@pytest.fixture(scope="session")
def vllm_servers(tiny_models, tmp_path_factory):
    """{variant: LocalServer} for baseline, draft-exact (acceptance ~100%), draft-perturbed, ngram."""
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    servers = start_servers(VARIANTS, tiny_models, log_dir)
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def endpoints(vllm_servers, cpu_tiny) -> dict[str, Endpoint]:
    """{variant: Endpoint} with the recipe's served model name."""
    return {name: Endpoint(server.url, model=cpu_tiny.serve.served_model_name, timeout_s=120)
            for name, server in vllm_servers.items()}
