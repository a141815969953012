"""`b70ctl diagnose`: read logs (files, a local unit, a remote host over SSH), name each known failure with its
evidence and fix. Exit 0 nothing known matched, 1 a known failure was found, 2 bad input or unreachable."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from itertools import chain
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from b70ctl.diagnose.catalogue import load_catalogue
from b70ctl.diagnose.collect import collect_unit, local_runner, ssh_runner, stream_log
from b70ctl.diagnose.match import diagnose_lines
from b70ctl.diagnose.model import Diagnosis, Fix, LogLine
from b70ctl.diagnose.start import FailedStart, diagnose_start
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import read_json_object
from b70ctl.options import json_option

DEFAULT_UNIT = "b70-vllm"


def run_diagnosis(logs: list[str], unit: str | None, ssh: str | None, topology: Path | None) -> Diagnosis:
    if not logs and unit is None and ssh is None:
        raise BadInput("nothing to read: give --log FILE (or - for stdin), --unit NAME or --ssh HOST")
    if ssh is not None and logs:
        raise BadInput("--ssh reads the remote unit's journal; --log files are local: give one or the other")
    # Each log is opened (or refused) now and read while it is matched, a line at a time: memory stays bounded.
    streams: list[Iterable[LogLine]] = [stream_log(path) for path in logs]
    names: list[str] = ["stdin" if path == "-" else path for path in logs]
    lines: list[LogLine] = []
    if ssh is not None:
        run, close = ssh_runner(ssh)
        try:
            found, read = collect_unit(run, unit or DEFAULT_UNIT, where=ssh)
        finally:
            close()
        lines += found
        names += read
    elif unit is not None:
        found, read = collect_unit(local_runner, unit)
        lines += found
        names += read
    profile: str | None = None
    profile_source: str | None = None
    if topology is not None:
        from b70ctl.host.model import load_topology

        document = load_topology(topology)
        profile, profile_source = document.profile, document.profile_source
        if document.auto_profile != document.profile:
            profile_source = f"override (the topology alone gives {document.auto_profile})"
    return diagnose_lines(load_catalogue(), chain(*streams, lines), names, profile=profile,
                          profile_source=profile_source,
                          auto_profile=document.auto_profile if topology is not None else None)


def read_failed_start(source: str) -> FailedStart:
    where = "--start" if source == "-" else f"--start {source}"
    fix = "pass the vllm_serve role's document (the units' journals from b70host.journal, the failed task)"
    try:
        return FailedStart.model_validate(read_json_object(source, where, fix))
    except ValidationError as error:
        raise BadInput(f"{where}: {first_problem(error)}: {fix}") from error


def render_fix(fix: Fix, out: Console, indent: str) -> None:
    out.print(f"{indent}[bold green]fix:[/] {escape(fix.text)}", highlight=False)
    if fix.profile:
        out.print(f"{indent}  oneCCL profile: {fix.profile}", highlight=False)
    for name, value in fix.env.items():
        out.print(f"{indent}  env {name}={value}", highlight=False)
    if fix.command:
        out.print(f"{indent}  command: {escape(fix.command)}", highlight=False)


def render(diagnosis: Diagnosis, out: Console) -> None:
    for match in diagnosis.failures:
        out.print(f"[bold red]FAILURE[/] [bold]{match.id}[/]: {escape(match.title)}")
        for line in match.evidence:
            out.print(f"  {escape(line.log)}:{line.number}: {escape(line.text.strip()[:400])}", highlight=False)
        if match.evidence_count > len(match.evidence):
            out.print(f"  ... {match.evidence_count - len(match.evidence)} more matching line(s)")
        out.print(f"  meaning: {escape(match.meaning)}", highlight=False)
        if match.causes:
            out.print(f"  {len(match.causes)} settled causes, most likely first (how to tell them apart):",
                      highlight=False)
            for number, cause in enumerate(match.causes, 1):
                out.print(f"  {number}. [bold]{escape(cause.cause)}[/]", highlight=False)
                out.print(f"     how to tell: {escape(cause.how_to_tell)}", highlight=False)
                render_fix(cause.fix, out, indent="     ")
        else:
            render_fix(match.fix, out, indent="  ")
        out.print(f"  source: {escape('; '.join(source.ref for source in match.sources))}", highlight=False)
    for contradiction in diagnosis.contradictions:
        out.print(f"[bold red]CONTRADICTION[/] {escape(contradiction.text)}", highlight=False)
    for match in diagnosis.harmless:
        out.print(f"[dim]harmless[/] {match.id}: {escape(match.title)} ({match.evidence_count} line(s)): "
                  f"{escape(match.meaning)}", highlight=False)
    count = len(diagnosis.failures)
    out.print(f"{count} known failure(s)" + (f", {len(diagnosis.contradictions)} contradiction(s)"
                                             if diagnosis.contradictions else "")
              + f" in {diagnosis.lines_read} line(s) of {', '.join(diagnosis.logs) or 'nothing'}"
              if count or diagnosis.contradictions else
              f"no known failure in {diagnosis.lines_read} line(s) of {', '.join(diagnosis.logs)}", highlight=False)


def diagnose_command(
    log: Annotated[list[str] | None, typer.Option(
        "--log", help="A serve or kernel log, or a verify report.json; - reads stdin (repeatable)")] = None,
    unit: Annotated[str | None, typer.Option(
        help=f"systemd unit whose journal to read, with the kernel log around it (with --ssh: default {DEFAULT_UNIT})")
    ] = None,
    ssh: Annotated[str | None, typer.Option(
        help="Read the unit's journal on this host over SSH (honours ~/.ssh/config and the agent)")] = None,
    topology: Annotated[Path | None, typer.Option(
        help="The host's topology.json: say when its oneCCL profile contradicts what the logs show")] = None,
    start: Annotated[str | None, typer.Option(
        help="A failed serving start (the vllm_serve role's document; - reads stdin): diagnose each unit's journal "
             "and print the message the serve play fails with")] = None,
    last_good: Annotated[bool | None, typer.Option(
        "--last-good/--no-last-good",
        help="With --start: the rollback put the last healthy configuration back and restarted it, or none existed "
             "(the message says which; without either it is the message before the rollback)")] = None,
    as_json: Annotated[bool, json_option("Print the diagnosis as JSON")] = False,
) -> None:
    """Name each known failure in serve logs, kernel logs or a verify report, with the evidence and the fix.

    Exit 0 when nothing known matched, 1 when a known failure was found, 2 on bad input or an unreachable host."""
    if start is not None:
        if log or unit or ssh or topology:
            raise BadInput("--start reads the journals its document carries: give it without --log, --unit, --ssh "
                           "and --topology")
        found = diagnose_start(read_failed_start(start), last_good)
        sys.stdout.write(found.model_dump_json(indent=2) + "\n" if as_json else found.message + "\n")
        raise typer.Exit(1 if found.found_failure else 0)
    if last_good is not None:
        raise BadInput("--last-good/--no-last-good say how a failed start's rollback ended: give them with --start")
    diagnosis = run_diagnosis(list(log or []), unit, ssh, topology)
    if as_json:
        sys.stdout.write(diagnosis.model_dump_json(indent=2) + "\n")
    else:
        render(diagnosis, Console(soft_wrap=True))
    raise typer.Exit(1 if diagnosis.found_failure else 0)
