"""How a run is stopped from outside: SIGTERM (systemd's stop, Ansible's timeout, a user's kill) becomes
Terminated in the main thread, so a command closes what it wrote (verify's report marked partial, a tune's unit
put back) and exits 143, as a shell reports a process SIGTERM ended."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from b70ctl.errors import CheckAborted


class Terminated(CheckAborted):
    """SIGTERM, as systemd and Ansible stop a run: it ends like an interrupt, with the report marked partial."""

    exit_code = 143


@contextmanager
def sigterm_ends_the_run() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread while the run lasts, so what it wrote is closed
    (a report marked partial, a unit put back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(_signum: int, _frame: object) -> None:
        # One SIGTERM ends the run; a second (systemd's, Ansible's, a user's) must not cut the closing of the
        # report the first one started.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
