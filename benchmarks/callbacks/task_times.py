"""Where a playbook run's wall time goes, task by task: an aggregate callback for benchmarks.

Enabled by benchmarks/host_stages_noop.py --profile (or by hand: ANSIBLE_CALLBACK_PLUGINS=benchmarks/callbacks
ANSIBLE_CALLBACKS_ENABLED=task_times). It writes one JSON document to $B70_TASK_TIMES (or prints the slowest tasks
when that is unset): the run's wall seconds from the process start, the seconds outside any task (Ansible's
imports, inventory and playbook parsing before the first; the recap after the last), and for every task the wall
seconds from its start to the next task's start (what the run waited on it, across all hosts), with the number of
hosts it ran on.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: task_times
type: aggregate
short_description: wall seconds per task, for the no-op benchmarks
description: Records each task's wall seconds (start to the next task's start) and writes them as JSON.
requirements: [enabled in callbacks_enabled]
"""


def process_start_monotonic() -> float:
    """When this process started, on the monotonic clock (Linux: /proc/self/stat field 22, in clock ticks)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic()


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        # CLOCK_BOOTTIME is what /proc/self/stat's start time counts from; monotonic differs by time suspended.
        self._clock = lambda: time.clock_gettime(time.CLOCK_BOOTTIME)
        self._process_start = process_start_monotonic()
        self._tasks: list[dict] = []
        self._play = ""
        self._current: dict | None = None

    def _close_current(self) -> None:
        if self._current is not None:
            self._current["wall_s"] = round(self._clock() - self._current.pop("_start"), 3)
            self._tasks.append(self._current)
            self._current = None

    def v2_playbook_on_play_start(self, play) -> None:
        self._close_current()
        self._play = play.get_name()

    def v2_playbook_on_task_start(self, task, is_conditional) -> None:
        self._close_current()
        self._current = {"play": self._play, "task": task.get_name(), "action": task.action, "hosts": 0,
                         "_start": self._clock()}

    v2_playbook_on_handler_task_start = v2_playbook_on_task_start

    def _count(self, result, *args, **kwargs) -> None:
        if self._current is not None:
            self._current["hosts"] += 1

    v2_runner_on_ok = v2_runner_on_failed = v2_runner_on_skipped = v2_runner_on_unreachable = _count

    def v2_playbook_on_stats(self, stats) -> None:
        self._close_current()
        now = self._clock()
        document = {"wall_s": round(now - self._process_start, 3), "tasks": self._tasks,
                    "tasks_s": round(sum(task["wall_s"] for task in self._tasks), 3)}
        document["outside_tasks_s"] = round(document["wall_s"] - document["tasks_s"], 3)
        target = os.environ.get("B70_TASK_TIMES")
        if target:
            Path(target).write_text(json.dumps(document, indent=1) + "\n")
            return
        self._display.display(f"task_times: {document['wall_s']} s, {document['outside_tasks_s']} s outside tasks "
                              "(start-up: imports, inventory, playbook parsing); slowest tasks:")
        for task in sorted(self._tasks, key=lambda task: -task["wall_s"])[:15]:
            self._display.display(f"  {task['wall_s']:7.2f} s  {task['hosts']:3d} host(s)  {task['play']} | "
                                  f"{task['task']}")
