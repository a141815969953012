"""The directory of per-host reports the fleet aggregation reads, as collected on the controller.

    REPORTS_DIR/
      <host>/                 one directory per inventory host (its inventory_hostname)
        report.json           `b70ctl verify` report of that host (any known schema version)
        host_facts.json       optional: facts of the host, fills environment fields the report lacks
        unreachable.json      written INSTEAD of report.json when the host could not be verified
        (anything else, e.g. report.md and raw/, is ignored)
      .hidden/                ignored, as is a directory holding fleet.json (a fleet report's own output)

A host directory holds exactly one of report.json or unreachable.json. Both: the marker wins (the report is
taken to be stale from an earlier run) and the conflict is named in the fleet report. Neither: the host is named
as missing its report.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, ValidationError, create_model

from b70ctl.documents import Read
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import MAX_DOCUMENT_BYTES, read_json_object
from b70ctl.report.load import MAX_REPORT_BYTES
from b70ctl.report.model import HOST_FACT_FIELDS, Environment

if TYPE_CHECKING:
    from b70ctl.tune.model import TuneReport

REPORT_FILE = "report.json"
HOST_FACTS_FILE = "host_facts.json"
UNREACHABLE_FILE = "unreachable.json"
FLEET_JSON = "fleet.json"  # a directory holding one is a fleet report's output, not a host


class UnreachableMarker(Read):
    """unreachable.json: why a host has no report. Written by the verify play for a host that was unreachable
    or whose verify task failed before it wrote a report."""

    host: str | None = Field(None, description="Informational: the directory names the host")
    kind: Literal["unreachable", "failed"] = Field(
        "unreachable", description="unreachable: no connection; failed: a task failed before report.json existed"
    )
    stage: str | None = Field(None, description="The play or task that failed, e.g. 'verify' or 'gather facts'")
    reason: str = Field(description="The error Ansible reported, one line")
    recipe: str | None = None
    recorded_at: datetime | None = None


# host_facts.json: what the fleet report reads from a host's facts. Built from the report's Environment model, so
# each fact is declared once: a field added there is read from host_facts.json too, with the same type. Keys are
# those field names; any other key is ignored. Values from report.json win over these.
_HOST_FACT_FIELDS: dict[str, Any] = {name: (Environment.model_fields[name].annotation, None)
                                     for name in HOST_FACT_FIELDS}
HostFacts = create_model(
    "HostFacts",
    __base__=Read,
    __doc__="host_facts.json: the facts of one host, by the name of the report's Environment field they fill.",
    **_HOST_FACT_FIELDS,
)


def _read_json_object(path: Path, limit: int = MAX_DOCUMENT_BYTES) -> dict[str, Any]:
    """A host's JSON object, of at most `limit` bytes: each way it is not one is a BadInput line, which each reader
    below turns into its own one-line problem."""
    return read_json_object(path, str(path), "collect it again", limit)


def _short_error(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return first_problem(error)
    if isinstance(error, OSError):
        return error.strerror or str(error)
    if isinstance(error, BadInput):  # names the path already, as the line it goes into does
        return str(error).split(": ", 1)[-1]
    return str(error)


def read_marker(path: Path) -> UnreachableMarker | str:
    """The marker, or one line saying why it cannot be read."""
    try:
        return UnreachableMarker.model_validate(_read_json_object(path))
    except (OSError, UnicodeDecodeError, ValueError, ValidationError, BadInput) as error:
        return f"{path}: unreadable marker ({_short_error(error)})"


def read_host_facts(path: Path) -> BaseModel | str:
    """The host facts, or one line saying why they cannot be read."""
    try:
        return HostFacts.model_validate(_read_json_object(path))
    except (OSError, UnicodeDecodeError, ValueError, ValidationError, BadInput) as error:
        return f"{path}: host facts not used ({_short_error(error)})"


TUNE_FILE = "tune/tune.json"  # `b70ctl tune` of the host (playbooks/tune.yml), beside its report


def read_tune(path: Path) -> TuneReport | str:
    """The host's tune report, or one line saying why it cannot be read."""
    from b70ctl.tune.model import TuneReport

    try:
        return TuneReport.model_validate(_read_json_object(path, MAX_REPORT_BYTES))
    except (OSError, UnicodeDecodeError, ValueError, ValidationError, BadInput) as error:
        return f"{path}: tune report not used ({_short_error(error)})"
