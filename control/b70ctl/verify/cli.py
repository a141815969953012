"""`b70ctl verify` and `b70ctl demo`: their arguments (the endpoints, the API key, the limits) parsed and refused
with one line, the run, and the verdicts for people on stdout."""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from b70ctl.choices import choice_option
from b70ctl.errors import BadInput
from b70ctl.escaping import one_line
from b70ctl.options import console, fail, json_option, print_json, shown
from b70ctl.recipes import load_recipe

if TYPE_CHECKING:
    from b70ctl.checks.client import Endpoint
    from b70ctl.report.model import Report


# Read in this order when no --api-key-file is given: b70ctl's own, then the key a vLLM server is started with, then
# the one `vllm bench serve` and OpenAI clients send.
API_KEY_VARIABLES = ("B70CTL_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY")


def read_api_key(api_key_file: Path | None) -> str | None:
    """The API key from a file (mode 0600 recommended), else from the first of API_KEY_VARIABLES that is set; never
    from argv, never printed."""
    if api_key_file is None:
        for name in API_KEY_VARIABLES:
            key = (os.environ.get(name) or "").strip()
            if key:
                if name != API_KEY_VARIABLES[0]:
                    # A key borrowed from another tool's variable is sent to the endpoint: say so (never the key).
                    console.print(f"using the API key in ${name}", highlight=False)
                return checked_api_key(key, name)
        return None
    from b70ctl.files import read_secret_file

    key = read_secret_file(api_key_file, f"--api-key-file {api_key_file}").strip()
    if not key:
        raise BadInput(f"--api-key-file {api_key_file}: the file is empty: write the key into it")
    return checked_api_key(key, f"--api-key-file {api_key_file}")


def checked_api_key(key: str, where: str) -> str:
    """A key goes into an HTTP header: one line of visible ASCII. The message never quotes it, and nothing printed
    or stored holds it (b70ctl.redact)."""
    from b70ctl.redact import keep_secret

    keep_secret(key)
    if "\n" in key or "\r" in key:
        raise BadInput(f"{where}: the API key must be one line, it holds a line break: keep only the key")
    if not all("!" <= character <= "~" for character in key):
        raise BadInput(f"{where}: the API key must be printable ASCII without spaces or control characters: "
                       "keep only the key")
    return key


def endpoint_of(url: str, option: str, **settings: object) -> Endpoint:
    """An Endpoint from a URL the user typed: http(s), a host, a valid port; a user and password in it are sent
    as basic auth and taken out of the URL, so they never reach a report or a message."""
    from urllib.parse import urlsplit, urlunsplit

    import httpx

    from b70ctl.checks.client import Endpoint

    shown = re.sub(r"//[^/@]*@", "//***@", url)
    if len(shown) > 120:
        shown = shown[:100] + f"… ({len(url)} characters)"
    if any(ord(character) <= 32 or ord(character) == 127 for character in url):
        raise BadInput(f"{option} {shown!r}: holds a space or control character: give a URL like http://host:8000")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise BadInput(f"{option} {shown!r}: not a valid URL ({str(error).split(':')[0]}): give a URL like "
                       "http://host:8000") from error
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(f"{option} {shown!r}: give an http:// or https:// URL with a host, like http://host:8000")
    if port == 0:
        raise BadInput(f"{option} {shown!r}: port 0 is not a server's port")
    basic_auth = (parts.username or "", parts.password or "") if parts.username or parts.password else None
    if basic_auth is not None:
        from b70ctl.redact import keep_basic_credentials

        keep_basic_credentials(*basic_auth)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    base_url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    try:
        httpx.URL(base_url)  # what the client will parse: its own limits (length, host name) are refused here
    except httpx.InvalidURL as error:
        raise BadInput(f"{option} {shown!r}: not a valid URL ({str(error).split(':')[0]}): give a URL like "
                       "http://host:8000") from error
    return Endpoint(base_url, basic_auth=basic_auth, **settings)  # type: ignore[arg-type]


MAX_TIMEOUT_S = 86400


class Check(str, Enum):
    smoke = "smoke"
    correctness = "correctness"
    throughput = "throughput"


def verify_command(
    endpoint: Annotated[str, typer.Option(
        "--endpoint", "--base-url", help="Base URL of the vLLM server to check, e.g. http://host:8000")],
    recipe: Annotated[str, typer.Option(help="Recipe name (b70ctl recipes list) or recipe file")],
    out: Annotated[Path | None, typer.Option(help="Directory for report.json, report.md and raw/")] = None,
    baseline_endpoint: Annotated[str | None, typer.Option(
        "--baseline-endpoint", "--baseline-base-url", help="Target-only server of the same model")] = None,
    reference: Annotated[Path | None, typer.Option(help="Stored greedy reference (instead of a baseline)")] = None,
    record_reference: Annotated[Path | None, typer.Option(
        help="Record the endpoint's greedy outputs as a reference FILE and exit")] = None,
    model: Annotated[str | None, typer.Option(help="Served model name, if not the recipe's")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        help="File holding the API key (else $B70CTL_API_KEY, $VLLM_API_KEY or $OPENAI_API_KEY, "
             "the first set)")] = None,
    host_facts: Annotated[Path | None, typer.Option(help="Host facts JSON to record in the report")] = None,
    host: Annotated[str | None, typer.Option(
        help="Name of the verified host in the reports (default: from --host-facts, "
             "else the report's directory)")] = None,
    model_dir: Annotated[Path | None, typer.Option(
        help="The served target's directory, when the server runs on this machine: the report's roofline then "
             "reads its shape there and, for a CPU recipe, measures this machine's memory bandwidth")] = None,
    roofline_inputs: Annotated[Path | None, typer.Option(
        help="The roofline's inputs measured on the serving host (b70host/roofline_inputs.py's JSON)")] = None,
    check: Annotated[list[str] | None, choice_option(
        Check, "--check", "Run only these checks (repeatable; default all)", unknown="check")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds a request may stall before it fails")] = 120.0,
    deadline: Annotated[float, typer.Option(
        help="Seconds the whole run may take; past it the report is marked partial (deadline), exit 124. Each "
             "request also ends after --timeout plus max_tokens at 1 tok/s")] = 14400.0,
    max_answer_mb: Annotated[float, typer.Option(
        help="Most MiB read from one answer; a larger one fails its request, saying so")] = 64.0,
    max_requests: Annotated[int | None, typer.Option(
        help="Measure each workload at most N times (a quick check; the report says so). Default: the recipe's "
             "min_requests..max_requests")] = None,
    as_json: Annotated[bool, json_option(
        "Print report.json to stdout (with --record-reference: what was recorded)")] = False,
) -> None:
    """Smoke, greedy correctness and throughput checks against a vLLM endpoint, with a verdict per claim.

    Exit 0 when every check passed and no claim was missed, 1 when something failed, 2 on bad input or an
    unreachable server."""
    from b70ctl.checks.client import VllmClient
    from b70ctl.checks.correctness import record_reference as record
    from b70ctl.verify.pipeline import VerifyRequest
    from b70ctl.verify.pipeline import verify as run_verify

    if not math.isfinite(timeout) or timeout <= 0:
        fail(f"--timeout {timeout:g}: give the seconds a request may stall, a number above 0")
    if timeout > MAX_TIMEOUT_S:  # a socket's timeout is a time_t: 1e308 does not fit, and no stall lasts days
        fail(f"--timeout {timeout:g}: give at most {MAX_TIMEOUT_S} s (a day)")
    if not math.isfinite(max_answer_mb) or max_answer_mb <= 0:
        fail(f"--max-answer-mb {max_answer_mb:g}: give the MiB one answer may hold, a number above 0")
    if max_answer_mb > 2**20:  # more than any answer of vLLM's, and than memory holds
        fail(f"--max-answer-mb {max_answer_mb:g}: give at most {2**20} MiB (1 TiB)")
    if not math.isfinite(deadline) or deadline <= 0:
        fail(f"--deadline {deadline:g}: give the seconds the whole run may take, a number above 0")
    if max_requests is not None and max_requests < 1:
        fail(f"--max-requests {max_requests}: give how many requests each workload may take, 1 or more")
    loaded = load_recipe(recipe)
    key = read_api_key(api_key_file)
    limits = {"timeout_s": timeout, "max_answer_bytes": int(max_answer_mb * 2**20)}
    target = endpoint_of(endpoint, "--endpoint", model=model, api_key=key, **limits)
    baseline = (endpoint_of(baseline_endpoint, "--baseline-endpoint", api_key=key, **limits)
                if baseline_endpoint else None)
    if record_reference is not None:
        from b70ctl.files import require_replaceable

        require_replaceable(record_reference, "--record-reference")
        with VllmClient(replace(target, model=model or loaded.serve.served_model_name)) as client:
            from b70ctl.verify.pipeline import require_reachable

            require_reachable(client, "endpoint")
            saved = record(client, loaded, record_reference)
        if as_json:
            print_json({"reference": str(record_reference), "recipe": loaded.name, "outputs": len(saved.outputs)})
        else:
            print(f"recorded {len(saved.outputs)} greedy outputs to {record_reference}")
        return
    if out is None:
        fail("--out DIR is required: the directory for report.json, report.md and raw/")
    checks = tuple(dict.fromkeys(check or [member.value for member in Check]))
    request = VerifyRequest(
        recipe=loaded, endpoint=target, out_dir=out,
        baseline_endpoint=baseline,
        reference_path=reference, host_facts_path=host_facts, host=host, checks=checks, model_dir=model_dir,
        roofline_inputs_path=roofline_inputs, deadline_s=deadline, max_requests=max_requests)
    from b70ctl.checks.client import RunDeadlineExceeded
    from b70ctl.stops import Terminated

    try:
        with console.status("verifying", spinner="dots") as status:
            # a step's message may name a server's model or a recipe's workload: text only, no markup
            report = run_verify(request, progress=lambda message: status.update(escape(one_line(message))))
    except (Terminated, KeyboardInterrupt) as stop:
        # 143 = 128 + SIGTERM and 130 = 128 + SIGINT, as a shell reports a process the signal ended; the report
        # says "terminated" or "interrupted". A stop before the first report was written leaves none.
        word, code = ("terminated", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
        left = (f"the report in {shown(out)} is marked partial ({word})" if (out / "report.json").is_file()
                else "no report was written")
        console.print(f"{word}: {left}", highlight=False, soft_wrap=True)
        raise typer.Exit(code) from None
    except RunDeadlineExceeded as passed:
        # 124, as timeout(1) reports a command it stopped at its deadline; the report says "deadline".
        console.print(f"deadline: the run took longer than --deadline {passed.deadline_s:g} s: the report in "
                      f"{shown(out)} is marked partial (deadline)", highlight=False, soft_wrap=True)
        raise typer.Exit(124) from None
    if as_json:
        from b70ctl.redact import redact

        sys.stdout.write(redact(report.model_dump_json(indent=2)) + "\n")  # as report.json was stored
    else:
        render_verdicts(report, out)
    raise typer.Exit(0 if report.passed else 1)


def demo_command(
    out: Annotated[Path, typer.Option(help="Directory for the report")] = Path("reports/demo"),
    as_json: Annotated[bool, json_option("Print report.json to stdout")] = False,
) -> None:
    """The embedded default end to end: tiny Qwen3 on real vLLM (CPU), baseline + draft-model speculation,
    verified against the cpu-tiny recipe. Leaves nothing running."""
    from b70ctl.verify.demo import run_demo

    report = run_demo(out, progress=lambda message: console.print(f"[cyan]demo:[/] {message}", highlight=False))
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        render_verdicts(report, out)
    raise typer.Exit(0 if report.passed else 1)


def render_verdicts(report: Report, out_dir: Path) -> None:
    """The verdicts for people, on stdout (`| tee` keeps them); progress and warnings stay on stderr."""
    table = Table("claim", "required", "measured", "verdict",
                  title=shown(f"{report.recipe} @ {report.endpoint}"))
    styles = {"met": "green", "not_met": "red", "not_measured": "yellow"}
    for verdict in report.verdicts:
        measured = verdict.measured
        measured_text = (" ".join(f"{m:.2f}" for m in measured) if isinstance(measured, list)
                         else f"{measured:.3g}" if measured is not None else "-")
        table.add_row(shown(verdict.description), shown(verdict.bound), measured_text,
                      f"[{styles[verdict.verdict]}]{verdict.verdict}[/]"
                      + (f" ({shown(verdict.reason)})" if verdict.reason else ""))
    out = Console()
    out.print(table)
    checks = [(name, result) for name, result in (("smoke", report.smoke), ("correctness", report.correctness),
                                                  ("throughput", report.throughput)) if result is not None]
    out.print("checks: " + ", ".join(f"{name} {'passed' if result.passed else 'FAILED'}" for name, result in checks)
              + (" — PARTIAL" if report.partial else ""))
    out.print(f"report: {shown(out_dir / 'report.md')}", highlight=False, soft_wrap=True)  # never cut
