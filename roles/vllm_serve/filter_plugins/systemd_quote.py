"""Filters writing values into a systemd unit so that systemd reads back exactly the value: b70ctl's own
(b70ctl.serve.unit), which also writes each unit's whole ExecStart, so the unit and a tune's drop-ins are quoted by
one function."""

from __future__ import annotations

from b70ctl.serve.unit import systemd_exec_argument, systemd_text


class FilterModule:
    def filters(self) -> dict[str, object]:
        return {"systemd_exec_argument": systemd_exec_argument, "systemd_text": systemd_text}
