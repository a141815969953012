"""The tune's report files: tune.json (the TuneReport), tune.md, tune-scores.svg (score against each knob, the
recipe's default marked) and b70_tuned.yml (what the appliance applies on the host's next run)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import yaml

from b70ctl.escaping import markdown_code
from b70ctl.escaping import markdown_text as text
from b70ctl.files import write_text_atomically
from b70ctl.svg import PT_PER_INCH, Axes, Canvas, LegendEntry, data_limits, legend_width, nice_ticks
from b70ctl.tune.model import SHORT_NAMES, CandidateResult, Figures, PublishedRecord, TuneReport, knob_applies

CANDIDATE_COLOR = "#1f77b4"
DEFAULT_COLOR = "#d62728"
DISQUALIFIED_COLOR = "#7f7f7f"
PLOT_FILE = "tune-scores.svg"


def _tok(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _figures_row(name: str, figures: Figures | None) -> str:
    if figures is None:
        return f"| {text(name)} | - | - | - | 0 |"
    return (f"| {text(name)} | {_tok(figures.score_tok_s)} | {_tok(figures.median_tok_s)} | {_tok(figures.mad_tok_s)} "
            f"| {figures.n} |")


def tune_markdown(report: TuneReport) -> str:
    labels = {c.key: c.label for c in report.candidates}
    if report.race:
        lines = [f"# Race of {text(', '.join(report.race))} on the host of {text(report.recipe)}", "",
                 f"**{text(report.summary)}.**", "",
                 f"Recipe to serve (b70_tuned.yml sets b70_recipe): {markdown_code(report.winner_recipe or '')}", ""]
    else:
        lines = [f"# Tune of {text(report.recipe)} (vLLM {text(report.vllm_version)})", "",
                 f"**{text(report.summary)}.**", ""]
    if report.outcome == "tuned":
        lines += ["Overrides to apply (b70_tuned.yml): "
                  + ", ".join(markdown_code(f"{name}={value}") for name, value in report.tuned_overrides.items()), ""]
    lines += [
        f"Score = median - 1.4826 x MAD of the per-request decode rate (tok/s, engine clock) over the workload mix "
        f"({text(', '.join(report.workloads))}): a setting fast once and slow often loses. A candidate whose greedy "
        "output differs from the target-only baseline, or that fails the gate against silent garbage (repeated "
        "prompts, a long shared prefix from the cache, a canary, runs of one token at its first serve; the same "
        "tokens at every later serve, a fresh server), is out whatever its speed.", "",
        f"Budget: {report.spent_requests} of {report.budget_requests} measured requests (warm-ups not counted); "
        f"{report.started_at:%Y-%m-%d %H:%M} to {report.finished_at:%H:%M} UTC"
        + (f"; oneCCL profile {text(report.profile)}" if report.profile else "") + ".", ""]
    if report.final is not None:
        lines += ["## Winner against the recipe's default, measured back to back", "",
                  "| candidate | score | median | MAD | n |", "|---|---|---|---|---|"]
        lines.append(_figures_row(f"default: {labels[report.final.default_key]}", report.final.default))
        if report.final.winner_key != report.final.default_key:
            lines.append(_figures_row(f"winner: {labels[report.final.winner_key]}", report.final.winner))
        lines.append("")
    lines += ["## Candidates (successive halving)", "",
              "| candidate | rounds | score | median | MAD | n | tokens/step | roofline | median of roofline "
              "| correctness | gate | |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ranked = sorted(report.candidates, key=lambda c: (c.disqualified is not None, -c.rounds,
                                                      -(c.halving.score_tok_s or 0.0)))
    for candidate in ranked:
        name = candidate.label + (" (recipe's default)" if candidate.is_default else "")
        lines.append(f"| {text(name)} | {candidate.rounds} | {_tok(candidate.halving.score_tok_s)} "
                     f"| {_tok(candidate.halving.median_tok_s)} | {_tok(candidate.halving.mad_tok_s)} "
                     f"| {candidate.halving.n} | {_steps(candidate.mean_acceptance_length)} "
                     f"| {_tok(candidate.bound_tok_s)} "
                     f"| {_share(candidate.halving.median_tok_s, candidate.bound_tok_s)} "
                     f"| {text(candidate.correctness or '-')} | {text(candidate.gate or '-')} "
                     f"| {text('disqualified: ' + candidate.disqualified) if candidate.disqualified else ''} |")
    lines += roofline_lines(report)
    if report.race:
        lines += race_table(report)
    lines += ["", "## Rounds", "", "| round | requests per workload | measured | kept |", "|---|---|---|---|"]
    for tune_round in report.rounds:
        lines.append(f"| {tune_round.index} | {tune_round.requests_per_workload} | {len(tune_round.measured)} "
                     f"| {text('; '.join(labels[key] for key in tune_round.kept))} |")
    lines += ["", f"![score against each knob]({PLOT_FILE})", ""]
    return "\n".join(lines)


def _steps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _share(measured: float | None, bound: float | None) -> str:
    return "-" if measured is None or not bound else f"{measured / bound:.0%}"


def roofline_lines(report: TuneReport) -> list[str]:
    """Where the roofline column comes from, or why it is empty."""
    roofline = report.roofline
    if roofline is None:
        return []
    lines = ["", "Roofline: the decode rate the memory allows, bandwidth / weights read per step x tokens per step "
                 "(the candidate's mean acceptance length; 1 without speculation). The KV cache's reads are left "
                 "out, since the tune does not record each request's context, so this bound is higher than verify's "
                 "per workload: a ceiling, not a rate to reach."]
    if roofline.not_measured:
        lines.append(f"Not measured: {text(roofline.not_measured)}.")
    bandwidth, weights = roofline.bandwidth_bytes_per_s, roofline.weight_bytes
    if bandwidth.value is not None:
        lines.append(f"- bandwidth per memory domain: {bandwidth.value / 1e9:.1f} GB/s ({text(bandwidth.source)})")
    if weights.value is not None:
        lines.append(f"- target weights read per step, all cards: {weights.value:,.0f} bytes ({text(weights.source)})")
    return lines


def race_table(report: TuneReport) -> list[str]:
    """Each raced recipe's best measured candidate beside the records published for it (tok/s, with where). The
    measured rate is this host's; a published figure is another machine's on its own prompts, so they sit side by
    side and nothing is divided."""
    lines = ["", "## Each recipe: measured here, and published", "",
             "| recipe | best candidate here | score | median | roofline | published | source |",
             "|---|---|---|---|---|---|---|"]
    for name in report.race:
        own = [c for c in report.candidates if c.recipe == name]
        scored = [c for c in own if c.disqualified is None and c.halving.score_tok_s is not None]
        best = max(scored, key=lambda c: c.halving.score_tok_s or 0.0) if scored else None
        records: list[PublishedRecord | None] = [r for r in report.published if r.recipe == name] or [None]
        for index, record in enumerate(records):
            measured = (f"| {text(best.settings_label)} | {_tok(best.halving.score_tok_s)} "
                        f"| {_tok(best.halving.median_tok_s)} | {_tok(best.bound_tok_s)} |" if best is not None else
                        f"| {text('out: ' + own[0].disqualified) if own and own[0].disqualified else '-'} | - | - "
                        "| - |")
            published = ("- | - |" if record is None else
                         f"{record.tok_s:.1f} ({text(record.description)}) | "
                         + (f"[{text(record.source)}]({record.url})" if record.url else text(record.source)) + " |")
            lines.append(f"| {text(name) if index == 0 else ''} "
                         + (measured if index == 0 else "| | | | |") + f" {published}")
    return lines


def scores_svg(report: TuneReport) -> str | None:
    """One panel per knob: each measured candidate's halving score at its value of the knob (candidates that
    differ in other knobs share a column), the recipe's default in red."""
    scored = [c for c in report.candidates if c.halving.score_tok_s is not None and c.disqualified is None]
    knobs = [name for name, values in report.knobs.items() if values]
    if not scored or not knobs:
        return None
    out = [c for c in report.candidates if c.disqualified is not None]
    legend = [LegendEntry("candidate (score over its requests)", "dot", CANDIDATE_COLOR),
              LegendEntry("the recipe's default", "ring", DEFAULT_COLOR, marker_size=9)]
    if out:
        legend.append(LegendEntry("disqualified (at the axis)", "square", DISQUALIFIED_COLOR))
    left, top, bottom, gap = 0.7 * PT_PER_INCH, 0.35 * PT_PER_INCH, 0.55 * PT_PER_INCH, 0.6 * PT_PER_INCH
    panel = 3.0 * PT_PER_INCH
    right = legend_width([entry.label for entry in legend]) + 0.15 * PT_PER_INCH
    width = left + len(knobs) * panel + (len(knobs) - 1) * gap + right
    height = 3.0 * PT_PER_INCH
    canvas = Canvas(width, height, "tune-scores")
    ylim = data_limits([c.halving.score_tok_s for c in scored], floor=0.0)  # type: ignore[misc]
    yticks = nice_ticks(*ylim, most=6)
    axes = first = None
    for index, knob in enumerate(knobs):
        values = list(report.knobs[knob])
        default_value = report.default_overrides.get(knob)
        if default_value not in values and knob_applies(knob, report.default_overrides):
            values.append(default_value)
        # A draft-model candidate has no n-gram window: it is left out of those panels.
        shown = [c for c in scored if knob_applies(knob, c.overrides)]
        shown_out = [c for c in out if knob_applies(knob, c.overrides)]
        values += [value for value in dict.fromkeys(c.overrides.get(knob) for c in shown + shown_out)
                   if value not in values]
        axes = Axes(canvas, left + index * (panel + gap), top, panel, height - top - bottom,
                    (-0.5, len(values) - 0.5), ylim)
        first = first or axes
        axes.grid(xticks=[], yticks=yticks)
        columns: dict[int, list[CandidateResult]] = defaultdict(list)
        for candidate in shown:
            columns[values.index(candidate.overrides.get(knob))].append(candidate)
        for column, members in columns.items():
            spread = 0.4 / max(len(members) - 1, 1)
            for rank, candidate in enumerate(members):
                x = axes.x(column - (0.2 if len(members) > 1 else 0) + spread * rank)
                y = axes.y(candidate.halving.score_tok_s or 0.0)  # scored: never None
                canvas.titled_dots([(x, y, f"{candidate.label}: score {candidate.halving.score_tok_s:.1f} tok/s "
                                            f"over {candidate.halving.n} requests")], color=CANDIDATE_COLOR,
                                   diameter=5)
                if candidate.is_default:
                    canvas.markers([(x, y)], shape="ring", color=DEFAULT_COLOR, size=9, edge_width=1.5)
        for candidate in shown_out:
            x, y = axes.x(values.index(candidate.overrides.get(knob))), axes.bottom
            canvas.rect(x - 3, y - 6, 6, 6, fill=DISQUALIFIED_COLOR,
                        title=f"{candidate.label}: disqualified: {candidate.disqualified}")
        labels = ["default" if value is None else str(value) for value in values]
        label_width = axes.ticks(xticks=list(range(len(values))), yticks=yticks, xlabels=labels)
        axes.xlabel(SHORT_NAMES.get(knob, knob), below=3.5 + 3.5 + 9 + 3.5)
        if index == 0:
            axes.ylabel("score (tok/s)", tick_label_width=label_width)
    assert first is not None and axes is not None
    first.title(f"{report.recipe}: score against each knob (median - 1.4826 x MAD, tok/s)")
    axes.legend(legend, loc="outside right")
    return canvas.svg()


def tuned_yaml(report: TuneReport) -> str:
    """host_vars/<host>/b70_tuned.yml: the overrides (empty when the recipe's default stays), with the score,
    the budget and the date, as roles/vllm_serve's vllm_serve_tuned (model.TunedSettings), which it applies."""
    final = report.final
    document: dict[str, object] = {}
    if report.race:
        # The race's winner becomes the host's recipe: host_vars beside the inventory override the inventory's own.
        document["b70_recipe"] = report.winner_recipe
    document["vllm_serve_tuned"] = {
        "recipe": report.winner_recipe or report.recipe,
        "outcome": report.outcome,
        "overrides": dict(report.tuned_overrides),
        "profile": report.profile,
        "score_tok_s": (round(final.winner.score_tok_s, 2) if final is not None and final.winner.score_tok_s
                        is not None and report.outcome == "tuned" else
                        round(final.default.score_tok_s, 2) if final is not None and final.default is not None
                        and final.default.score_tok_s is not None else None),
        "default_score_tok_s": (round(final.default.score_tok_s, 2) if final is not None and final.default
                                is not None and final.default.score_tok_s is not None else None),
        "budget_requests": report.budget_requests,
        "spent_requests": report.spent_requests,
        "date": report.finished_at.date().isoformat(),
    }
    raced = " ".join(f"--recipe {name}" for name in report.race or [report.recipe])
    header = (f"# Written by `b70ctl tune {raced}`: {report.summary}.\n"
              "# Scores: median - 1.4826 x MAD of the per-request decode rate (tok/s) over the workload mix.\n")
    return header + yaml.safe_dump(document, sort_keys=False)


def write_tune_outputs(report: TuneReport, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    write_text_atomically(out_dir / "tune.json", report.model_dump_json(indent=2) + "\n")
    svg = scores_svg(report)
    if svg is not None:
        write_text_atomically(out_dir / PLOT_FILE, svg)
    markdown = tune_markdown(report)
    if svg is None:
        markdown = markdown.replace(f"![score against each knob]({PLOT_FILE})", "(no candidate had a score to plot)")
    write_text_atomically(out_dir / "tune.md", markdown)
    write_text_atomically(out_dir / "b70_tuned.yml", tuned_yaml(report))
