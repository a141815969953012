"""b70ctl: the appliance's command line. Each command parses its arguments, calls one function and renders the
result: rich for people, --json for machines. Exit codes: 0 ok, 1 a check failed, 2 bad input or unreachable."""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from b70ctl.choices import choice_option
from b70ctl.errors import B70Error, BadInput
from b70ctl.escaping import TerminalStream, one_line
from b70ctl.options import json_option, print_json
from b70ctl.recipes import load_recipe, recipe_names
from b70ctl.report.verdict import describe_bound

if TYPE_CHECKING:
    from b70ctl.checks.client import Endpoint
    from b70ctl.report.model import Report

# The sub-commands that live in their own package, imported only when named: `b70ctl fleet report`, the one b70ctl
# call of a converged site.yml, then starts without the tuner, docker, httpx and the lock resolver. Each is a Typer
# app (a command group) or a function (one command). Listed in the order `b70ctl --help` shows them.
SUBCOMMANDS = {
    "diagnose": ("b70ctl.diagnose.cli", "diagnose_command"),
    "tune": ("b70ctl.tune.cli", "tune_command"),
    "lock": ("b70ctl.lock.cli", "app"),
    "model": ("b70ctl.models.cli", "app"),
    "host": ("b70ctl.host.cli", "app"),
    "fleet": ("b70ctl.fleet.cli", "app"),
    "image": ("b70ctl.image.cli", "app"),
    "serve": ("b70ctl.serve.cli", "app"),
}


class LazyGroup(TyperGroup):
    """b70ctl's top-level group: the commands defined here, then SUBCOMMANDS, each loaded on first use (help and
    shell completion load them all). Contexts and commands are typed Any: typer's are its vendored click's, which it
    does not export."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *(name for name in SUBCOMMANDS if name not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in SUBCOMMANDS:
            module, attribute = SUBCOMMANDS[cmd_name]
            loaded = getattr(__import__(module, fromlist=[attribute]), attribute)
            command: Any
            if isinstance(loaded, typer.Typer):
                command = typer.main.get_group(loaded)
                command.name = cmd_name
            else:
                single = typer.Typer(add_completion=False)
                single.command(cmd_name)(loaded)
                command = typer.main.get_command(single)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and args[0] not in SUBCOMMANDS:
            for name in SUBCOMMANDS:  # not a command: load them all, so "Did you mean ...?" can name any
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=LazyGroup, no_args_is_help=True, help=__doc__,
                  context_settings={"help_option_names": ["-h", "--help"]})
recipes_app = typer.Typer(no_args_is_help=True, help="The recipes b70ctl ships.")
app.add_typer(recipes_app, name="recipes")

console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from b70ctl import __version__

        print(f"b70ctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print b70ctl's version and exit")] = False,
             ) -> None:
    """Run Qwen3.8-27B with a DSpark drafter on Arc Pro B70 hosts, and verify it against the published claims."""


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr and the exit code; never a traceback for a user's mistake."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def shown(value: object) -> str:
    """A value from an input (a server, a recipe file, a report) for a rich console: one line of text, no escape
    sequence, and no markup of rich's."""
    return escape(one_line(value))



@recipes_app.command("list")
def recipes_list(as_json: Annotated[bool, json_option()] = False) -> None:
    """List the shipped recipes."""
    recipes = [load_recipe(name) for name in recipe_names()]
    if as_json:
        print_json([{"name": r.name, "route": r.route, "vllm_version": r.vllm_version,
                     "description": r.description} for r in recipes])
        return
    table = Table("name", "route", "vLLM", "TP", "speculation", "description")
    for recipe in recipes:
        spec = recipe.serve.speculative
        table.add_row(shown(recipe.name), shown(recipe.route), shown(recipe.vllm_version),
                      str(recipe.serve.tensor_parallel_size),
                      shown(f"{spec.method} k={spec.num_speculative_tokens}") if spec else "-",
                      shown(recipe.description))
    Console().print(table)


@recipes_app.command("show")
def recipes_show(name: Annotated[str, typer.Argument(help="Recipe name or path to a recipe file")],
                 as_json: Annotated[bool, json_option()] = False) -> None:
    """Show one recipe, validated, with its claims."""
    recipe = load_recipe(name)
    if as_json:
        print_json(recipe.model_dump(mode="json"))
        return
    out = Console()
    out.print(f"[bold]{shown(recipe.name)}[/] — {shown(recipe.description)}")
    out.print(shown(f"route {recipe.route}, vLLM {recipe.vllm_version}, image {recipe.image.reference}"
                    f"{':' + recipe.image.tag if recipe.image.tag else ''} ({recipe.image.source})"))
    table = Table("claim", "metric", "bound", "source", title="claims")
    for claim in recipe.claims:
        table.add_row(shown(claim.id), shown(claim.metric), shown(describe_bound(claim)), shown(claim.source))
    out.print(table)


@recipes_app.command("check")
def recipes_check(
    recipes: Annotated[list[str], typer.Argument(help="The recipes (name or file) a play's hosts serve, as their "
                                                      "inventory names them; repeats are checked once")],
    as_json: Annotated[bool, json_option("Print each recipe's spec, lock status or error as JSON, keyed by RECIPE "
                                         "as given (what preflight reads)")] = False,
) -> None:
    """Preflight's question for every recipe of a play, before anything changes: is the recipe valid, and is its
    lock resolved (if not, the command that resolves it and the network that needs). Exit 1 when one is not; with
    --json the exit is 0 and each recipe's entry says it, so that a play fails only the hosts that name that
    recipe."""
    from b70ctl.lock.status import check_recipes

    checked = check_recipes(recipes)
    if as_json:
        sys.stdout.write(checked.model_dump_json(indent=2) + "\n")
        return
    out = Console(highlight=False, markup=False, soft_wrap=True)
    for key, entry in checked.recipes.items():
        out.print(f"{key}: " + (f"cannot be used: {entry.error}" if entry.error else entry.lock.message
                                if entry.lock else "ok"))
    if any(entry.error or (entry.lock and not entry.lock.resolved) for entry in checked.recipes.values()):
        raise typer.Exit(1)


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


@app.command()
def verify(
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
    from b70ctl.verify import VerifyRequest
    from b70ctl.verify import verify as run_verify

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
            from b70ctl.verify import require_reachable

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
    from b70ctl.verify import Terminated

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


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Directory for the report")] = Path("reports/demo"),
    as_json: Annotated[bool, json_option("Print report.json to stdout")] = False,
) -> None:
    """The embedded default end to end: tiny Qwen3 on real vLLM (CPU), baseline + draft-model speculation,
    verified against the cpu-tiny recipe. Leaves nothing running."""
    from b70ctl.demo import run_demo

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


def main() -> None:
    """The console script. Any exception that still escapes a command is a defect: one line naming the command and
    the file holding the full traceback, exit 2; `--debug` (anywhere on the line) shows the traceback instead."""
    debug = "--debug" in sys.argv[1:]
    if debug:
        sys.argv.remove("--debug")
    # Whatever a command prints from its inputs reaches the terminal as text only: no escape sequence of a
    # server's or a file's (b70ctl.escaping), and no secret of this run.
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = TerminalStream(sys.stdout), TerminalStream(sys.stderr)
    try:
        _run(debug)
    finally:
        sys.stdout, sys.stderr = streams
        from b70ctl.redact import forget_secrets

        forget_secrets()


def _run(debug: bool) -> None:
    try:
        app()
    except B70Error as error:
        # escaped: a message may quote a path or an install hint in brackets ('b70ctl[appliance]')
        # printable: a message may quote what a server sent (an echoed key, an escape sequence)
        line = one_line(error)
        console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        sys.exit(error.exit_code)
    except Exception as error:
        if debug:
            raise
        command = " ".join(["b70ctl", *[word for word in sys.argv[1:3] if not word.startswith("-")][:2]])
        where = save_traceback()
        console.print(f"[bold red]error:[/] {command} failed unexpectedly ({error.__class__.__name__}); the full "
                      f"traceback is in {where}: run it again with --debug to see it, and report it",
                      highlight=False, soft_wrap=True)
        sys.exit(2)


def save_traceback() -> str:
    """The traceback being handled, in a private file under the user's cache (it may quote local paths)."""
    import time
    import traceback

    from b70ctl.files import write_text_atomically

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "b70ctl" / "tracebacks" / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.txt"
    try:
        write_text_atomically(path, traceback.format_exc(), mode=0o600)
    except OSError:
        return "(not saved: the cache is not writable)"
    return str(path)
