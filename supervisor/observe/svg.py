"""Inline SVG charts, drawn in Python: no JavaScript, no network, every element countable.

A :class:`Chart` is one panel: a plot area with a step axis and one or two value axes (linear or
log), polylines (``path.series``), vertical markers (``line.marker``) and rectangles
(``rect.cell``, a heatmap's cells). :func:`color_scale` maps a value to a red-to-green color.
Every text that reaches the SVG goes through :func:`esc`; values that are not finite numbers are
left out of a line (it breaks there) rather than drawn.
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
"""Colors of the generations, in order (then repeating)."""


def esc(text: Any) -> str:
    """``text`` escaped for HTML and SVG (element content and quoted attributes)."""
    return html.escape(str(text), quote=True)


def finite(x: Any) -> bool:
    """A real number that is neither NaN nor infinite (bools are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class Axis:
    """A value range mapped onto pixels; ``log`` for a log10 scale (positive values only)."""

    lo: float
    hi: float
    log: bool = False

    @classmethod
    def fit(cls, values: Iterable[Any], *, log: bool = False, pad: float = 0.05) -> Axis:
        """The axis that holds every finite value (positive ones on a log axis), padded."""
        vs = [float(v) for v in values if finite(v) and (not log or v > 0)]
        if not vs:
            return cls(1.0, 10.0, log) if log else cls(0.0, 1.0)
        lo, hi = min(vs), max(vs)
        if log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5, hi + 0.5
        span = hi - lo
        lo, hi = lo - pad * span, hi + pad * span
        return cls(10**lo, 10**hi, True) if log else cls(lo, hi)

    def frac(self, v: float) -> float | None:
        """Where ``v`` lies on the axis, 0 (``lo``) to 1 (``hi``); None when it cannot be drawn."""
        if not finite(v) or (self.log and v <= 0):
            return None
        if self.log:
            a, b, x = math.log10(self.lo), math.log10(self.hi), math.log10(v)
        else:
            a, b, x = self.lo, self.hi, float(v)
        return (x - a) / (b - a) if b != a else 0.5

    def ticks(self, n: int = 5) -> list[float]:
        """Round values to label the axis with (powers of ten on a log axis)."""
        if self.log:
            a, b = math.floor(math.log10(self.lo)), math.ceil(math.log10(self.hi))
            for mantissas in ((1,), (1, 2, 5), tuple(range(1, 10))):
                out = [
                    m * 10.0**e
                    for e in range(a, b + 1)
                    for m in mantissas
                    if self.lo <= m * 10.0**e <= self.hi
                ]
                if len(out) >= 3:
                    return out
            return Axis(self.lo, self.hi).ticks(n)
        raw = (self.hi - self.lo) / max(n, 1)
        mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
        step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
        first = math.ceil(self.lo / step) * step
        out, v = [], first
        while v <= self.hi + 1e-9 * step and len(out) < 50:
            out.append(round(v, 12))
            v += step
        return out


def _tip(label: str) -> str:
    """A tooltip: the element's ``<title>`` (empty for no label)."""
    return f"<title>{esc(label)}</title>" if label else ""


def tick_text(v: float) -> str:
    """A compact label: ``1.5k``, ``0.25``, ``1e-05``."""
    if v == 0:
        return "0"
    if abs(v) >= 1e4:
        return f"{v / 1e3:g}k" if abs(v) < 1e6 else f"{v:.0e}"
    if abs(v) < 1e-3:
        return f"{v:.0e}"
    return f"{v:.4g}"


def color_scale(frac: float | None) -> str:
    """0 -> red, 0.5 -> amber, 1 -> green; None (no value) -> grey."""
    if frac is None or not finite(frac):
        return "#bbbbbb"
    f = min(max(frac, 0.0), 1.0)
    stops = ((0.0, (215, 48, 39)), (0.5, (254, 224, 139)), (1.0, (26, 152, 80)))
    for (f0, c0), (f1, c1) in itertools.pairwise(stops):
        if f <= f1:
            t = (f - f0) / (f1 - f0)
            r, g, b = (round(a + (z - a) * t) for a, z in zip(c0, c1))
            return f"#{r:02x}{g:02x}{b:02x}"
    return "#1a9850"


class Chart:
    """One panel: a title, a step axis (x), a value axis (left) and an optional second one
    (right); see the module docstring."""

    def __init__(
        self,
        *,
        title: str,
        x: Axis,
        y: Axis,
        y2: Axis | None = None,
        width: int = 960,
        height: int = 220,
        y_label: str = "",
        y2_label: str = "",
        y_ticks: Sequence[tuple[float, str]] | None = None,
        css_class: str = "panel",
        left: int = 64,
        right: int | None = None,
    ) -> None:
        """``y_ticks``: (value, label) pairs for the left axis (None: round values); ``left``,
        ``right``: the margins (charts stacked with the same margins share their step axis)."""
        self.title, self.x, self.y, self.y2 = title, x, y, y2
        self.width, self.height = width, height
        self.y_label, self.y2_label, self.y_ticks = y_label, y2_label, y_ticks
        self.css_class = css_class
        self.left, self.top, self.bottom = left, 26, 28
        self.right = right if right is not None else (64 if y2 else 16)
        self._body: list[str] = []

    # -- geometry ---------------------------------------------------------------------------
    @property
    def plot_width(self) -> float:
        return self.width - self.left - self.right

    @property
    def plot_height(self) -> float:
        return self.height - self.top - self.bottom

    def px(self, x: float) -> float | None:
        """The pixel column of step ``x``."""
        f = self.x.frac(x)
        return None if f is None else self.left + f * self.plot_width

    def py(self, y: float, axis: int = 1) -> float | None:
        """The pixel row of value ``y`` on axis 1 (left) or 2 (right)."""
        ax = self.y2 if axis == 2 and self.y2 is not None else self.y
        f = ax.frac(y)
        if f is None:
            return None
        f = min(max(f, -0.02), 1.02)  # clip what lies outside (a spike) to the border
        return self.top + (1 - f) * self.plot_height

    # -- content ----------------------------------------------------------------------------
    def line(
        self,
        points: Iterable[tuple[Any, Any]],
        *,
        color: str,
        css_class: str = "series",
        axis: int = 1,
        dashed: bool = False,
        step: bool = False,
        label: str = "",
        stroke_width: float = 1.3,
    ) -> None:
        """A polyline through ``points`` (x, y), broken where a value cannot be drawn; ``step``
        draws it as a staircase (grades); ``stroke_width`` in pixels (a line to stand out:
        thicker)."""
        parts: list[str] = []
        pen_up = True
        prev_y: float | None = None
        for x, y in points:
            px, py = self.px(x), self.py(y, axis)
            if px is None or py is None:
                pen_up = True
                continue
            if pen_up:
                parts.append(f"M{px:.1f},{py:.1f}")
            elif step and prev_y is not None:
                parts.append(f"H{px:.1f}V{py:.1f}")
            else:
                parts.append(f"L{px:.1f},{py:.1f}")
            pen_up, prev_y = False, py
        if not parts:
            return
        dash = ' stroke-dasharray="4 3" stroke-opacity="0.55"' if dashed else ""
        tip = _tip(label)
        self._body.append(
            f'<path class="{esc(css_class)}" d="{"".join(parts)}" fill="none" '
            f'stroke="{esc(color)}" stroke-width="{stroke_width:g}"{dash}>{tip}</path>'
        )

    def vline(
        self, x: Any, *, color: str, css_class: str, label: str = "", dashed: bool = True
    ) -> None:
        """A vertical marker at step ``x`` across the plot (its label as a tooltip)."""
        px = self.px(x)
        if px is None:
            return
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        tip = _tip(label)
        self._body.append(
            f'<line class="marker {esc(css_class)}" x1="{px:.1f}" x2="{px:.1f}" '
            f'y1="{self.top}" y2="{self.top + self.plot_height:.1f}" stroke="{esc(color)}" '
            f'stroke-width="1.2"{dash}>{tip}</line>'
        )

    def rect(
        self, x0: float, x1: float, y0: float, y1: float, *, fill: str, label: str = ""
    ) -> None:
        """A heatmap cell between pixel columns ``x0``..``x1`` and rows ``y0``..``y1``."""
        w, h = max(x1 - x0, 0.5), max(y1 - y0, 0.5)
        self._rect("cell", x0, y0, w, h, f'fill="{esc(fill)}"', label)

    def outline(
        self, x: float, y: float, w: float, h: float, *, css_class: str, label: str = ""
    ) -> None:
        """An unfilled black box at pixel (x, y) of size w × h (a marked heatmap cell)."""
        self._rect(css_class, x, y, w, h, 'fill="none" stroke="#000" stroke-width="2"', label)

    def _rect(
        self, css_class: str, x: float, y: float, w: float, h: float, paint: str, label: str
    ) -> None:
        tip = _tip(label)
        self._body.append(
            f'<rect class="{esc(css_class)}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
            f'height="{h:.1f}" {paint}>{tip}</rect>'
        )

    def text(
        self, x: float, y: float, content: str, *, anchor: str = "start", cls: str = ""
    ) -> None:
        """A label at pixel (x, y)."""
        klass = f' class="{esc(cls)}"' if cls else ""
        self._body.append(
            f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{esc(anchor)}"{klass}>'
            f"{esc(content)}</text>"
        )

    # -- output -----------------------------------------------------------------------------
    def render(self, *, x_label: str = "step", legend: Sequence[tuple[str, str]] = ()) -> str:
        """The panel as one ``<svg>`` element."""
        w, h, left, top = self.width, self.height, self.left, self.top
        pw, ph = self.plot_width, self.plot_height
        out = [
            f'<svg class="{esc(self.css_class)}" xmlns="http://www.w3.org/2000/svg" '
            f'width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img">',
            f"<title>{esc(self.title)}</title>",
            f'<text class="title" x="{left}" y="16">{esc(self.title)}</text>',
            f'<rect class="frame" x="{left}" y="{top}" width="{pw:.1f}" height="{ph:.1f}" '
            'fill="#fff" stroke="#999"/>',
        ]
        out += self._axis_ticks()
        out += self._body
        out.append(
            f'<text class="axis-label" x="{left + pw:.1f}" y="{h - 4}" text-anchor="end">'
            f"{esc(x_label)}</text>"
        )
        lx = left + 8.0
        for color, name in legend:
            out.append(
                f'<rect class="legend" x="{lx:.1f}" y="{top + 6}" width="10" height="3" '
                f'fill="{esc(color)}"/>'
            )
            out.append(f'<text class="legend" x="{lx + 14:.1f}" y="{top + 11}">{esc(name)}</text>')
            lx += 22 + 7 * len(name)
        out.append("</svg>")
        return "\n".join(out)

    def _axis_ticks(self) -> list[str]:
        out = []
        left, top, pw, ph = self.left, self.top, self.plot_width, self.plot_height
        ticks = self.y_ticks
        if ticks is None:
            ticks = [(v, tick_text(v)) for v in self.y.ticks()]
        for v, label in ticks:
            py = self.py(v)
            if py is None:
                continue
            out.append(
                f'<line class="grid" x1="{left}" x2="{left + pw:.1f}" y1="{py:.1f}" '
                f'y2="{py:.1f}" stroke="#eee"/>'
            )
            out.append(
                f'<text class="tick" x="{left - 4}" y="{py + 3:.1f}" text-anchor="end">'
                f"{esc(label)}</text>"
            )
        if self.y2 is not None:
            for v in self.y2.ticks():
                py = self.py(v, 2)
                if py is None:
                    continue
                out.append(
                    f'<text class="tick" x="{left + pw + 4:.1f}" y="{py + 3:.1f}">'
                    f"{esc(tick_text(v))}</text>"
                )
        for v in self.x.ticks(8):
            px = self.px(v)
            if px is None:
                continue
            out.append(
                f'<text class="tick" x="{px:.1f}" y="{top + ph + 14:.1f}" text-anchor="middle">'
                f"{esc(tick_text(v))}</text>"
            )
        if self.y_label:
            out.append(
                f'<text class="axis-label" transform="translate({max(12, left - 48)},'
                f'{top + ph / 2:.1f}) rotate(-90)" text-anchor="middle">{esc(self.y_label)}</text>'
            )
        if self.y2 is not None and self.y2_label:
            out.append(
                f'<text class="axis-label" transform="translate({self.width - 8},'
                f'{top + ph / 2:.1f}) rotate(90)" text-anchor="middle">{esc(self.y2_label)}</text>'
            )
        return out
