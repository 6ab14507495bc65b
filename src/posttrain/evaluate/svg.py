"""Small inline-SVG charts for the report: lines (training curves), grouped bars, stacked bars, labelled points,
heat maps.

Hand-written rather than matplotlib so the report stays a few hundred kilobytes of crisp, scalable, hoverable
markup (every point and bar has a ``<title>`` tooltip) that needs nothing but a browser. Every string that
reaches the markup goes through `html.escape`.
"""

from __future__ import annotations

import html
import math
from typing import Sequence

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D", "#FF9DA6",
           "#79706E"]
FONT = "font-family=\"inherit\" font-size=\"11\" fill=\"#5b6270\""


def color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [low, high] (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    start = math.floor(low / step) * step
    ticks, value = [], start
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    return ticks


def fmt(value: float, fraction: bool = False) -> str:
    if fraction:
        return f"{value * 100:.0f}%"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 10_000:
        return f"{value / 1000:.0f}k"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.2g}" if magnitude < 10 else f"{value:.0f}"
    return f"{value:.2g}"


def _escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def _frame(width: int, height: int, label: str, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{_escape(label)}">' + "".join(body) + "</svg>")


def line_chart(series: dict[str, list[Sequence[float]]], *, label: str, fraction: bool = False,
               width: int = 520, height: int = 230, colors: dict[str, str] | None = None) -> str:
    """Lines of (x, y) points, one per series name (colours by order, or `colors`); y in [0, 1] when `fraction`."""
    points = [p for values in series.values() for p in values]
    if not points:
        return _frame(width, 40, label, [f'<text x="8" y="24" {FONT}>no data</text>'])
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_low, x_high = min(xs), max(xs)
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    if fraction:
        y_low, y_high = 0.0, 1.0
    else:
        y_low, y_high = min(ys), max(ys)
        pad = (y_high - y_low) * 0.08 or abs(y_high) * 0.1 or 1.0
        # A loss or a KL is never negative: an axis dipping below zero would only suggest it can be.
        y_low, y_high = (max(0.0, y_low - pad) if y_low >= 0 else y_low - pad), y_high + pad
    ticks = [t for t in nice_ticks(y_low, y_high) if t >= 0 or y_low < 0]
    y_low, y_high = min(y_low, ticks[0]), max(y_high, ticks[-1])
    left, right, top, bottom = 46, 12, 10, 26
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x_low) / (x_high - x_low) * plot_w

    def sy(y: float) -> float:
        return top + (1 - (y - y_low) / (y_high - y_low)) * plot_h

    body = []
    for tick in ticks:
        y = sy(tick)
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e6e8ee"/>')
        body.append(f'<text x="{left - 6}" y="{y + 3.5:.1f}" text-anchor="end" {FONT}>{fmt(tick, fraction)}</text>')
    for tick in nice_ticks(x_low, x_high, 6):
        if x_low <= tick <= x_high:
            x = sx(tick)
            body.append(f'<text x="{x:.1f}" y="{height - 8}" text-anchor="middle" {FONT}>{fmt(tick)}</text>')
    body.append(f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="#9aa1ad"/>')
    for index, (name, values) in enumerate(series.items()):
        stroke = (colors or {}).get(name, color(index))
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        body.append(f'<polyline fill="none" stroke="{stroke}" stroke-width="2" stroke-linejoin="round" '
                    f'points="{path}"><title>{_escape(name)}</title></polyline>')
        marks = values if len(values) <= 40 else values[-1:]
        for x, y in marks:
            body.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{stroke}"><title>'
                        f'{_escape(name)} at step {fmt(x)}: {_escape(_value(y, fraction))}</title></circle>')
    return _frame(width, height, label, body)


def bar_chart(categories: Sequence[str], series: Sequence[tuple[str, Sequence[float | None]]], *, label: str,
              fraction: bool = True, width: int | None = None, height: int = 220,
              colors: Sequence[str] | None = None) -> str:
    """Grouped vertical bars: for each category one bar per series (a missing value leaves a gap)."""
    values = [v for _, vs in series for v in vs if v is not None]
    groups, per_group = max(1, len(categories)), max(1, len(series))
    bar_w = 18 if per_group > 2 else 24
    longest = max([min(18, len(c)) for c in categories] + [1])
    group_w = max(per_group * bar_w + 18, longest * 6.5 + 14)  # room for the category's label
    left, right, top, bottom = 44, 10, 16, 40
    width = width or int(max(260, left + right + groups * group_w))
    plot_h = height - top - bottom
    high = 1.0 if fraction else max(values or [1.0]) * 1.1 or 1.0
    ticks = nice_ticks(0.0, high, 5)
    high = max(high, ticks[-1])

    def sy(v: float) -> float:
        return top + (1 - v / high) * plot_h

    body = _y_grid(ticks, sy, left, width - right, fraction)
    step = (width - left - right) / groups
    for g, category in enumerate(categories):
        x0 = left + g * step + (step - per_group * bar_w) / 2
        for s, (name, vs) in enumerate(series):
            value = vs[g] if g < len(vs) else None
            if value is None:
                continue
            fill = colors[s] if colors else color(s)
            y = sy(max(0.0, value))
            body.append(f'<rect x="{x0 + s * bar_w:.1f}" y="{y:.1f}" width="{bar_w - 3}" '
                        f'height="{max(0.5, top + plot_h - y):.1f}" rx="2" fill="{fill}"><title>{_escape(name)} · '
                        f'{_escape(category)}: {_escape(_value(value, fraction))}</title></rect>')
        text = category if len(category) <= 18 else category[:17] + "…"
        body.append(f'<text x="{left + g * step + step / 2:.1f}" y="{height - bottom + 16}" text-anchor="middle" '
                    f'{FONT}>{_escape(text)}</text>')
    body.append(f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="#9aa1ad"/>')
    return _frame(width, height, label, body)


def stacked_bars(rows: Sequence[tuple[str, dict[str, int]]], classes: Sequence[str], class_colors: dict[str, str],
                 *, label: str, width: int = 560, class_labels: dict[str, str] | None = None) -> str:
    """One horizontal bar per row, split into `classes` by count; the total at the end."""
    bar_h, gap, left, right = 18, 10, 110, 48
    height = max(1, len(rows)) * (bar_h + gap) + gap
    largest = max([sum(counts.values()) for _, counts in rows] + [1])
    scale = (width - left - right) / largest
    body = []
    for r, (name, counts) in enumerate(rows):
        y = gap + r * (bar_h + gap)
        text = name if len(name) <= 16 else name[:15] + "…"
        body.append(f'<text x="{left - 8}" y="{y + 13}" text-anchor="end" {FONT}>{_escape(text)}</text>')
        x = float(left)
        for cls in classes:
            count = counts.get(cls, 0)
            if not count:
                continue
            shown = (class_labels or {}).get(cls, cls)
            body.append(f'<rect x="{x:.1f}" y="{y}" width="{count * scale:.1f}" height="{bar_h}" '
                        f'fill="{class_colors.get(cls, "#999")}"><title>{_escape(name)} · {_escape(shown)}: '
                        f'{count}</title></rect>')
            x += count * scale
        body.append(f'<text x="{x + 6:.1f}" y="{y + 13}" {FONT}>{sum(counts.values())}</text>')
    return _frame(width, height, label, body)


def scatter_chart(points: Sequence[tuple[str, float, float]], *, label: str, x_label: str, y_label: str,
                  fraction: bool = True, width: int = 540, height: int = 250,
                  colors: dict[str, str] | None = None) -> str:
    """Named (x, y) points, each a dot with its name beside it; y a fraction when `fraction` (the axis from a
    little below the lowest point to 100%). The x axis starts at 0, so distances along it compare as ratios (a
    tier twice as fast sits twice as far out)."""
    if not points:
        return _frame(width, 40, label, [f'<text x="8" y="24" {FONT}>no data</text>'])
    x_high = max(p[1] for p in points) * 1.15 or 1.0
    ys = [p[2] for p in points]
    if fraction:  # tiers differ by points of accuracy: the axis spans what is there (and up to 100%)
        y_low, y_high = max(0.0, min(ys) - max(0.1, (max(ys) - min(ys)) * 0.5)), 1.0
    else:
        y_low, y_high = 0.0, max(ys) * 1.1 or 1.0
    x_ticks, y_ticks = nice_ticks(0.0, x_high, 5), nice_ticks(y_low, y_high, 5)
    y_low = min(y_low, y_ticks[0])
    x_high, y_high = max(x_high, x_ticks[-1]), max(y_high, y_ticks[-1])
    left, right, top, bottom = 46, 14, 12, 40
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + x / x_high * plot_w

    def sy(y: float) -> float:
        return top + (1 - (y - y_low) / (y_high - y_low)) * plot_h

    body = _y_grid(y_ticks, sy, left, width - right, fraction)
    for tick in x_ticks:
        body.append(f'<text x="{sx(tick):.1f}" y="{top + plot_h + 14}" text-anchor="middle" {FONT}>{fmt(tick)}</text>')
    body.append(f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="#9aa1ad"/>')
    body.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle" {FONT}>'
                f'{_escape(x_label)}</text>')
    body.append(f'<text x="12" y="{top + plot_h / 2:.1f}" text-anchor="middle" transform="rotate(-90 12 '
                f'{top + plot_h / 2:.1f})" {FONT}>{_escape(y_label)}</text>')
    for index, (name, x, y) in enumerate(points):
        fill = (colors or {}).get(name, color(index))
        anchor, dx = ("end", -7) if sx(x) > left + plot_w * 0.7 else ("start", 7)
        body.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{fill}"><title>{_escape(name)}: '
                    f'{_escape(x_label)} {x:.4g}, {_escape(y_label)} {_escape(_value(y, fraction))}</title></circle>')
        body.append(f'<text x="{sx(x) + dx:.1f}" y="{sy(y) - 7:.1f}" text-anchor="{anchor}" {FONT}>'
                    f'{_escape(name)}</text>')
    return _frame(width, height, label, body)


def _y_grid(ticks: Sequence[float], sy, left: float, right_x: float, fraction: bool) -> list[str]:
    """A horizontal grid line and a label at the left for each y tick."""
    body = []
    for tick in ticks:
        body.append(f'<line x1="{left}" x2="{right_x}" y1="{sy(tick):.1f}" y2="{sy(tick):.1f}" stroke="#e6e8ee"/>')
        body.append(f'<text x="{left - 6}" y="{sy(tick) + 3.5:.1f}" text-anchor="end" {FONT}>'
                    f'{fmt(tick, fraction)}</text>')
    return body


def heat_color(value: float) -> str:
    """A fraction in [0, 1] as a colour from red (0) through amber to green (1)."""
    stops = [(0.0, (228, 87, 86)), (0.5, (238, 202, 59)), (1.0, (84, 162, 75))]
    value = min(1.0, max(0.0, value))
    for (x0, c0), (x1, c1) in zip(stops, stops[1:]):
        if value <= x1:
            t = (value - x0) / (x1 - x0)
            return "#" + "".join(f"{round(a + (b - a) * t):02X}" for a, b in zip(c0, c1))
    return "#54A24B"


def heat_map(rows: Sequence[str], columns: Sequence[str], values: Sequence[Sequence[float | None]], *, label: str,
             counts: Sequence[Sequence[int | None]] | None = None, row_title: str = "", column_title: str = "",
             cell_w: int = 64, cell_h: int = 26) -> str:
    """A grid of fractions (one row per `rows`, one column per `columns`): each cell coloured red to green and
    labelled with its percentage; an empty cell (None) is grey. Tooltips give the counts when `counts` has them."""
    left, top, bottom = 86, 22, 30
    width, height = left + cell_w * len(columns) + 10, top + cell_h * len(rows) + bottom
    body = [f'<text x="{left + cell_w * len(columns) / 2:.0f}" y="13" text-anchor="middle" {FONT}>'
            f'{_escape(column_title)}</text>']
    for c, name in enumerate(columns):
        body.append(f'<text x="{left + c * cell_w + cell_w / 2:.0f}" y="{top + cell_h * len(rows) + 16}" '
                    f'text-anchor="middle" {FONT}>{_escape(name)}</text>')
    for r, name in enumerate(rows):
        y = top + r * cell_h
        body.append(f'<text x="{left - 8}" y="{y + cell_h / 2 + 4:.0f}" text-anchor="end" {FONT}>'
                    f'{_escape(name)}</text>')
        for c, value in enumerate(values[r]):
            x = left + c * cell_w
            count = counts[r][c] if counts is not None else None
            if value is None:
                body.append(f'<rect x="{x}" y="{y}" width="{cell_w - 2}" height="{cell_h - 2}" fill="#eef0f4">'
                            f'<title>{_escape(name)} · {_escape(columns[c])}: no items</title></rect>')
                continue
            tip = f"{_escape(name)} · {_escape(columns[c])}: {value * 100:.1f}%" + (
                f" of {count} item(s)" if count is not None else "")
            body.append(f'<rect x="{x}" y="{y}" width="{cell_w - 2}" height="{cell_h - 2}" rx="2" '
                        f'fill="{heat_color(value)}"><title>{tip}</title></rect>')
            body.append(f'<text x="{x + cell_w / 2 - 1:.0f}" y="{y + cell_h / 2 + 3:.0f}" text-anchor="middle" '
                        f'font-family="inherit" font-size="11" fill="#1d2330">{value * 100:.0f}%</text>')
    if row_title:
        body.append(f'<text x="8" y="{top - 8}" {FONT}>{_escape(row_title)}</text>')
    return _frame(width, height, label, body)


def _value(value: float, fraction: bool) -> str:
    return f"{value * 100:.1f}%" if fraction else f"{value:.4g}"
