"""What the image tests share: the route-a series, the shipped locks resolved offline, and the docker engine the
real builds use (its fixtures, `engine` and `built_images`, are in conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from b70ctl.lock.model import Lock, build_lock, load_lock_file, lock_path_for
from b70ctl.recipes import load_recipe

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "images" / "xpu-dspark-0.21" / "patches" / "series"
DIGEST = "sha256:" + "ab" * 32


def resolved_lock(name: str, base_digest: str | None = DIGEST) -> Lock:
    """The shipped lock of a recipe with its image pin resolved to `base_digest` (as `lock resolve` would)."""
    lock = load_lock_file(lock_path_for(name))
    build = load_recipe(name).image.build
    assert build is not None, f"recipe {name} builds no image"
    image = lock.image.model_copy(update={"base_reference": build.base, "base_digest": base_digest, "resolved": True,
                                          "unresolved_reason": None})
    return build_lock(lock.recipe, lock.vllm_version, image, lock.patch_series, lock.target, lock.drafter)


def docker_client() -> Any:
    """A client of the docker engine that answers, or None (docker's SDK missing skips the test)."""
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException:
        return None
    return client


def started_engine() -> Any:
    """The engine the appliance test hosts use, started when none answers (safe to re-run when one does)."""
    client = docker_client()
    if client is None:
        subprocess.run([sys.executable, str(REPO / "scripts" / "testhosts"), "engine"], check=True)
        client = docker_client()
    assert client is not None, "scripts/testhosts engine started no reachable docker engine"
    return client
