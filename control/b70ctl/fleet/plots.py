"""Plots of the fleet report as inline SVG strings, written directly (b70ctl/svg.py): no plotting library.

matplotlib drew these in about a CPU-second whatever the fleet size, and took another second to import; written
as SVG text they cost milliseconds and grow with the number of hosts only through the points drawn. Points are one
path per color (a dozen bytes a host), so the file stays a few hundred KB at 5,000 hosts while everything stays
vector and sharp.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from b70ctl.fleet.model import (
    FIELD_LABELS,
    USABLE,
    ClaimLine,
    FingerprintGroup,
    HostEntry,
    RecipeFleet,
    WorkloadFigures,
)
from b70ctl.report.stats import percentile
from b70ctl.svg import (
    CLAIM_COLOR,
    LEGEND_SIZE,
    PALETTE,
    PT_PER_INCH,
    TICK_LENGTH,
    TICK_PAD,
    Axes,
    Canvas,
    LegendEntry,
    data_limits,
    draw_handle,
    legend_width,
    nice_ticks,
    text_width,
)

CURVES_UP_TO_HOSTS = 60
NAMED_TICKS_UP_TO_HOSTS = 40
ANNOTATED_OUTLIERS_PER_PANEL = 8
OTHER_COLOR = "#7f7f7f"
HOST_CURVE_COLOR = "#555555"


def _id_prefix(kind: str, recipe: str) -> str:
    """Ids unique in the page (one plot of each kind per recipe) and the same on every run."""
    return f"fleet-{kind}-{hashlib.sha256(recipe.encode()).hexdigest()[:8]}"


def _figures_by_host(hosts: Sequence[HostEntry]) -> list[tuple[str, dict[str, WorkloadFigures]]]:
    return [(h.host, {f.name: f for f in h.workloads}) for h in hosts if h.status in USABLE]


def _short(value: str | None, length: int = 16) -> str:
    text = str(value)
    return text if len(text) <= length else text[: length - 1] + "…"


def _group_label(group: FingerprintGroup) -> str:
    if not group.differs_from_majority:
        unrecorded = sum(1 for value in group.fingerprint.values() if value is None)
        if unrecorded:
            return f"majority where recorded, {unrecorded} fields not recorded ({len(group.hosts)})"
        return f"fleet majority ({len(group.hosts)})"
    differences = ", ".join(f"{FIELD_LABELS[name]}={_short(group.fingerprint[name])}"
                            for name in group.differs_from_majority)
    if len(differences) > 44:  # the legend beside the plot stays narrow
        differences = differences[:43] + "…"
    return f"{differences} ({len(group.hosts)})"


def _host_colors(fleet: RecipeFleet) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Color per host by fingerprint group (largest groups first); the rest share grey."""
    color_of: dict[str, str] = {}
    legend: list[tuple[str, str]] = []
    other_hosts = 0
    for index, group in enumerate(fleet.fingerprint_groups):
        color = PALETTE[index] if index < len(PALETTE) else OTHER_COLOR
        if index < len(PALETTE):
            legend.append((color, _group_label(group)))
        else:
            other_hosts += len(group.hosts)
        for host in group.hosts:
            color_of[host] = color
    if other_hosts:
        legend.append((OTHER_COLOR, f"other fingerprints ({other_hosts})"))
    return color_of, legend


def _claim_legend(line: ClaimLine) -> list[LegendEntry]:
    """The legend entries of a claim line on a tok/s axis, as decode_per_host_svg draws it."""
    if line.op in (">=", "<=") and line.value is not None:
        entries = [LegendEntry(f"claim {line.claim_id} {line.op} {line.value:g}", "line", CLAIM_COLOR)]
        bound = line.lower_with_tolerance if line.op == ">=" else line.upper_with_tolerance
        if bound is not None and bound != line.value:
            entries.append(LegendEntry(f"with tolerance: {bound:.1f}", "dashed", CLAIM_COLOR))
        return entries
    if line.op == "between" and line.low is not None and line.high is not None:
        return [LegendEntry(f"claim {line.claim_id} {line.low:g}..{line.high:g} (with tolerance)", "band",
                            CLAIM_COLOR, opacity=0.08)]
    return []


def _claim_values(line: ClaimLine) -> list[float]:
    return [v for v in (line.value, line.low, line.high, line.lower_with_tolerance, line.upper_with_tolerance)
            if v is not None]


def decode_per_host_svg(fleet: RecipeFleet, hosts: Sequence[HostEntry]) -> str | None:
    """Median decode tok/s of every host, one panel per workload, hosts sorted by tok/s, against the claim line
    (solid: the published value; dashed: the bound with tolerance; shaded: what counts as met). Each point's
    tooltip names its host and value; the y axis spans the hosts' values and the claim's lines."""
    panels = [w for w in fleet.workloads if w.median_decode_tok_s is not None]
    if not panels:
        return None
    usable = _figures_by_host(hosts)
    color_of, group_legend = _host_colors(fleet)
    outliers = {(o.host, o.workload) for o in fleet.outliers}
    named_ticks = len(usable) <= NAMED_TICKS_UP_TO_HOSTS
    claim_lines_of = {w.workload: [line for line in w.claims if "decode_tok_s" in line.metric] for w in panels}
    # The legend stands right of the panels, where it hides no point: room for its longest label.
    legend_labels = ["outlier (robust z)"] + [label for _, label in group_legend] + [
        entry.label for lines in claim_lines_of.values() for line in lines for entry in _claim_legend(line)]
    below, panel_height, title_height = (1.0 if named_ticks else 0.45) * PT_PER_INCH, 2.3 * PT_PER_INCH, \
        0.35 * PT_PER_INCH
    block = title_height + panel_height + below
    left, plot_width = 0.7 * PT_PER_INCH, 9.15 * PT_PER_INCH
    right = legend_width(legend_labels) + 0.15 * PT_PER_INCH
    width = left + plot_width + right
    canvas = Canvas(width, len(panels) * block, _id_prefix("decode", fleet.recipe))
    for index, workload in enumerate(panels):
        name = workload.workload
        points = sorted((f.median_decode_tok_s, host) for host, figures in usable
                        if (f := figures.get(name)) is not None and f.median_decode_tok_s is not None)
        claim_lines = claim_lines_of[name]
        pad = max(0.05 * (len(points) - 1), 0.5)
        ylim = data_limits([value for value, _ in points] + [v for line in claim_lines for v in _claim_values(line)],
                           floor=0.0)
        axes = Axes(canvas, left, index * block + title_height, plot_width, panel_height,
                    (-pad, len(points) - 1 + pad), ylim)
        xticks = list(range(len(points))) if named_ticks else [t for t in nice_ticks(*axes.xlim) if t == int(t)]
        yticks = nice_ticks(*axes.ylim, most=9)
        axes.grid(xticks=xticks, yticks=yticks)
        legend: list[LegendEntry] = []
        flagged = [(rank, value, host) for rank, (value, host) in enumerate(points) if (host, name) in outliers]
        few = len(points) <= 200
        ring = 10 if few else 5
        if flagged:
            legend.append(LegendEntry("outlier (robust z)", "ring", CLAIM_COLOR, marker_size=ring))
        for line in claim_lines:
            legend.extend(_claim_legend(line))
            if line.op in (">=", "<=") and line.value is not None:
                axes.hline(line.value, color=CLAIM_COLOR, width=1.3)
                bound = line.lower_with_tolerance if line.op == ">=" else line.upper_with_tolerance
                if bound is not None and bound != line.value:
                    axes.hline(bound, color=CLAIM_COLOR, width=1.0, dash="3.7,1.6")
            elif line.op == "between" and line.low is not None and line.high is not None:
                axes.hspan(line.lower_with_tolerance or line.low, line.upper_with_tolerance or line.high,
                           color=CLAIM_COLOR, opacity=0.08)
                for edge in (line.low, line.high):
                    axes.hline(edge, color=CLAIM_COLOR, width=1.1)
        by_color: dict[str, list[tuple[float, float, str]]] = {}
        for rank, (value, host) in enumerate(points):
            outlier = " (outlier)" if (host, name) in outliers else ""
            by_color.setdefault(color_of.get(host, OTHER_COLOR), []).append(
                (axes.x(rank), axes.y(value), f"{host}: {value:.1f} tok/s{outlier}"))
        for color, xy in by_color.items():
            canvas.titled_dots(xy, color=color, diameter=4.5 if few else 2.5)
        canvas.markers([(axes.x(rank), axes.y(value)) for rank, value, _ in flagged], shape="ring",
                       color=CLAIM_COLOR, size=ring, edge_width=1.3 if few else 0.7)
        # Names only where they stay legible: not when the x axis names every host already, and not for a crowd
        # of outliers (the outlier table lists them).
        if not named_ticks and len(flagged) <= ANNOTATED_OUTLIERS_PER_PANEL:
            for rank, value, host in flagged:
                canvas.text(axes.x(rank) + 6, axes.y(value) + 3, host, size=8, color=CLAIM_COLOR)
        label_width = axes.ticks(xticks=xticks, yticks=yticks,
                                 xlabels=[host for _, host in points] if named_ticks else None,
                                 xlabel_size=7 if named_ticks else 9, rotate_xlabels=named_ticks)
        fleet_median = workload.median_decode_tok_s.median if workload.median_decode_tok_s else float("nan")
        axes.title(f"{fleet.recipe} · {name}: median decode tok/s per host ({len(points)} hosts, fleet median "
                   f"{fleet_median:.1f})")
        axes.ylabel("tok/s", tick_label_width=label_width)
        if not named_ticks:
            axes.xlabel("hosts, sorted by tok/s", below=TICK_LENGTH + TICK_PAD + 9 + 3.5)
        if index == 0:
            # The colors mean the same in every panel: explained once, on the first.
            legend.extend(LegendEntry(label, "dot", color) for color, label in group_legend)
        axes.legend(legend, loc="outside right")
    return canvas.svg()


def acceptance_curves_svg(fleet: RecipeFleet, hosts: Sequence[HostEntry]) -> str | None:
    """Per-position acceptance of every host (grey, each curve's tooltip naming its host), the fleet median
    (black) and a per-position claim (red); the y axis spans the curves and the claim."""
    panels = [w for w in fleet.workloads if w.per_position_acceptance_median]
    if not panels:
        return None
    usable = _figures_by_host(hosts)
    curves_of = {w.workload: [(host, f.per_position_acceptance) for host, figures in usable
                              if (f := figures.get(w.workload)) is not None and f.per_position_acceptance]
                 for w in panels}
    legend_labels = ["fleet median", "p10..p90"] \
        + [f"hosts ({len(curves)}): min..max" for curves in curves_of.values()] \
        + [f"claim {line.claim_id}" for w in panels for line in w.claims if line.op == "per_position"]
    columns = min(len(panels), 2)
    rows = (len(panels) + columns - 1) // columns
    left, right, top, bottom = 0.6 * PT_PER_INCH, 0.15 * PT_PER_INCH, 0.35 * PT_PER_INCH, 0.5 * PT_PER_INCH
    hspace = 0.85 * PT_PER_INCH
    column_width = 5 * PT_PER_INCH
    width, height = column_width * columns, 3.4 * rows * PT_PER_INCH
    # Each column: its panel, then its legend (outside the panel, where it hides no curve).
    panel_width = column_width - left - right - min(legend_width(legend_labels), 0.4 * column_width)
    panel_height = (height - top - bottom - hspace * (rows - 1)) / rows
    canvas = Canvas(width, height, _id_prefix("acceptance", fleet.recipe))
    for index, workload in enumerate(panels):
        row, column = divmod(index, columns)
        median_curve = workload.per_position_acceptance_median
        curves = curves_of[workload.workload]
        claimed = [v for line in workload.claims if line.op == "per_position" for v in line.values or []]
        ylim = data_limits([v for _, curve in curves for v in curve] + median_curve + claimed, floor=0.0,
                           ceiling=1.02)
        axes = Axes(canvas, column * column_width + left, top + row * (panel_height + hspace), panel_width,
                    panel_height, (0.8, max(len(median_curve), 1) + 0.2), ylim)
        positions = list(range(1, len(median_curve) + 1))
        yticks = nice_ticks(*axes.ylim, most=6)
        axes.grid(xticks=positions, yticks=yticks)
        legend: list[LegendEntry] = []
        if len(curves) <= CURVES_UP_TO_HOSTS:
            for host, curve in curves:
                canvas.polyline([(axes.x(p), axes.y(v)) for p, v in enumerate(curve, start=1)],
                                color=HOST_CURVE_COLOR, width=0.8, opacity=0.35,
                                title=f"{host}: " + " ".join(f"{v:.2f}" for v in curve))
            legend.append(LegendEntry(f"hosts ({len(curves)})", "line", HOST_CURVE_COLOR, opacity=0.35))
        else:
            # Thousands of lines are unreadable: the spread across hosts says the same.
            ordered = [sorted(c[p] for _, c in curves if len(c) > p) for p in range(len(positions))]
            axes.band(positions, [c[0] for c in ordered], [c[-1] for c in ordered], color=HOST_CURVE_COLOR,
                      opacity=0.12)
            axes.band(positions, [percentile(c, 10) for c in ordered],
                      [percentile(c, 90) for c in ordered], color=HOST_CURVE_COLOR, opacity=0.3)
            legend.append(LegendEntry(f"hosts ({len(curves)}): min..max", "band", HOST_CURVE_COLOR, opacity=0.12))
            legend.append(LegendEntry("p10..p90", "band", HOST_CURVE_COLOR, opacity=0.3))
        median_points = [(axes.x(p), axes.y(v)) for p, v in zip(positions, median_curve, strict=True)]
        canvas.polyline(median_points, color="#000000", width=2,
                        title="fleet median: " + " ".join(f"{v:.2f}" for v in median_curve))
        canvas.markers(median_points, shape="dot", color="#000000", size=6)
        legend.append(LegendEntry("fleet median", "line_dot", "#000000"))
        for line in workload.claims:
            if line.op == "per_position" and line.values:
                claim_points = [(axes.x(p), axes.y(v)) for p, v in enumerate(line.values, start=1)]
                canvas.polyline(claim_points, color=CLAIM_COLOR, width=1.5, dash="5.5,2.4",
                                title=f"claim {line.claim_id}: " + " ".join(f"{v:.2f}" for v in line.values))
                canvas.markers(claim_points, shape="square", color=CLAIM_COLOR, size=4)
                legend.append(LegendEntry(f"claim {line.claim_id}", "dashed_square", CLAIM_COLOR))
        label_width = axes.ticks(xticks=positions, yticks=yticks)
        axes.xlabel("draft position", below=TICK_LENGTH + TICK_PAD + 9 + 3.5)
        axes.ylabel("acceptance", tick_label_width=label_width)
        axes.title(f"{workload.workload}: per-position acceptance")
        axes.legend(legend, loc="outside right")
    return canvas.svg()


def drift_effects_svg(fleet: RecipeFleet) -> str | None:
    """For each drifting field value other than the majority: its hosts' median tok/s relative to the majority's,
    per workload (the "no-P2P hosts are 12% slower" view)."""
    effects = [e for e in fleet.field_effects if not e.is_majority]
    workloads = [w.workload for w in fleet.workloads if w.median_decode_tok_s is not None]
    if not effects or not workloads:
        return None
    labels = [f"{FIELD_LABELS[e.field]} = {_short(e.value, 20)} ({e.hosts} host{'s' if e.hosts != 1 else ''})"
              for e in effects]
    relative = []  # per workload, per effect, in %
    for workload in workloads:
        row = []
        for effect in effects:
            figure_of = {g.workload: g for g in effect.figures}
            value = figure_of[workload].relative_to_reference if workload in figure_of else None
            row.append(100 * value if value is not None else 0.0)
        relative.append(row)
    bar_height = 0.8 / len(workloads)
    # The data range with a 5% margin, widened to at least -5..5 and by a quarter for the bar labels.
    low, high = min(0.0, *(v for row in relative for v in row)), max(0.0, *(v for row in relative for v in row))
    margin = (high - low) * 0.05
    xlim = (min(low - margin, -5) * 1.25, max(high + margin, 5) * 1.25)
    y_low, y_high = -bar_height / 2, len(effects) - 1 + (len(workloads) - 0.5) * bar_height
    y_margin = (y_high - y_low) * 0.05
    left, right, top, bottom = 3.5 * PT_PER_INCH, 0.2 * PT_PER_INCH, 0.6 * PT_PER_INCH, 0.55 * PT_PER_INCH
    width, height = 10 * PT_PER_INCH, (1.0 + 0.25 * len(effects) * len(workloads)) * PT_PER_INCH
    canvas = Canvas(width, height, _id_prefix("drift", fleet.recipe))
    axes = Axes(canvas, left, top, width - left - right, height - top - bottom, xlim,
                (y_low - y_margin, y_high + y_margin), invert_y=True)
    xticks = nice_ticks(*xlim, most=9)
    label_positions = [index + 0.4 - bar_height / 2 for index in range(len(effects))]
    axes.grid(xticks=xticks, yticks=label_positions)
    for offset, (workload, row) in enumerate(zip(workloads, relative, strict=True)):
        color = PALETTE[offset % len(PALETTE)]
        for index, value in enumerate(row):
            center = index + offset * bar_height
            bar_top, bar_bottom = axes.y(center - bar_height / 2), axes.y(center + bar_height / 2)
            canvas.rect(axes.x(0), bar_top, axes.x(value) - axes.x(0), bar_bottom - bar_top, fill=color,
                        title=f"{labels[index]}, {workload}: {value:+.1f}% tok/s vs the majority")
            end = axes.x(value) + (2 if value >= 0 else -2)
            canvas.text(end, (bar_top + bar_bottom) / 2 + 8 * 0.35, f"{value:+.1f}%", size=8,
                        anchor="start" if value >= 0 else "end")
    axes.vline(0, color="#000000", width=0.8)
    axes.ticks(xticks=xticks, yticks=label_positions, ylabels=labels)
    axes.xlabel("median decode tok/s relative to the hosts with the majority value (%)",
                below=TICK_LENGTH + TICK_PAD + 9 + 3.5)
    # The title, then the workloads' colors in one row under it, flush right, above the plot.
    canvas.text(axes.left, axes.top - 8 - LEGEND_SIZE - 8, f"{fleet.recipe}: what drift costs", size=10)
    size, handle, gap, spacing = LEGEND_SIZE, 2 * LEGEND_SIZE, 0.8 * LEGEND_SIZE, 2 * LEGEND_SIZE
    entries = [LegendEntry(workload, "bar", PALETTE[offset % len(PALETTE)])
               for offset, workload in enumerate(workloads)]
    x = axes.right - sum(handle + gap + text_width(e.label, size) for e in entries) - spacing * (len(entries) - 1)
    for entry in entries:
        draw_handle(canvas, entry, x, axes.top - 8, handle, size)
        canvas.text(x + handle + gap, axes.top - 8 + size * 0.35, entry.label, size=size)
        x += handle + gap + text_width(entry.label, size) + spacing
    return canvas.svg()
