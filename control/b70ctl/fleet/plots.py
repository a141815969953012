"""Plots of the fleet report as inline SVG strings (matplotlib, Agg: no display, no network).

Above RASTERIZE_ABOVE_HOSTS hosts the point and line artists are embedded as one bitmap inside the SVG, so the
file stays a few hundred KB at 5,000 hosts while axes and text stay vector and sharp.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.collections import LineCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from b70ctl.fleet import stats  # noqa: E402
from b70ctl.fleet.model import FIELD_LABELS, FingerprintGroup, HostEntry, RecipeFleet  # noqa: E402

RASTERIZE_ABOVE_HOSTS = 300
CURVES_UP_TO_HOSTS = 60
NAMED_TICKS_UP_TO_HOSTS = 40
ANNOTATED_OUTLIERS_PER_PANEL = 8
GROUP_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
OTHER_COLOR = "#7f7f7f"
CLAIM_COLOR = "#d62728"

STYLE = {
    "svg.fonttype": "none",  # text stays text: smaller files, searchable, crisp
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "svg.hashsalt": "b70ctl-fleet",  # stable ids: the same report renders to the same bytes
}


def _svg(figure: Figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(figure)
    text = buffer.getvalue()
    # Drop the XML prolog and DOCTYPE: the SVG is inlined into HTML, where they are not allowed mid-document.
    return text[text.index("<svg"):]


def _fixed_margins(figure: Figure, *, left_in: float, right_in: float, top_in: float, bottom_in: float,
                   hspace_in: float = 0.0, wspace_in: float = 0.0, rows: int = 1, columns: int = 1) -> None:
    """Margins in inches. tight_layout would find them by drawing the figure once more, which costs as much as
    the SVG itself; these plots have known label sizes, so fixed margins do."""
    width, height = figure.get_size_inches()
    panel_height = (height - top_in - bottom_in - hspace_in * (rows - 1)) / rows
    panel_width = (width - left_in - right_in - wspace_in * (columns - 1)) / columns
    figure.subplots_adjust(left=left_in / width, right=1 - right_in / width, top=1 - top_in / height,
                           bottom=bottom_in / height, hspace=hspace_in / panel_height,
                           wspace=wspace_in / panel_width)


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
    if len(differences) > 60:
        differences = differences[:59] + "…"
    return f"{differences} ({len(group.hosts)})"


def _host_colors(fleet: RecipeFleet) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Color per host by fingerprint group (largest groups first); the rest share grey."""
    color_of: dict[str, str] = {}
    legend: list[tuple[str, str]] = []
    other_hosts = 0
    for index, group in enumerate(fleet.fingerprint_groups):
        color = GROUP_COLORS[index] if index < len(GROUP_COLORS) else OTHER_COLOR
        if index < len(GROUP_COLORS):
            legend.append((color, _group_label(group)))
        else:
            other_hosts += len(group.hosts)
        for host in group.hosts:
            color_of[host] = color
    if other_hosts:
        legend.append((OTHER_COLOR, f"other fingerprints ({other_hosts})"))
    return color_of, legend


def decode_per_host_svg(fleet: RecipeFleet, hosts: Sequence[HostEntry]) -> str | None:
    """Median decode tok/s of every host, one panel per workload, hosts sorted by tok/s, against the claim line
    (solid: the published value; dashed: the bound with tolerance; shaded: what counts as met)."""
    panels = [w for w in fleet.workloads if w.median_decode_tok_s is not None]
    if not panels:
        return None
    usable = [h for h in hosts if h.status in ("verified", "partial")]
    color_of, legend = _host_colors(fleet)
    outliers = {(o.host, o.workload) for o in fleet.outliers}
    with plt.rc_context(STYLE):
        named_ticks = len(usable) <= NAMED_TICKS_UP_TO_HOSTS
        below_in = 1.0 if named_ticks else 0.45
        panel_in, title_in = 2.3, 0.35
        figure, axes_list = plt.subplots(len(panels), 1, squeeze=False,
                                         figsize=(10, len(panels) * (panel_in + title_in + below_in)))
        _fixed_margins(figure, left_in=0.7, right_in=0.15, top_in=title_in, bottom_in=below_in,
                       hspace_in=title_in + below_in, rows=len(panels))
        for axes, workload in zip(axes_list[:, 0], panels, strict=True):
            points = sorted(((f.median_decode_tok_s, h.host) for h in usable
                             if (f := h.workload(workload.workload)) is not None
                             and f.median_decode_tok_s is not None))
            rasterize = len(points) > RASTERIZE_ABOVE_HOSTS
            by_color: dict[str, tuple[list[int], list[float]]] = {}
            for rank, (value, host) in enumerate(points):
                xs, ys = by_color.setdefault(color_of.get(host, OTHER_COLOR), ([], []))
                xs.append(rank)
                ys.append(value)
            # One marker line per color: far cheaper to draw than a scatter with a color per point.
            for color, (xs, ys) in by_color.items():
                axes.plot(xs, ys, linestyle="", marker="o", markersize=4.5 if len(points) <= 200 else 2.5,
                          markeredgewidth=0, color=color, zorder=3, rasterized=rasterize)
            flagged = [(rank, value, host) for rank, (value, host) in enumerate(points)
                       if (host, workload.workload) in outliers]
            if flagged:
                few = len(points) <= 200
                axes.plot([f[0] for f in flagged], [f[1] for f in flagged], linestyle="", marker="o",
                          markersize=10 if few else 5, markerfacecolor="none", markeredgecolor=CLAIM_COLOR,
                          markeredgewidth=1.3 if few else 0.7, zorder=4, rasterized=rasterize,
                          label="outlier (robust z)")
                # Names only where they stay legible: not when the x axis names every host already, and not for
                # a crowd of outliers (the outlier table lists them).
                annotate = not named_ticks and len(flagged) <= ANNOTATED_OUTLIERS_PER_PANEL
                for rank, value, host in (flagged if annotate else []):
                    axes.annotate(host, (rank, value), textcoords="offset points", xytext=(6, -3), fontsize=8,
                                  color=CLAIM_COLOR)
            for line in workload.claims:
                if "decode_tok_s" not in line.metric:
                    continue
                if line.op in (">=", "<=") and line.value is not None:
                    axes.axhline(line.value, color=CLAIM_COLOR, linewidth=1.3,
                                 label=f"claim {line.claim_id} {line.op} {line.value:g}")
                    bound = line.lower_with_tolerance if line.op == ">=" else line.upper_with_tolerance
                    if bound is not None and bound != line.value:
                        axes.axhline(bound, color=CLAIM_COLOR, linewidth=1, linestyle="--",
                                     label=f"with tolerance: {bound:.1f}")
                elif line.op == "between" and line.low is not None and line.high is not None:
                    axes.axhspan(line.lower_with_tolerance or line.low, line.upper_with_tolerance or line.high,
                                 color=CLAIM_COLOR, alpha=0.08,
                                 label=f"claim {line.claim_id} {line.low:g}..{line.high:g} (with tolerance)")
                    for edge in (line.low, line.high):
                        axes.axhline(edge, color=CLAIM_COLOR, linewidth=1.1)
            axes.set_title(f"{fleet.recipe} · {workload.workload}: median decode tok/s per host "
                           f"({len(points)} hosts, fleet median {workload.median_decode_tok_s.median:.1f})",
                           loc="left")
            axes.set_ylabel("tok/s")
            # Explicit limits: from 0 (a rate), and room above the highest point or claim line.
            tops = [value for value, _ in points] + [v for line in workload.claims if "decode_tok_s" in line.metric
                                                     for v in (line.value, line.high, line.upper_with_tolerance)
                                                     if v is not None]
            axes.set_ylim(0, max(tops) * 1.08 if tops else 1)
            if named_ticks:
                axes.set_xticks(list(range(len(points))), [p[1] for p in points], rotation=90, fontsize=7)
            else:
                axes.set_xlabel("hosts, sorted by tok/s")
            handles, labels = axes.get_legend_handles_labels()
            if axes is axes_list[0, 0]:
                # The colors mean the same in every panel: explained once, on the first.
                for color, label in legend:
                    handles.append(plt.Line2D([], [], marker="o", linestyle="", color=color))
                    labels.append(label)
            if handles:
                axes.legend(handles, labels, fontsize=7, loc="lower right", framealpha=0.9)
        return _svg(figure)


def acceptance_curves_svg(fleet: RecipeFleet, hosts: Sequence[HostEntry]) -> str | None:
    """Per-position acceptance of every host (grey), the fleet median (black) and a per-position claim (red)."""
    panels = [w for w in fleet.workloads if w.per_position_acceptance_median]
    if not panels:
        return None
    usable = [h for h in hosts if h.status in ("verified", "partial")]
    columns = min(len(panels), 2)
    rows = (len(panels) + columns - 1) // columns
    with plt.rc_context(STYLE):
        figure, axes_grid = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
        _fixed_margins(figure, left_in=0.6, right_in=0.15, top_in=0.35, bottom_in=0.5, hspace_in=0.85,
                       wspace_in=0.7, rows=rows, columns=columns)
        for index, workload in enumerate(panels):
            axes = axes_grid[index // columns][index % columns]
            curves = [f.per_position_acceptance for h in usable
                      if (f := h.workload(workload.workload)) is not None and f.per_position_acceptance]
            median_curve = workload.per_position_acceptance_median
            positions = list(range(1, len(median_curve) + 1))
            if len(curves) <= CURVES_UP_TO_HOSTS:
                segments = [list(zip(range(1, len(c) + 1), c, strict=True)) for c in curves]
                axes.add_collection(LineCollection(segments, colors="#555555", linewidths=0.8, alpha=0.35,
                                                   label=f"hosts ({len(curves)})"))
            else:
                # Thousands of lines are unreadable and slow to draw: the spread across hosts says the same.
                columns_of = [[c[p] for c in curves if len(c) > p] for p in range(len(positions))]
                ordered = [sorted(column) for column in columns_of]
                axes.fill_between(positions, [c[0] for c in ordered], [c[-1] for c in ordered], color="#555555",
                                  alpha=0.12, linewidth=0, label=f"hosts ({len(curves)}): min..max")
                axes.fill_between(positions, [stats.quantile(c, 0.1) for c in ordered],
                                  [stats.quantile(c, 0.9) for c in ordered], color="#555555", alpha=0.3,
                                  linewidth=0, label="p10..p90")
            axes.plot(positions, median_curve, color="black", linewidth=2, marker="o", label="fleet median")
            for line in workload.claims:
                if line.op == "per_position" and line.values:
                    claim_positions = list(range(1, len(line.values) + 1))
                    axes.plot(claim_positions, line.values, color=CLAIM_COLOR, linestyle="--", marker="s",
                              markersize=4, label=f"claim {line.claim_id}")
            axes.set_xlim(0.8, max(len(median_curve), 1) + 0.2)
            axes.set_ylim(0, 1.02)
            axes.set_xticks(positions)
            axes.set_xlabel("draft position")
            axes.set_ylabel("acceptance")
            axes.set_title(f"{workload.workload}: per-position acceptance", loc="left")
            axes.legend(fontsize=7, loc="lower left")  # acceptance falls with position: lower left stays free
        for index in range(len(panels), rows * columns):
            axes_grid[index // columns][index % columns].set_visible(False)
        return _svg(figure)


def drift_effects_svg(fleet: RecipeFleet) -> str | None:
    """For each drifting field value other than the majority: its hosts' median tok/s relative to the majority's,
    per workload (the "no-P2P hosts are 12% slower" view)."""
    effects = [e for e in fleet.field_effects if not e.is_majority]
    workloads = [w.workload for w in fleet.workloads if w.median_decode_tok_s is not None]
    if not effects or not workloads:
        return None
    labels = [f"{FIELD_LABELS[e.field]} = {_short(e.value, 20)} ({e.hosts} host{'s' if e.hosts != 1 else ''})"
              for e in effects]
    bar_height = 0.8 / len(workloads)
    with plt.rc_context(STYLE):
        figure, axes = plt.subplots(figsize=(10, 1.0 + 0.25 * len(effects) * len(workloads)))
        _fixed_margins(figure, left_in=3.5, right_in=0.2, top_in=0.6, bottom_in=0.55)
        for offset, workload in enumerate(workloads):
            relative = []
            for effect in effects:
                figure_of = {g.workload: g for g in effect.figures}
                value = figure_of[workload].relative_to_reference if workload in figure_of else None
                relative.append(100 * value if value is not None else 0.0)
            positions = [index + offset * bar_height for index in range(len(effects))]
            bars = axes.barh(positions, relative, height=bar_height, color=GROUP_COLORS[offset % len(GROUP_COLORS)],
                             label=workload)
            axes.bar_label(bars, labels=[f"{r:+.1f}%" for r in relative], fontsize=7, padding=2)
        axes.set_yticks([index + 0.4 - bar_height / 2 for index in range(len(effects))], labels)
        axes.invert_yaxis()
        axes.axvline(0, color="black", linewidth=0.8)
        axes.set_xlabel("median decode tok/s relative to the hosts with the majority value (%)")
        axes.set_title(f"{fleet.recipe}: what drift costs", loc="left")
        low, high = axes.get_xlim()
        axes.set_xlim(min(low, -5) * 1.25, max(high, 5) * 1.25)
        axes.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(workloads), frameon=False)
        return _svg(figure)
