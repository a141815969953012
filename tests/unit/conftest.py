"""What every unit test gets: a process whose secrets are its own, and the fixtures several test modules share.

b70ctl keeps the secrets of a run (an API key read with read_api_key, a URL's password) in one process-wide set,
emptied when a command ends (cli.main). Tests call the library directly, so nothing ends a "command" between them:
a key one test reads would otherwise make every later test on the same worker write its reports 0600."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from b70ctl.redact import forget_secrets
from image_fixtures import started_engine
from scripted_server import ScriptedServer
from store_fixtures import hub, hub_env, registry  # noqa: F401 - the store tests' fixtures, for every module here


@pytest.fixture(autouse=True)
def _no_secret_outlives_its_test() -> Iterator[None]:
    yield
    forget_secrets()


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    """A ScriptedServer on 127.0.0.1 for the test, stopped after it."""
    with ScriptedServer() as scripted:
        yield scripted


@pytest.fixture
def servers() -> Iterator[tuple[ScriptedServer, ScriptedServer]]:
    """A scripted server and its target-only baseline, as verify requires."""
    with ScriptedServer() as served, ScriptedServer() as baseline:
        baseline.speculates = False
        yield served, baseline


@pytest.fixture(scope="module")
def engine() -> Any:
    """The docker engine of the real image builds (scripts/testhosts engine starts one when none answers)."""
    return started_engine()


@pytest.fixture()
def built_images(engine: Any) -> Iterator[list[str]]:
    """Images a test builds, removed afterwards: a route-a image built on a stand-in base must not stay tagged as
    the recipe's image."""
    tags: list[str] = []
    yield tags
    for tag in tags:
        try:
            engine.images.remove(tag, force=True)
        except Exception:  # noqa: BLE001 - already gone or still referenced: nothing to clean
            pass
