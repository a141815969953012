"""A small SVG writer for the reports' plots (fleet.html, each host's report.html): a canvas, axes that map data
to points, ticks, grid, legends, and <title> tooltips that name what a mark is (a host, a request) and its value.

The plots are a few panels of points, lines, bands and bars. Written as SVG text directly they cost milliseconds;
drawn by matplotlib they cost about a second whatever the fleet size, plus another to import it. Units are points
(1/72 in), as in matplotlib's SVG: a figure 10 in wide is 720 units. Text stays text, sized and placed by the
browser; its width is estimated only to size legend boxes and margins. The output is the same for the same input.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from b70ctl.escaping import html_text as escape

PT_PER_INCH = 72
FONT_FAMILY = "'DejaVu Sans', 'Bitstream Vera Sans', Verdana, Arial, Helvetica, sans-serif"
TEXT_COLOR = "#000000"
SPINE_COLOR = "#000000"
GRID_COLOR = "#b0b0b0"
GRID_OPACITY = 0.3
LEGEND_EDGE_COLOR = "#cccccc"
LEGEND_SIZE = 9  # as the tick labels: legends are read, not glanced at
# The categorical colors of every plot (matplotlib's tab10 order, without the red claims are drawn in and the gray).
CLAIM_COLOR = "#d62728"  # a claim's line and band, in every plot
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
CHAR_WIDTH = 0.56  # of the font size: the average advance of DejaVu Sans, for layout estimates only
ASCENT = 0.73  # of the font size: baseline below the top of the text, for layout
TICK_LENGTH = 3.5
TICK_PAD = 3.5
MINUS = "\u2212"  # a real minus sign in tick labels, as matplotlib writes them

Anchor = Literal["start", "middle", "end"]


def num(value: float) -> str:
    """A coordinate with one decimal, no trailing zeros: the files stay small at thousands of points."""
    text = f"{value:.1f}"
    if text.endswith(".0"):
        text = text[:-2]
    return "0" if text == "-0" else text


def text_width(text: str, size: float) -> float:
    return len(text) * size * CHAR_WIDTH


def nice_ticks(low: float, high: float, most: int = 8) -> list[float]:
    """At most `most` ticks between low and high (both included), spaced 1, 2, 2.5 or 5 x a power of ten."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / most
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(s * magnitude for s in (1, 2, 2.5, 5, 10) if s * magnitude >= raw * (1 - 1e-9))
    first = math.ceil(low / step - 1e-9)
    last = math.floor(high / step + 1e-9)
    return [round(index * step, 12) for index in range(first, last + 1)]


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """The ticks with as many decimals as their spacing needs (0.5 -> 1 decimal, 2.5 -> 1, 20 -> 0)."""
    step = min((b - a for a, b in itertools.pairwise(ticks)), default=1.0) or 1.0
    decimals = next((d for d in range(0, 7) if abs(round(step, d) - step) <= 1e-9 * max(1.0, abs(step))), 6)
    return [f"{tick:.{decimals}f}".replace("-", MINUS) if round(tick, decimals) != 0 else f"{0:.{decimals}f}"
            for tick in ticks]


def legend_width(labels: Sequence[str], size: float = LEGEND_SIZE) -> float:
    """The width of a legend of these labels as Axes.legend draws it, to reserve room for one outside the axes."""
    return size * (0.5 + 0.8 + 2.0 + 0.8) + max((text_width(label, size) for label in labels), default=0.0)


def data_limits(values: Sequence[float], *, margin: float = 0.08, floor: float | None = None,
                ceiling: float | None = None) -> tuple[float, float]:
    """Axis limits that fit the values: their range widened by `margin` of it on each side (a single value, or
    equal ones, by `margin` of the value), kept within floor and ceiling."""
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return (0.0, 1.0)
    low, high = min(finite), max(finite)
    spread = (high - low) or abs(high) or 1.0
    low, high = low - margin * spread, high + margin * spread
    if floor is not None:
        low = max(low, floor)
    if ceiling is not None:
        high = min(high, ceiling)
    return (low, high) if high > low else (low - 0.5, low + 0.5)


def _title(text: str | None) -> str:
    """A tooltip: browsers show an element's <title> child on hover."""
    return "" if text is None else f"<title>{escape(text)}</title>"


def _style(**properties: object) -> str:
    """SVG presentation attributes; None values are left out."""
    return "".join(f' {name.replace("_", "-")}="{value}"' for name, value in properties.items() if value is not None)


class Canvas:
    """One SVG document. Elements are appended in drawing order: later ones are on top."""

    def __init__(self, width: float, height: float, id_prefix: str) -> None:
        self.width = width
        self.height = height
        self.id_prefix = id_prefix  # several plots share one HTML page: their ids must not collide
        self.defs: list[str] = []
        self.body: list[str] = []
        self._next_id = 0

    def new_id(self) -> str:
        self._next_id += 1
        return f"{self.id_prefix}-{self._next_id}"

    def text(self, x: float, y: float, content: str, *, size: float = 9, anchor: Anchor = "start",
             color: str = TEXT_COLOR, rotate: float | None = None) -> None:
        """Text whose baseline starts (or is centered, or ends) at x, y; rotate turns it counterclockwise."""
        transform = f"rotate({num(-rotate)} {num(x)} {num(y)})" if rotate else None
        fill = color if color != TEXT_COLOR else None
        self.body.append(f'<text x="{num(x)}" y="{num(y)}"'
                         + _style(font_size=num(size), text_anchor=anchor if anchor != "start" else None,
                                  fill=fill, transform=transform)
                         + f">{escape(content)}</text>")

    def line(self, x1: float, y1: float, x2: float, y2: float, *, color: str, width: float = 1.0,
             dash: str | None = None, opacity: float | None = None) -> None:
        self.body.append(f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}"'
                         + _style(stroke=color, stroke_width=num(width), stroke_dasharray=dash,
                                  stroke_opacity=opacity) + "/>")

    def rect(self, x: float, y: float, width: float, height: float, *, fill: str, opacity: float | None = None,
             stroke: str | None = None, stroke_width: float | None = None, radius: float | None = None,
             title: str | None = None) -> None:
        if width < 0:
            x, width = x + width, -width
        if height < 0:
            y, height = y + height, -height
        attributes = (f'<rect x="{num(x)}" y="{num(y)}" width="{num(width)}" height="{num(height)}"'
                      + _style(rx=num(radius) if radius else None, fill=fill, fill_opacity=opacity, stroke=stroke,
                               stroke_width=num(stroke_width) if stroke_width else None))
        self.body.append(attributes + (f">{_title(title)}</rect>" if title else "/>"))

    def polyline(self, points: Sequence[tuple[float, float]], *, color: str, width: float = 1.0,
                 dash: str | None = None, opacity: float | None = None, title: str | None = None) -> None:
        if not points:
            return
        coordinates = " ".join(f"{num(x)},{num(y)}" for x, y in points)
        attributes = (f'<polyline points="{coordinates}" fill="none"'
                      + _style(stroke=color, stroke_width=num(width), stroke_dasharray=dash,
                               stroke_opacity=opacity, stroke_linejoin="round"))
        self.body.append(attributes + (f">{_title(title)}</polyline>" if title else "/>"))

    def polygon(self, points: Sequence[tuple[float, float]], *, fill: str, opacity: float | None = None) -> None:
        coordinates = " ".join(f"{num(x)},{num(y)}" for x, y in points)
        self.body.append(f'<polygon points="{coordinates}"' + _style(fill=fill, fill_opacity=opacity) + "/>")

    def dots(self, points: Sequence[tuple[float, float]], *, color: str, diameter: float) -> None:
        """Filled round markers, all in one path: each is a zero-length stroke with a round cap. Thousands of
        points cost a dozen bytes each."""
        if not points:
            return
        path = "".join(f"M{num(x)} {num(y)}h0" for x, y in points)
        self.body.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="{num(diameter)}" '
                         'stroke-linecap="round"/>')

    def titled_dots(self, points: Sequence[tuple[float, float, str]], *, color: str, diameter: float) -> None:
        """Dots as `dots` draws them, each its own element with a tooltip (a host and its value): a group carries
        the stroke, each point is a zero-length path and its <title>."""
        if not points:
            return
        self.body.append(f'<g fill="none" stroke="{color}" stroke-width="{num(diameter)}" stroke-linecap="round">'
                         + "".join(f'<path d="M{num(x)} {num(y)}h0">{_title(title)}</path>' for x, y, title in points)
                         + "</g>")

    def markers(self, points: Sequence[tuple[float, float]], *, shape: Literal["ring", "square", "dot"],
                color: str, size: float, edge_width: float = 1.0) -> None:
        """Markers of one shape, defined once and placed with <use>."""
        if not points:
            return
        marker_id = self.new_id()
        half = size / 2
        if shape == "ring":
            self.defs.append(f'<circle id="{marker_id}" r="{num(half)}" fill="none" stroke="{color}" '
                             f'stroke-width="{num(edge_width)}"/>')
        elif shape == "dot":
            self.defs.append(f'<circle id="{marker_id}" r="{num(half)}" fill="{color}"/>')
        else:
            self.defs.append(f'<rect id="{marker_id}" x="{num(-half)}" y="{num(-half)}" width="{num(size)}" '
                             f'height="{num(size)}" fill="{color}"/>')
        self.body.extend(f'<use xlink:href="#{marker_id}" x="{num(x)}" y="{num(y)}"/>' for x, y in points)

    def svg(self) -> str:
        width, height = num(self.width), num(self.height)
        defs = f"<defs>{''.join(self.defs)}</defs>" if self.defs else ""
        return (f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
                f'width="{width}pt" height="{height}pt" viewBox="0 0 {width} {height}" '
                f'font-family="{FONT_FAMILY}">'
                f'<rect width="{width}" height="{height}" fill="#ffffff"/>{defs}\n'
                + "\n".join(self.body) + "\n</svg>\n")


@dataclass(frozen=True)
class LegendEntry:
    label: str
    kind: Literal["line", "dashed", "dot", "ring", "square", "band", "bar", "line_dot", "dashed_square"]
    color: str
    opacity: float | None = None
    marker_size: float | None = None  # of a ring, as drawn in the plot


class Axes:
    """A data rectangle on a canvas: left, top, width and height in points; xlim and ylim in data units."""

    def __init__(self, canvas: Canvas, left: float, top: float, width: float, height: float,
                 xlim: tuple[float, float], ylim: tuple[float, float], *, invert_y: bool = False) -> None:
        self.canvas = canvas
        self.left, self.top, self.width, self.height = left, top, width, height
        self.xlim, self.ylim = xlim, ylim
        self.invert_y = invert_y

    @property
    def right(self) -> float:
        return self.left + self.width

    @property
    def bottom(self) -> float:
        return self.top + self.height

    def x(self, value: float) -> float:
        low, high = self.xlim
        return self.left + (value - low) / (high - low) * self.width if high != low else self.left

    def y(self, value: float) -> float:
        low, high = self.ylim
        fraction = (value - low) / (high - low) if high != low else 0.0
        return self.top + fraction * self.height if self.invert_y else self.bottom - fraction * self.height

    def clamp_y(self, value: float) -> float:
        return min(max(self.y(value), self.top), self.bottom)

    def hline(self, value: float, *, color: str, width: float = 1.0, dash: str | None = None) -> None:
        y = self.clamp_y(value)
        self.canvas.line(self.left, y, self.right, y, color=color, width=width, dash=dash)

    def vline(self, value: float, *, color: str, width: float = 1.0) -> None:
        x = self.x(value)
        self.canvas.line(x, self.top, x, self.bottom, color=color, width=width)

    def hspan(self, low: float, high: float, *, color: str, opacity: float) -> None:
        top, bottom = self.clamp_y(high), self.clamp_y(low)
        self.canvas.rect(self.left, min(top, bottom), self.width, abs(bottom - top), fill=color, opacity=opacity)

    def band(self, xs: Sequence[float], lows: Sequence[float], highs: Sequence[float], *, color: str,
             opacity: float) -> None:
        """The area between two curves, as fill_between draws it."""
        upper = [(self.x(x), self.y(v)) for x, v in zip(xs, highs, strict=True)]
        lower = [(self.x(x), self.y(v)) for x, v in zip(xs, lows, strict=True)]
        self.canvas.polygon(upper + lower[::-1], fill=color, opacity=opacity)

    def grid(self, *, xticks: Sequence[float], yticks: Sequence[float]) -> None:
        """Grid lines at the ticks, under the data: draw them first."""
        for tick in self._inside(xticks, self.xlim):
            self.canvas.line(self.x(tick), self.top, self.x(tick), self.bottom, color=GRID_COLOR, width=0.8,
                             opacity=GRID_OPACITY)
        for tick in self._inside(yticks, self.ylim):
            self.canvas.line(self.left, self.y(tick), self.right, self.y(tick), color=GRID_COLOR, width=0.8,
                             opacity=GRID_OPACITY)

    def ticks(self, *, xticks: Sequence[float], yticks: Sequence[float], xlabels: Sequence[str] | None = None,
              ylabels: Sequence[str] | None = None, xlabel_size: float = 9, ylabel_size: float = 9,
              rotate_xlabels: bool = False) -> float:
        """The left and bottom spines, tick marks and tick labels. Returns the width of the widest y tick label,
        for placing the y axis label."""
        canvas = self.canvas
        canvas.line(self.left, self.top, self.left, self.bottom, color=SPINE_COLOR, width=0.8)
        canvas.line(self.left, self.bottom, self.right, self.bottom, color=SPINE_COLOR, width=0.8)
        labelled_x = list(zip(xticks, tick_labels(xticks) if xlabels is None else xlabels, strict=True))
        labelled_y = list(zip(yticks, tick_labels(yticks) if ylabels is None else ylabels, strict=True))
        for tick, label in labelled_x:
            if tick not in self._inside([tick], self.xlim):
                continue
            x = self.x(tick)
            canvas.line(x, self.bottom, x, self.bottom + TICK_LENGTH, color=SPINE_COLOR, width=0.8)
            if rotate_xlabels:
                canvas.text(x + xlabel_size * 0.35, self.bottom + TICK_LENGTH + TICK_PAD, label, size=xlabel_size,
                            anchor="end", rotate=90)
            else:
                canvas.text(x, self.bottom + TICK_LENGTH + TICK_PAD + xlabel_size * ASCENT, label, size=xlabel_size,
                            anchor="middle")
        widest = 0.0
        for tick, label in labelled_y:
            if tick not in self._inside([tick], self.ylim):
                continue
            y = self.y(tick)
            canvas.line(self.left - TICK_LENGTH, y, self.left, y, color=SPINE_COLOR, width=0.8)
            canvas.text(self.left - TICK_LENGTH - TICK_PAD, y + ylabel_size * 0.35, label, size=ylabel_size,
                        anchor="end")
            widest = max(widest, text_width(label, ylabel_size))
        return widest

    @staticmethod
    def _inside(ticks: Sequence[float], limits: tuple[float, float]) -> list[float]:
        low, high = min(limits), max(limits)
        span = (high - low) * 1e-9
        return [tick for tick in ticks if low - span <= tick <= high + span]

    def title(self, text: str, *, size: float = 10) -> None:
        self.canvas.text(self.left, self.top - 6, text, size=size)

    def xlabel(self, text: str, *, below: float, size: float = 9) -> None:
        """The x axis label, `below` points under the axes (past the tick labels)."""
        self.canvas.text(self.left + self.width / 2, self.bottom + below + size * ASCENT, text, size=size,
                         anchor="middle")

    def ylabel(self, text: str, *, tick_label_width: float, size: float = 9) -> None:
        x = self.left - TICK_LENGTH - TICK_PAD - tick_label_width - 4
        self.canvas.text(x, self.top + self.height / 2, text, size=size, anchor="middle", rotate=90)

    def legend(self, entries: Sequence[LegendEntry], *, loc: Literal["lower right", "lower left", "outside right"],
               size: float = LEGEND_SIZE) -> None:
        """A framed legend, one entry per row: inside the axes in a lower corner, or outside, right of the axes
        and level with their top (the figure leaves legend_width of room there), where it hides no data."""
        if not entries:
            return
        pad, handle, gap, row = 0.4 * size, 2.0 * size, 0.8 * size, 1.3 * size
        width = pad * 2 + handle + gap + max(text_width(entry.label, size) for entry in entries)
        height = pad * 2 + row * len(entries)
        inset = 0.5 * size
        if loc == "outside right":
            left, top = self.right + inset, self.top
        else:
            left = self.right - inset - width if loc == "lower right" else self.left + inset
            top = self.bottom - inset - height
        self.canvas.rect(left, top, width, height, fill="#ffffff", opacity=0.9, stroke=LEGEND_EDGE_COLOR,
                         stroke_width=0.8, radius=2)
        for index, entry in enumerate(entries):
            center = top + pad + row * (index + 0.5)
            draw_handle(self.canvas, entry, left + pad, center, handle, size)
            self.canvas.text(left + pad + handle + gap, center + size * 0.35, entry.label, size=size)


def draw_handle(canvas: Canvas, entry: LegendEntry, left: float, center: float, length: float, size: float) -> None:
    """The small sample of a legend entry: a line, a marker or a patch."""
    middle = left + length / 2
    if entry.kind in ("line", "dashed", "line_dot", "dashed_square"):
        dash = {"dashed": "3.7,1.6", "dashed_square": "5.5,2.4"}.get(entry.kind)
        width = {"line_dot": 2.0, "dashed_square": 1.5}.get(entry.kind, 1.3)
        canvas.line(left, center, left + length, center, color=entry.color, width=width, dash=dash,
                    opacity=entry.opacity)
        if entry.kind == "line_dot":
            canvas.markers([(middle, center)], shape="dot", color=entry.color, size=6)
        elif entry.kind == "dashed_square":
            canvas.markers([(middle, center)], shape="square", color=entry.color, size=4)
    elif entry.kind == "dot":
        canvas.dots([(middle, center)], color=entry.color, diameter=6)
    elif entry.kind == "ring":
        canvas.markers([(middle, center)], shape="ring", color=entry.color, size=entry.marker_size or 6)
    else:  # band, bar: a patch
        canvas.rect(left, center - size * 0.35, length, size * 0.7, fill=entry.color, opacity=entry.opacity)
