"""Plots of one host's report (report.html) as inline SVG strings, written with b70ctl/svg.py like the fleet's.

Every mark carries a <title> tooltip: which request or workload it is and its value. Figures are the report's own:
each request's decode rate as verify measured it (on the engine's clock where the server timed the request, the
client's otherwise, and the tooltip says which), the spec-decode counters' per-position acceptance, and the
recipe's claims drawn where they apply, with their tolerance.
"""

from __future__ import annotations

from b70ctl.recipes.model import Claim, Recipe
from b70ctl.report.model import Report, RequestSample
from b70ctl.svg import (
    CLAIM_COLOR,
    PALETTE,
    PT_PER_INCH,
    TICK_LENGTH,
    TICK_PAD,
    Axes,
    Canvas,
    LegendEntry,
    data_limits,
    legend_width,
    nice_ticks,
)

ENGINE_COLOR = "#1f77b4"
CLIENT_COLOR = "#ff7f0e"


def _decode_claims(recipe: Recipe, workload: str) -> list[Claim]:
    """Claims on a workload's decode rate in tok/s (a ratio of two rates is not a line on a tok/s axis)."""
    return [claim for claim in recipe.claims if claim.divided_by is None
            and claim.metric.startswith(f"throughput.{workload}.decode_tok_s")]


def _claim_values(claim: Claim) -> list[float]:
    operands = [v for v in (claim.value, claim.low, claim.high) if v is not None]
    return operands + [v - claim.tolerance.slack(v) for v in operands] + [v + claim.tolerance.slack(v)
                                                                           for v in operands]


def _bound(claim: Claim) -> float | None:
    if claim.value is None:
        return None
    slack = claim.tolerance.slack(claim.value)
    return claim.value - slack if claim.op == ">=" else claim.value + slack


def _clock(request: RequestSample) -> str:
    return "engine clock" if request.timing_source == "engine" else "client clock"


def decode_per_request_svg(report: Report, recipe: Recipe) -> str | None:
    """Each request's decode tok/s, one column per workload, its median (black) and the recipe's claims on it
    (red: the published value, dashed: the bound with tolerance, shaded: a range with tolerance)."""
    workloads = [w for w in (report.throughput.workloads if report.throughput else [])
                 if any(r.decode_tok_s is not None for r in w.requests)]
    if not workloads:
        return None
    values = [r.decode_tok_s for w in workloads for r in w.requests if r.decode_tok_s is not None]
    claims_of = {w.name: _decode_claims(recipe, w.name) for w in workloads}
    clocks = {r.timing_source for w in workloads for r in w.requests if r.decode_tok_s is not None}
    legend = [LegendEntry(f"request ({'engine' if clock == 'engine' else 'client'} clock)", "dot",
                          ENGINE_COLOR if clock == "engine" else CLIENT_COLOR) for clock in sorted(clocks)]
    legend.append(LegendEntry("median of the requests", "line", "#000000"))
    kinds = {claim.op for claims in claims_of.values() for claim in claims}
    if kinds & {">=", "<="}:
        legend += [LegendEntry("claim", "line", CLAIM_COLOR), LegendEntry("claim with tolerance", "dashed",
                                                                          CLAIM_COLOR)]
    if "between" in kinds:
        legend.append(LegendEntry("claimed range, with tolerance", "band", CLAIM_COLOR, opacity=0.1))
    left, top, bottom = 0.7 * PT_PER_INCH, 0.35 * PT_PER_INCH, 0.55 * PT_PER_INCH
    plot_width = max(1.6 * len(workloads), 4.0) * PT_PER_INCH
    right = legend_width([entry.label for entry in legend]) + 0.15 * PT_PER_INCH
    width, height = left + plot_width + right, 3.2 * PT_PER_INCH
    canvas = Canvas(width, height, "report-decode")
    ylim = data_limits(values + [v for claims in claims_of.values() for claim in claims
                                 for v in _claim_values(claim)], floor=0.0)
    axes = Axes(canvas, left, top, plot_width, height - top - bottom, (-0.5, len(workloads) - 0.5), ylim)
    yticks = nice_ticks(*axes.ylim, most=8)
    axes.grid(xticks=[], yticks=yticks)
    for column, workload in enumerate(workloads):
        low, high = column - 0.4, column + 0.4
        for claim in claims_of[workload.name]:
            described = f"claim {claim.id}: {claim.description}"
            if claim.op == "between" and claim.low is not None and claim.high is not None:
                lowest = claim.low - claim.tolerance.slack(claim.low)
                highest = claim.high + claim.tolerance.slack(claim.high)
                canvas.rect(axes.x(low), axes.clamp_y(highest), axes.x(high) - axes.x(low),
                            axes.clamp_y(lowest) - axes.clamp_y(highest), fill=CLAIM_COLOR, opacity=0.1,
                            title=f"{described} ({lowest:.1f}..{highest:.1f} with tolerance)")
                for edge in (claim.low, claim.high):
                    canvas.polyline([(axes.x(low), axes.clamp_y(edge)), (axes.x(high), axes.clamp_y(edge))],
                                    color=CLAIM_COLOR, width=1.2, title=f"{described} ({claim.low:g}..{claim.high:g})")
            elif claim.value is not None:
                canvas.polyline([(axes.x(low), axes.clamp_y(claim.value)), (axes.x(high), axes.clamp_y(claim.value))],
                                color=CLAIM_COLOR, width=1.4, title=f"{described} ({claim.op} {claim.value:g})")
                bound = _bound(claim)
                if bound is not None and bound != claim.value:
                    canvas.polyline([(axes.x(low), axes.clamp_y(bound)), (axes.x(high), axes.clamp_y(bound))],
                                    color=CLAIM_COLOR, width=1.0, dash="3.7,1.6",
                                    title=f"claim {claim.id} with tolerance: {claim.op} {bound:.1f}")
        if workload.decode_tok_s is not None:
            median = workload.decode_tok_s.median
            canvas.polyline([(axes.x(column - 0.25), axes.y(median)), (axes.x(column + 0.25), axes.y(median))],
                            color="#000000", width=2,
                            title=f"{workload.name}: median {median:.1f} tok/s of {workload.decode_tok_s.n} requests")
        measured = [(index, r, r.decode_tok_s) for index, r in enumerate(workload.requests, start=1)
                    if r.decode_tok_s is not None]
        spread = 0.3 / max(len(measured) - 1, 1)
        for clock, color in (("engine", ENGINE_COLOR), ("client", CLIENT_COLOR)):
            canvas.titled_dots([(axes.x(column - 0.15 + spread * rank), axes.y(rate),
                                 f"{workload.name} request {index}: {rate:.1f} tok/s ({_clock(r)})")
                                for rank, (index, r, rate) in enumerate(measured) if r.timing_source == clock],
                               color=color, diameter=5)
    label_width = axes.ticks(xticks=list(range(len(workloads))), yticks=yticks,
                             xlabels=[w.name for w in workloads])
    axes.ylabel("decode tok/s", tick_label_width=label_width)
    axes.title(f"{recipe.name}: decode tok/s per request against the claims")
    axes.legend(legend, loc="outside right")
    return canvas.svg()


def acceptance_per_position_svg(report: Report, recipe: Recipe) -> str | None:
    """Per-position acceptance of each workload (from the spec-decode counters) against the recipe's
    per-position claims (red, dashed; shaded: the tolerance around each claimed value)."""
    curves = [(w.name, w.spec_decode.per_position_acceptance) for w in (report.throughput.workloads
                                                                       if report.throughput else [])
              if w.spec_decode is not None and w.spec_decode.per_position_acceptance and not w.spec_decode.polluted]
    if not curves:
        return None
    claims = [claim for claim in recipe.claims if claim.op == "per_position" and claim.values
              and any(claim.metric == f"throughput.{name}.per_position_acceptance" for name, _ in curves)]
    legend = [LegendEntry(name, "line_dot", PALETTE[index % len(PALETTE)])
              for index, (name, _) in enumerate(curves)]
    legend += [LegendEntry(f"claim {claim.id}", "dashed_square", CLAIM_COLOR) for claim in claims]
    if claims:
        legend.append(LegendEntry("claim's tolerance", "band", CLAIM_COLOR, opacity=0.1))
    positions = max([len(curve) for _, curve in curves] + [len(claim.values or []) for claim in claims])
    left, top, bottom = 0.7 * PT_PER_INCH, 0.35 * PT_PER_INCH, 0.55 * PT_PER_INCH
    plot_width = 5 * PT_PER_INCH
    width = left + plot_width + legend_width([entry.label for entry in legend]) + 0.15 * PT_PER_INCH
    height = 3.2 * PT_PER_INCH
    canvas = Canvas(width, height, "report-acceptance")
    claimed = [v + sign * claim.tolerance.slack(v) for claim in claims for v in claim.values or [] for sign in (-1, 1)]
    ylim = data_limits([v for _, curve in curves for v in curve] + claimed, floor=0.0, ceiling=1.02)
    axes = Axes(canvas, left, top, plot_width, height - top - bottom, (0.8, positions + 0.2), ylim)
    xticks = list(range(1, positions + 1))
    yticks = nice_ticks(*axes.ylim, most=6)
    axes.grid(xticks=xticks, yticks=yticks)
    for claim in claims:
        values = claim.values or []
        slack = [claim.tolerance.slack(v) for v in values]
        axes.band(list(range(1, len(values) + 1)), [max(v - s, ylim[0]) for v, s in zip(values, slack, strict=True)],
                  [min(v + s, ylim[1]) for v, s in zip(values, slack, strict=True)], color=CLAIM_COLOR, opacity=0.1)
        points = [(axes.x(p), axes.y(v)) for p, v in enumerate(values, start=1)]
        canvas.polyline(points, color=CLAIM_COLOR, width=1.5, dash="5.5,2.4",
                        title=f"claim {claim.id}: " + " ".join(f"{v:.2f}" for v in values)
                        + (f" (±{slack[0]:.2f})" if slack and len(set(slack)) == 1 else ""))
        canvas.markers(points, shape="square", color=CLAIM_COLOR, size=4)
    for index, (name, curve) in enumerate(curves):
        color = PALETTE[index % len(PALETTE)]
        points = [(axes.x(p), axes.y(v)) for p, v in enumerate(curve, start=1)]
        canvas.polyline(points, color=color, width=2, title=f"{name}: " + " ".join(f"{v:.2f}" for v in curve))
        canvas.titled_dots([(x, y, f"{name}, position {p}: {v:.3f}")
                            for p, ((x, y), v) in enumerate(zip(points, curve, strict=True), start=1)],
                           color=color, diameter=6)
    label_width = axes.ticks(xticks=xticks, yticks=yticks)
    axes.xlabel("draft position", below=TICK_LENGTH + TICK_PAD + 9 + 3.5)
    axes.ylabel("acceptance", tick_label_width=label_width)
    axes.title(f"{recipe.name}: per-position acceptance against the claims")
    axes.legend(legend, loc="outside right")
    return canvas.svg()
