"""What every unit test gets: a process whose secrets are its own, and the fixtures several test modules share.

b70ctl keeps the secrets of a run (an API key read with read_api_key, a URL's password) in one process-wide set,
emptied when a command ends (cli.main). Tests call the library directly, so nothing ends a "command" between them:
a key one test reads would otherwise make every later test on the same worker write its reports 0600."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scripted_server import ScriptedServer

from b70ctl.redact import forget_secrets


@pytest.fixture(autouse=True)
def _no_secret_outlives_its_test() -> Iterator[None]:
    yield
    forget_secrets()


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    """A ScriptedServer on 127.0.0.1 for the test, stopped after it."""
    with ScriptedServer() as scripted:
        yield scripted
