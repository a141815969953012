"""`b70ctl tune`: the best settings of the recipe's tune space for this host, by measurement. It owns the servers it
tunes (no --endpoint): each candidate is served, checked and measured in turn. Exit 0 a result was written (tuned
overrides, or the recipe's default was already best), 1 no candidate passed greedy correctness, 2 bad input."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from b70ctl.errors import BadInput
from b70ctl.options import json_option
from b70ctl.report.model import RooflineInputs
from b70ctl.tune.model import TuneReport

if TYPE_CHECKING:
    from b70ctl.tune.unit import ApplianceHost


def tune_command(
    recipe: Annotated[list[str], typer.Option(
        help="Recipe name (b70ctl recipes list) or recipe file. Repeat it to race recipes on the host: the host's "
             "own recipe first, its default the one to beat")] = ["cpu-tiny"],  # noqa: B006 - typer's list default
    out: Annotated[Path, typer.Option(
        help="Directory for tune.json, tune.md, the plot and b70_tuned.yml; a re-run into it resumes the tune")
    ] = Path("reports/tune"),
    budget_requests: Annotated[int | None, typer.Option(
        help="Most measured requests of the whole tune (default: the recipe's tune.budget_requests)")] = None,
    models_dir: Annotated[Path | None, typer.Option(
        help="Where the generated models are (made once when missing; default ~/.cache/b70ctl/tiny-models)")] = None,
    start_timeout: Annotated[float | None, typer.Option(
        help="Seconds a server may take to become healthy (default 900; with --host, the role's health timeout)")
    ] = None,
    host: Annotated[Path | None, typer.Option(
        help="An appliance host whose serving unit the tune owns: its connection and vllm_serve settings as JSON "
             "(a file, or - for stdin; playbooks/tune.yml passes it). Without it: local processes (cpu-tiny)")
    ] = None,
    roofline_inputs: Annotated[Path | None, typer.Option(
        help="The roofline's inputs measured on the serving host (b70host/roofline_inputs.py's JSON, as verify "
             "takes it); without it, local servers are measured here and a host's candidates get no roofline")
    ] = None,
    as_json: Annotated[bool, json_option("Print tune.json to stdout")] = False,
) -> None:
    """Find the best settings of the recipe's tune space on this host: successive halving under a request budget,
    each candidate served, checked for greedy identity with the target-only baseline and scored by median - 1.4826
    x MAD of its decode rate; the winner is re-measured against the recipe's default. Resumes an interrupted tune.
    With --recipe repeated, a race: every raced recipe's candidates in one halving on the host recipe's workloads,
    and the winner's recipe written as the host's.

    Exit 0 when a result was written, 1 when no candidate passed greedy correctness, 2 on bad input, 143 when
    stopped by SIGTERM (130 by Ctrl-C): a re-run resumes."""
    from b70ctl.recipes import load_recipe
    from b70ctl.tune.render import write_tune_outputs
    from b70ctl.tune.run import Entrant, run_race
    from b70ctl.tune.serving import LocalServing
    from b70ctl.verify.embedded import default_cache_dir, ensure_models

    if budget_requests is not None and budget_requests < 1:
        raise BadInput(f"--budget-requests {budget_requests}: give the most requests the tune may measure, above 0")
    if start_timeout is not None and (not math.isfinite(start_timeout) or start_timeout <= 0):
        raise BadInput(f"--start-timeout {start_timeout:g}: give the seconds a server may take to start, above 0")
    if not recipe:
        raise BadInput("--recipe: give the recipe to tune, or repeat it to race recipes")
    raced = [load_recipe(name) for name in recipe]
    loaded = raced[0]
    if len(raced) == 1 and loaded.tune is None:
        raise BadInput(f"recipe {loaded.name} has no tune section: nothing may be tuned")
    appliance = _appliance_host(host) if host is not None else None
    for one in raced:
        if appliance is None and (one.host.accelerator != "cpu" or one.tiny is None):
            raise BadInput(f"recipe {one.name} runs on B70 hosts, whose candidates the appliance's unit must serve: "
                           "tune them with playbooks/tune.yml (b70ctl tune --host)")
    from b70ctl.tune.run import race_plan

    race_plan(raced, None, budget_requests)  # a budget that cannot cover one round is refused before any start
    measured_inputs = _roofline_inputs(roofline_inputs) if roofline_inputs is not None else None
    console = Console(stderr=True)

    def progress(message: str) -> None:
        console.print(f"[cyan]tune:[/] {escape(message)}", highlight=False, soft_wrap=True)

    from b70ctl.stops import Terminated, sigterm_ends_the_run
    from b70ctl.tune.state import STATE_FILE

    try:
        # SIGTERM (systemd, Ansible) unwinds like Ctrl-C: the servers started are stopped (the appliance's unit
        # put back as it was), the measurements stay.
        with sigterm_ends_the_run():
            if appliance is not None:
                from b70ctl.tune.unit import RacedRecipe, SystemdUnitServing, host_shell

                if start_timeout is not None:
                    appliance = appliance.model_copy(update={"health_timeout_s": start_timeout})
                unit = SystemdUnitServing(loaded, appliance, host_shell(appliance), progress=progress)
                entrants = []
                for one in raced:  # a recipe the host cannot serve is refused before the host is touched
                    servers = unit.serving_of(one)
                    own = servers.roofline_inputs if isinstance(servers, RacedRecipe) else None
                    entrants.append(Entrant(one, servers, own))
                with unit:
                    report = run_race(entrants, out, progress=progress, profile=unit.profile,
                                      budget_requests=budget_requests, roofline_inputs=measured_inputs)
            else:
                models = models_dir or default_cache_dir() / "tiny-models"
                progress(f"tiny models in {models} (generated once)")
                local = []
                for one in raced:
                    ensure_models(one, models)
                    local.append(LocalServing(one, models, out / "logs", timeout_s=start_timeout or 900.0,
                                              progress=progress))
                entrants = [Entrant(one, servers) for one, servers in zip(raced, local, strict=True)]
                if measured_inputs is None:  # the servers run here: this machine's figures are theirs
                    measured_inputs = local[0].roofline_inputs()
                report = run_race(entrants, out, progress=progress, budget_requests=budget_requests,
                                  roofline_inputs=measured_inputs)
    except (KeyboardInterrupt, Terminated) as stop:
        console.print(f"stopped: what was measured is kept in {out / STATE_FILE}; the same command resumes from it",
                      highlight=False, soft_wrap=True)
        raise typer.Exit(143 if isinstance(stop, Terminated) else 130) from None
    write_tune_outputs(report, out)
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        render(report, out)
    raise typer.Exit(1 if report.outcome == "no_candidate" else 0)


def _roofline_inputs(path: Path) -> RooflineInputs:
    """--roofline-inputs: the JSON the serving host's probe printed, or one line saying what is wrong with it."""
    from pydantic import ValidationError

    from b70ctl.errors import first_problem
    from b70ctl.files import read_json_object

    fix = "give the JSON b70host/roofline_inputs.py printed on the serving host"
    found = read_json_object(path, f"--roofline-inputs {path}", fix)
    try:
        return RooflineInputs.model_validate(found)
    except ValidationError as error:
        raise BadInput(f"--roofline-inputs {path}: {first_problem(error)}: {fix}") from None


def _appliance_host(path: Path) -> ApplianceHost:
    """The --host document: a file, or - for stdin (the playbook's way: the API key stays out of argv)."""
    from pydantic import ValidationError

    from b70ctl.errors import first_problem
    from b70ctl.tune.unit import ApplianceHost

    text = sys.stdin.read() if str(path) == "-" else _read_host_file(path)
    try:
        return ApplianceHost.model_validate_json(text)
    except ValidationError as error:
        raise BadInput(f"--host {path}: {first_problem(error)}: pass the host document playbooks/tune.yml "
                       "writes") from None


def _read_host_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"--host {path}: not readable ({error}): give the host document, or - for stdin") from None


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(report: TuneReport, out_dir: Path) -> None:
    """For people, on stdout: the final comparison and the candidates by round reached and score."""
    table = Table("candidate", "rounds", "score", "median", "MAD", "n", "correctness",
                  title=f"tune of {report.recipe}: {report.spent_requests}/{report.budget_requests} requests")
    for candidate in sorted(report.candidates, key=lambda c: (c.disqualified is not None, -c.rounds,
                                                              -(c.halving.score_tok_s or 0.0))):
        figures = candidate.halving
        table.add_row(candidate.label + (" (default)" if candidate.is_default else ""), str(candidate.rounds),
                      _shown(figures.score_tok_s), _shown(figures.median_tok_s), _shown(figures.mad_tok_s),
                      str(figures.n), (candidate.correctness or "-")
                      + (f" [red]disqualified: {escape(candidate.disqualified)}[/]" if candidate.disqualified else ""))
    out = Console()
    out.print(table)
    out.print(escape(report.summary), highlight=False, soft_wrap=True)
    out.print(f"report: {out_dir / 'tune.md'}; overrides: {out_dir / 'b70_tuned.yml'}", highlight=False,
              soft_wrap=True)
