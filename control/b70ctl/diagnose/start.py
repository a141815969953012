"""A serving start that failed: each unit's journal diagnosed against the catalogue, the failure the no-p2p profile
fixes (the serve gate's fallback), and the one message the serve play fails with.

`b70ctl diagnose --start -` reads a FailedStart document, which the vllm_serve role passes on as Ansible gave it:
the read of the units' journals (b70host.journal's run, as registered), the failed task and its result, and whether
a fallback preceded it. Nothing here runs a command: the role reads the journals on the host before it rolls
back, and this module only reads what it was given.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from b70ctl.diagnose.catalogue import load_catalogue
from b70ctl.diagnose.collect import lines_from_text
from b70ctl.diagnose.match import diagnose_lines
from b70ctl.diagnose.model import Match
from b70ctl.documents import Document, Read
from b70ctl.errors import first_problem
from b70host.topology import FALLBACK_PATH

# How much of the failure's reason and of each log line the message keeps: the play's output is read in a terminal.
REASON_CHARS = 200
LOG_LINE_CHARS = 300
# Per unit: the last lines that name an error (vLLM's own reason), else the last lines at all.
ERROR_LINES = 3
TAIL_LINES = 6
ERROR_MARKERS = ("Error: ", "Exception: ")
# Lines every rollback prints and no diagnosis needs: docker's answer to stopping a container that is already gone.
NOISE = "No such container"


class UnitJournal(Document):
    unit: str
    lines: list[str] = Field(default_factory=list)
    error: str | None = Field(None, description="What journalctl said when it could not read the unit")


class Journal(Document):
    """b70host.journal's output."""

    units: list[UnitJournal]


class JournalRead(Read):
    """The role's run of b70host.journal as Ansible registered it, passed on whole: the journals when it printed
    them, else what it said instead (a start must still fail with a message when its logs cannot be read)."""

    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    # When the module itself could not run (no interpreter on the host): Ansible's message and the shell's error.
    msg: str = ""
    module_stderr: str = ""

    def journal(self) -> Journal | str:
        """The journals, or why there are none: the run's exit and last line of error, or what was wrong with what
        it printed."""
        if self.rc is None:  # skipped, or a result without an exit status
            return f"b70host.journal did not run ({shorten(self.msg.strip() or 'no exit status', REASON_CHARS)})"
        if self.rc != 0:
            # A Python error's last line is the exception; a shell's first line is what it could not run.
            said = (self.stderr.strip().splitlines()[-1:] or self.module_stderr.strip().splitlines()[:1]
                    or [self.msg.strip() or "it said nothing"])[0]
            return f"b70host.journal exited {self.rc}: {shorten(said, REASON_CHARS)}"
        try:
            return Journal.model_validate_json(self.stdout)
        except ValidationError as error:
            return f"b70host.journal printed no journal document: {first_problem(error)}"


class FailedStart(Document):
    host: str = Field(min_length=1, description="The inventory name of the host whose start failed")
    journal: JournalRead
    failed_task: str = Field("", description="The name of the task that failed (Ansible's ansible_failed_task.name)")
    failed_result: dict[str, Any] = Field(default_factory=dict,
                                          description="Its result, as Ansible gave it (ansible_failed_result)")
    health_timeout_s: int = Field(ge=0)
    fell_back: str | None = Field(None, description="The failure a p2p start died at, when the no-p2p restart "
                                                    "failed too")


class UnitDiagnosis(Document):
    unit: str
    failures: list[Match]
    last_lines: list[str] = Field(description="What the message quotes of the unit's log")


class StartDiagnosis(Document):
    units: list[UnitDiagnosis]
    no_p2p_failure: Match | None = Field(description="The first failure whose fix is the no-p2p profile: the serve "
                                                      "gate restarts a p2p start once with no-p2p when one is found")
    message: str

    @property
    def found_failure(self) -> bool:
        return any(unit.failures for unit in self.units)


def shorten(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def failure_reason(result: dict[str, Any]) -> str:
    """The message of the failed result, or of the first failed item of a loop's."""
    items = result.get("results")
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("failed") and item.get("msg"):
                return str(item["msg"])
    return str(result.get("msg") or "")


def last_lines(lines: list[str]) -> list[str]:
    errors = [line for line in lines if any(marker in line for marker in ERROR_MARKERS) and NOISE not in line]
    unique = list(dict.fromkeys(errors))
    chosen = unique[-ERROR_LINES:] or lines[-TAIL_LINES:]
    return [shorten(line, LOG_LINE_CHARS) for line in chosen]


def fix_text(match: Match) -> str:
    text = f"{match.id}: {match.fix.text}"
    if match.fix.command:
        text += f" Command: {match.fix.command}"
    if match.fix.env:
        text += " Env: " + " ".join(f"{name}={value}" for name, value in sorted(match.fix.env.items()))
    return text


def diagnose_start(start: FailedStart, last_good: bool | None = None) -> StartDiagnosis:
    """last_good: whether the rollback put the last healthy configuration back and restarted it (False: none
    existed); None before the rollback. The role's second call says it (--last-good/--no-last-good): the document
    is what failed, read before the rollback changed anything."""
    catalogue = load_catalogue()
    journal = start.journal.journal()
    units = []
    for read in journal.units if isinstance(journal, Journal) else []:
        where = f"{start.host}:{read.unit}"
        diagnosis = diagnose_lines(catalogue, lines_from_text("\n".join(read.lines), where), [where])
        shown = last_lines(read.lines) or [f"(journalctl: {shorten(read.error, LOG_LINE_CHARS)})" if read.error
                                           else "(no lines)"]
        units.append(UnitDiagnosis(unit=read.unit, failures=diagnosis.failures, last_lines=shown))
    no_p2p = next((match for unit in units for match in unit.failures if match.fix.profile == "no-p2p"), None)
    unread = journal if isinstance(journal, str) else None
    return StartDiagnosis(units=units, no_p2p_failure=no_p2p, message=message(start, units, last_good, unread))


def message(start: FailedStart, units: list[UnitDiagnosis], last_good: bool | None, unread: str | None) -> str:
    """unread: why the units' journals could not be read, when they could not."""
    reason = shorten(failure_reason(start.failed_result), REASON_CHARS)
    parts = [f"{start.host}: vLLM is not serving: {start.failed_task or 'starting it'} failed "
             f"({reason + '; ' if reason else ''}health timeout {start.health_timeout_s} s)."]
    if start.fell_back:
        parts.append(f"It had been restarted once with no-p2p after the p2p start died at {start.fell_back} "
                     f"({FALLBACK_PATH}); that start failed too.")
    if last_good is not None:
        parts.append("The last healthy configuration was put back and restarted." if last_good
                     else "No earlier healthy configuration exists to put back.")
    if unread is not None:
        parts.append(f"The units' journals could not be read on the host ({unread}).")
    else:
        parts.append("Last log lines: " + " ".join(f"[{unit.unit}] {' | '.join(unit.last_lines)}" for unit in units))
    found = [f"[{unit.unit}] {fix_text(match)}" for unit in units for match in unit.failures]
    parts.append("Diagnosis: " + (" ".join(found) if found else "no known failure matched (b70ctl diagnose)."))
    first = units[0].unit if units else "b70-vllm"
    parts.append(f"Fix: read `journalctl -u {first}` on the host, correct the setting, run the play again.")
    return " ".join(parts)
