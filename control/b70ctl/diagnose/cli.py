"""`b70ctl diagnose`: read logs (files, a local unit, a remote host over SSH), name each known failure with its
evidence and fix. Exit 0 no failure seen, 1 a known failure was named, 2 bad input or unreachable, 3 a failure seen
whose cause is not known (only its layer's generic first step, or no layer: the decisive lines, their layer and the
versions the log shows are printed for a search of the right tracker)."""

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
from b70ctl.diagnose.codes import ResultCode, codes_in
from b70ctl.diagnose.collect import collect_unit, local_runner, log_size, ssh_runner, stream_log_batches
from b70ctl.diagnose.match import MAX_LINE_CHARS, LineBatch, diagnose_lines
from b70ctl.diagnose.model import Diagnosis, Fix, LogLine, Match
from b70ctl.diagnose.start import FailedStart, diagnose_start
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import read_json_object
from b70ctl.options import json_option

DEFAULT_UNIT = "b70-vllm"
# Exit codes beyond the usual 0/1/2: a failure is in the logs, and no entry knows its cause.
EXIT_CAUSE_UNKNOWN = 3
# Logs at least this large show a progress bar on stderr (when stderr is a terminal): they take seconds to read.
PROGRESS_MIN_BYTES = 64 * 2**20


def exit_code(diagnosis: Diagnosis) -> int:
    """0 no failure seen; 1 a known failure (a specific entry, or the profile contradicting what the logs show); 3 a
    failure whose cause is not known (only a layer's generic entry, or decisive lines no entry names)."""
    if diagnosis.contradictions or any(not match.generic for match in diagnosis.failures):
        return 1
    if diagnosis.failures or diagnosis.unknown is not None:
        return EXIT_CAUSE_UNKNOWN
    return 0


def run_diagnosis(logs: list[str], unit: str | None, ssh: str | None, topology: Path | None) -> Diagnosis:
    if not logs and unit is None and ssh is None:
        raise BadInput("nothing to read: give --log FILE (or - for stdin), --unit NAME or --ssh HOST")
    if ssh is not None and logs:
        raise BadInput("--ssh reads the remote unit's journal; --log files are local: give one or the other")
    # Each log is opened (or refused) now and read while it is matched, a batch at a time: memory stays bounded.
    progress = _progress(logs)
    streams: list[Iterable[LineBatch]] = [stream_log_batches(path, progress.advance if progress else None)
                                          for path in logs]
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
        from b70ctl.host_documents import load_topology

        document = load_topology(topology)
        profile, profile_source = document.profile, document.profile_source
        if document.auto_profile != document.profile:
            profile_source = f"override (the topology alone gives {document.auto_profile})"
    try:
        return diagnose_lines(load_catalogue(), chain(*streams, lines), names, profile=profile,
                              profile_source=profile_source,
                              auto_profile=document.auto_profile if topology is not None else None)
    finally:
        if progress is not None:
            progress.stop()


class _Progress:
    """A rich progress bar on stderr over the bytes of the logs to read."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.bar = Progress("reading logs", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self.task = self.bar.add_task("read", total=total)
        self.bar.start()

    def advance(self, characters: int) -> None:
        self.bar.advance(self.task, characters)

    def stop(self) -> None:
        self.bar.stop()


def _progress(logs: list[str]) -> _Progress | None:
    """A progress bar for long logs when stderr is a terminal; nothing otherwise (a role or a pipe reads stderr)."""
    if not sys.stderr.isatty():
        return None
    total = sum(size for path in logs if (size := log_size(path)) is not None)
    return _Progress(total) if total >= PROGRESS_MIN_BYTES else None


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


def render_line(line: LogLine, out: Console, indent: str = "  ") -> None:
    out.print(f"{indent}{escape(line.log)}:{line.number}: {escape(line.text.strip()[:400])}", highlight=False)


def render_codes(lines: list[LogLine], out: Console) -> None:
    """Each result code the lines name, once, with its number and its meaning from the runtime's header."""
    seen: dict[str, ResultCode] = {}
    for line in lines:
        for code in codes_in(line.text[:MAX_LINE_CHARS]):
            seen.setdefault(code.name, code)
    for code in seen.values():
        out.print(f"  code {code.name} = {code.number}: {escape(code.meaning)}", highlight=False)


def render_match(match: Match, out: Console) -> None:
    if match.generic:
        out.print(f"[bold red]FAILURE[/] in layer [bold]{escape(match.layer or '')}[/], cause not known "
                  f"([bold]{match.id}[/]): {escape(match.title)}")
    else:
        out.print(f"[bold red]FAILURE[/] [bold]{match.id}[/]: {escape(match.title)}")
    for line in match.evidence:
        render_line(line, out)
    if match.evidence_count > len(match.evidence):
        out.print(f"  ... {match.evidence_count - len(match.evidence)} more matching line(s)")
    render_codes(match.evidence, out)
    out.print(f"  meaning: {escape(match.meaning)}", highlight=False)
    if match.causes:
        if match.picked_cause is not None:
            out.print(f"  the log shows cause {match.picked_cause + 1}:", highlight=False)
            for line in match.cause_evidence:
                render_line(line, out, indent="    ")
        else:
            out.print("  the log does not tell these apart: the first one's fix is the first step", highlight=False)
        out.print(f"  {len(match.causes)} settled causes, most likely first (how to tell them apart):",
                  highlight=False)
        for number, cause in enumerate(match.causes, 1):
            out.print(f"  {number}. [bold]{escape(cause.cause)}[/]", highlight=False)
            out.print(f"     how to tell: {escape(cause.how_to_tell)}", highlight=False)
            render_fix(cause.fix, out, indent="     ")
    else:
        render_fix(match.fix, out, indent="  ")
    refs = [source.ref + (" (the thread settled on no fix)" if source.thread == "unsettled" else "")
            for source in match.sources]
    out.print(f"  source: {escape('; '.join(refs))}", highlight=False)


def render_context(diagnosis: Diagnosis, out: Console) -> None:
    context = diagnosis.context
    if context.failing_call:
        out.print(f"  failing call: {escape(context.failing_call)}", highlight=False)
    if context.versions:
        out.print("  versions in the log: " + escape(", ".join(f"{name} {value}" for name, value
                                                              in context.versions.items())), highlight=False)
    if context.settings:
        out.print("  settings in the log: " + escape(", ".join(f"{name}={value}" for name, value
                                                              in context.settings.items())), highlight=False)


def render(diagnosis: Diagnosis, out: Console) -> None:
    for match in diagnosis.failures:
        render_match(match, out)
    for contradiction in diagnosis.contradictions:
        out.print(f"[bold red]CONTRADICTION[/] {escape(contradiction.text)}", highlight=False)
    for match in diagnosis.harmless:
        out.print(f"[dim]harmless[/] {match.id}: {escape(match.title)} ({match.evidence_count} line(s)): "
                  f"{escape(match.meaning)}", highlight=False)
    if diagnosis.unknown is not None:
        unknown = diagnosis.unknown
        layers = ", ".join(unknown.layers) or "not told by the lines"
        out.print(f"[bold red]FAILURE[/], cause not known: no entry names it (layer: {escape(layers)})",
                  highlight=False)
        for line in unknown.lines:
            render_line(line, out)
        render_codes(unknown.lines, out)
    if diagnosis.failures or diagnosis.unknown is not None:
        render_context(diagnosis, out)
    where = f"{diagnosis.lines_read} line(s) of {', '.join(diagnosis.logs) or 'nothing'}"
    known = [match for match in diagnosis.failures if not match.generic]
    if known or diagnosis.contradictions:
        out.print(f"{len(known)} known failure(s)" + (f", {len(diagnosis.contradictions)} contradiction(s)"
                                                      if diagnosis.contradictions else "") + f" in {where}",
                  highlight=False)
    elif diagnosis.failures or diagnosis.unknown is not None:
        out.print(f"a failure whose cause is not known in {where}: search the layer's tracker with the lines, "
                  "codes and versions above", highlight=False)
    else:
        out.print(f"no known failure in {where}", highlight=False)


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

    Exit 0 when no failure is seen, 1 when a known failure was named, 2 on bad input or an unreachable host, 3 when a
    failure is seen whose cause is not known (its layer's first step, or its decisive lines and the versions). With
    --start: 0 or 1 (1 for any failure named)."""
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
    raise typer.Exit(exit_code(diagnosis))
