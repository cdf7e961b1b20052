"""Matplotlib panels of the plan report, each drawn into a figure (or subfigure) it is given.

Panels draw on `matplotlib.figure.Figure` objects, never through pyplot: a Figure renders
with the Agg canvas by itself, so a report made inside a notebook or a GUI program leaves
the user's backend and open figures untouched. Each panel takes a figure rather than
making one so the same code draws the HTML's images and the combined `--png` figure.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._pipeline import Phase, Timed

AXIS_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3")
NONE_COLOR = "#E8E8E8"
NODE_COLORS = (  # pastel, so the device numbers stay readable; 8 before they repeat
    "#DCE9F5",
    "#FBE3D0",
    "#DDEFD9",
    "#F3D9DA",
    "#E6E0F0",
    "#EDE3DA",
    "#F9E6F2",
    "#FFF6CC",
)
MEMORY_COLORS = {
    "params": "#4C72B0",
    "grads": "#55A868",
    "opt_state": "#8172B3",
    "activations": "#DD8452",
    "other": "#A0A0A0",
    "outputs": "#C44E52",  # the new state a step that donates nothing holds apart
}
#: A pipeline unit's colour by phase: the weight gradients (W) of a schedule that splits
#: the backward (ZB-H1) apart from the rest of it (B), so the bubble they fill shows.
PHASE_COLORS = {Phase.FWD: "#4C72B0", Phase.BWD: "#DD8452", Phase.WGT: "#55A868"}
COMM_COLORS = ("#55A868", "#8172B3", "#C44E52", "#937860", "#DA8BC3", "#8C8C8C")
MS = 1e3


def new_figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def png_bytes(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _say(fig: Any, text: str) -> None:
    """A panel with nothing to draw says why, in the place the picture would be."""
    ax = fig.add_subplot()
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=12, color="#555555")


# ---- (1) the mesh ------------------------------------------------------------------------


def mesh_layout(
    mesh: Mapping[str, int], wrap: int = 8
) -> tuple[list[tuple[float, float]], str, str]:
    """Grid position of each device (row-major mesh order, last axis fastest, as
    `jax.make_mesh` lays them out), and the labels of the two directions.

    The last axis runs along columns, the one before along rows; further axes alternate and
    tile blocks with a gap, so every axis stays visible as a direction in the picture.
    """
    axes = [(k, v) for k, v in mesh.items()]
    n = math.prod(v for _, v in axes) if axes else 1
    if len(axes) <= 1:
        name, size = axes[0] if axes else ("devices", 1)
        width = size if size <= 16 else wrap
        pos = [(float(d % width), float(d // width)) for d in range(n)]
        extra = f", {width} per row" if width < size else ""
        return pos, f"{name} = {size}{extra} →", ""
    col_axes, row_axes = axes[::-1][0::2], axes[::-1][1::2]  # innermost first
    pos = []
    for d in range(n):
        coords, rest = {}, d
        for name, size in reversed(axes):
            coords[name], rest = rest % size, rest // size
        pos.append((_place(coords, col_axes), _place(coords, row_axes)))

    def label(group: list[tuple[str, int]], arrow: str) -> str:
        return " within ".join(f"{k} = {v}" for k, v in group) + f" {arrow}"

    return pos, label(col_axes, "→"), label(row_axes, "↓")


def _place(coords: Mapping[str, int], group: Sequence[tuple[str, int]]) -> float:
    x, stride, gap = 0.0, 1, 0.0
    for i, (name, size) in enumerate(group):
        x += coords[name] * stride
        if i:  # outer axes open a gap between blocks so their boundaries show
            gap += coords[name] * 0.4 * i
        stride *= size
    return x + gap


def draw_mesh(
    fig: Any,
    mesh: Mapping[str, int],
    per_node: int | None,
    links: Mapping[str, str],
    stage_of: Mapping[int, int] | None = None,
) -> None:
    from matplotlib.patches import Patch, Rectangle

    pos, xlabel, ylabel = mesh_layout(mesh, wrap=per_node if per_node and per_node <= 16 else 8)
    n = len(pos)
    ax = fig.add_subplot()
    ax.set_aspect("equal")
    text_size = 9 if n <= 64 else 6 if n <= 256 else 0
    for d, (x, y) in enumerate(pos):
        node = d // per_node if per_node else 0
        color = NODE_COLORS[node % len(NODE_COLORS)] if per_node else NODE_COLORS[0]
        ax.add_patch(Rectangle((x, -y), 0.9, -0.9, facecolor=color, edgecolor="#333333", lw=0.8))
        if text_size:
            label = str(d) if not stage_of or d not in stage_of else f"{d}\ns{stage_of[d]}"
            ax.text(x + 0.45, -y - 0.45, label, ha="center", va="center", fontsize=text_size)
    if stage_of:
        _outline_stages(ax, pos, stage_of)
    xs, ys = [p[0] for p in pos], [p[1] for p in pos]
    top = 0.5 if stage_of else 0.2  # room for the stage labels above the first row
    ax.set_xlim(min(xs) - 0.2, max(xs) + 1.1)
    ax.set_ylim(-max(ys) - 1.1, top)
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel(xlabel, fontsize=10)
    ax.xaxis.set_label_position("top")
    ax.set_ylabel(ylabel, fontsize=10)
    shape = " × ".join(f"{k}={v}" for k, v in mesh.items()) or "one device"
    kinds = ", ".join(f"{k}: {v}" for k, v in links.items())
    ax.set_title(
        f"mesh {shape} ({n} devices)" + (f"\nlinks — {kinds}" if kinds else ""), fontsize=11
    )
    if per_node and n > per_node:
        nodes = math.ceil(n / per_node)
        shown = min(nodes, len(NODE_COLORS))
        handles = [
            Patch(facecolor=NODE_COLORS[i], edgecolor="#333333", label=f"node {i}")
            for i in range(shown)
        ]
        title = f"{nodes} nodes × {per_node} devices" + (
            " (colors repeat)" if nodes > shown else ""
        )
        ax.legend(
            handles=handles, title=title, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8
        )


def _outline_stages(
    ax: Any, pos: Sequence[tuple[float, float]], stage_of: Mapping[int, int]
) -> None:
    """A dashed box around each pipeline stage's devices, labelled above: the stages are
    blocks of the "pipe" axis, so each box holds one sub-mesh and no other stage's device."""
    from matplotlib.patches import Rectangle

    for stage in sorted(set(stage_of.values())):
        mine = [pos[d] for d, s in stage_of.items() if s == stage and d < len(pos)]
        if not mine:
            continue
        x0, x1 = min(p[0] for p in mine), max(p[0] for p in mine) + 0.9
        y0, y1 = min(p[1] for p in mine), max(p[1] for p in mine) + 0.9
        color = AXIS_COLORS[stage % len(AXIS_COLORS)]
        ax.add_patch(
            Rectangle(
                (x0 - 0.08, -y0 + 0.08), x1 - x0 + 0.16, -(y1 - y0 + 0.16),
                fill=False, edgecolor=color, ls="--", lw=1.6,
            )
        )  # fmt: skip
        ax.text(x0, -y0 + 0.14, f"stage {stage}", color=color, fontsize=8, va="bottom")


# ---- (2) which tensor dimension is split on which axis -----------------------------------


def draw_sharding(
    fig: Any,
    labels: Sequence[str],
    cells: Sequence[Sequence[str | None]],
    axis_order: Sequence[str],
) -> None:
    """Heat map: rows = parameter patterns, columns = dimensions, color = mesh axis.

    A cell is the axis name, "" for a dimension left whole, None past the tensor's rank.
    """
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    if not labels:
        _say(fig, "no parameter specs in this plan")
        return
    colors = {a: AXIS_COLORS[i % len(AXIS_COLORS)] for i, a in enumerate(axis_order)}
    for row in cells:  # several axes on one dimension get a color of their own
        for c in row:
            if c and c not in colors:
                colors[c] = AXIS_COLORS[len(colors) % len(AXIS_COLORS)]
    ncols = max((len(r) for r in cells), default=0) or 1
    image = [[to_rgb("#FFFFFF")] * ncols for _ in cells]
    ax = fig.add_subplot()
    for i, row in enumerate(cells):
        if not row:
            ax.text(0, i, "scalar", ha="center", va="center", fontsize=8, color="#777777")
        for j in range(ncols):
            c = row[j] if j < len(row) else None
            if c is None:
                continue
            image[i][j] = to_rgb(colors[c] if c else NONE_COLOR)
            ax.text(
                j,
                i,
                c or "·",
                ha="center",
                va="center",
                fontsize=8,
                color="white" if c else "#777777",
            )
    ax.imshow(image, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(ncols), [f"dim {j}" for j in range(ncols)], fontsize=9)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(labels)), labels, fontsize=8 if len(labels) < 40 else 6)
    ax.set_xticks([j - 0.5 for j in range(1, ncols)], minor=True)
    ax.set_yticks([i - 0.5 for i in range(1, len(labels))], minor=True)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.tick_params(which="minor", length=0)
    handles = [Patch(facecolor=v, label=k) for k, v in colors.items()]
    handles.append(Patch(facecolor=NONE_COLOR, label="not split"))
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="mesh axis"
    )


# ---- (3) the pipeline schedule -----------------------------------------------------------


def draw_schedule(
    fig: Any,
    ops: Sequence[Timed],
    n_stages: int,
    title: str,
    unit: str,
) -> None:
    """Stages × time: forward and backward of each microbatch (B and W in colours of their
    own where the schedule splits the backward), idle time hatched as bubble."""
    from matplotlib.patches import Patch

    ax = fig.add_subplot()
    scale = MS if unit == "ms" else 1.0
    end = max((e for *_, e in ops), default=1.0) * scale
    for s in range(n_stages):
        ax.broken_barh(
            [(0, end)], (s - 0.4, 0.8), facecolor="#F4F4F4", edgecolor="#BBBBBB", hatch="//", lw=0
        )
    for stage, kind, mb, start, stop in ops:
        width = (stop - start) * scale
        color = PHASE_COLORS[kind]
        ax.broken_barh(
            [(start * scale, width)], (stage - 0.4, 0.8), facecolor=color, edgecolor="white", lw=0.6
        )
        if width > end / 60 and len(ops) <= 400:
            ax.text(
                start * scale + width / 2,
                stage,
                str(mb),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_ylim(n_stages - 0.5, -0.5)
    ax.set_yticks(range(n_stages), [f"stage {s}" for s in range(n_stages)])
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=11)
    handles = [
        Patch(facecolor=PHASE_COLORS[phase], label=label)
        for phase, label in phase_labels(kind for _, kind, *_ in ops)
    ]
    handles.append(
        Patch(facecolor="#F4F4F4", edgecolor="#BBBBBB", hatch="//", label="bubble (idle)")
    )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)


def phase_labels(kinds: Any) -> list[tuple[Phase, str]]:
    """The legend of the drawn phases: forward and backward, or forward, B and W where
    some unit is a weight-gradient one (the backward is split)."""
    if Phase.WGT in set(kinds):
        return [
            (Phase.FWD, "forward"),
            (Phase.BWD, "backward B (input gradients)"),
            (Phase.WGT, "backward W (weight gradients)"),
        ]
    return [(Phase.FWD, "forward"), (Phase.BWD, "backward")]


def draw_single_stage(fig: Any, parts: Sequence[tuple[str, float, str]], title: str) -> None:
    """No pipeline: one bar of compute then communication for the whole step."""
    ax = fig.add_subplot()
    left = 0.0
    for label, seconds, color in parts:
        ax.barh(
            [0],
            [seconds * MS],
            left=left,
            color=color,
            label=f"{label} {seconds * MS:.2f} ms",
            height=0.6,
        )
        left += seconds * MS
    ax.set_yticks([0], ["one stage"])
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=11)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)


# ---- (4) memory per device ---------------------------------------------------------------


def draw_memory(fig: Any, bars: Sequence[tuple[str, Mapping[str, float]]], limit: float) -> None:
    """Stacked horizontal bars (GB), one per device kind or stage, against the limit."""
    ax = fig.add_subplot()
    seen: set[str] = set()
    for i, (_, parts) in enumerate(bars):
        left = 0.0
        for key, value in parts.items():
            color = MEMORY_COLORS.get(key, "#CCB974")
            label = None if key in seen else key
            seen.add(key)
            ax.barh([i], [value / 1e9], left=left, color=color, label=label, height=0.6)
            left += value / 1e9
    peak = max((sum(p.values()) for _, p in bars), default=0.0) / 1e9
    for i, (_, parts) in enumerate(bars):  # the total in words: a thin bar is still read
        total = sum(parts.values())
        share = f" ({total / limit:.0%} of limit)" if math.isfinite(limit) and limit > 0 else ""
        ax.text(total / 1e9, i, f"  {total / 1e9:.2f} GB{share}", va="center", fontsize=8)
    if math.isfinite(limit):
        ax.axvline(
            limit / 1e9, color="#C44E52", ls="--", lw=1.5, label=f"limit {limit / 1e9:.1f} GB"
        )
        ax.set_xlim(0, max(limit / 1e9, peak) * 1.05)
    else:  # room on the right for the total's label
        ax.set_xlim(0, peak * 1.25 or 1.0)
    ax.set_yticks(range(len(bars)), [name for name, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel("GB per device")
    ax.set_title(
        "memory per device" + ("" if math.isfinite(limit) else " (no limit known)"), fontsize=11
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)


# ---- (5) the search's learning curve -----------------------------------------------------


def draw_curve(fig: Any, curve: Mapping[str, Sequence[float]]) -> None:
    """Top: best and current predicted step time per episode; bottom: epsilon and loss."""
    x = curve["episode"]
    lower = [k for k in ("epsilon", "loss") if k in curve]
    top, *rest = fig.subplots(2 if lower else 1, 1, sharex=True, squeeze=False)[:, 0]
    if "current_time_s" in curve:
        top.plot(
            x,
            [v * MS for v in curve["current_time_s"]],
            ".",
            ms=3,
            color="#999999",
            label="episode's plan",
        )
    if "best_time_s" in curve:
        top.plot(
            x,
            [v * MS for v in curve["best_time_s"]],
            "-",
            lw=2,
            color="#4C72B0",
            label="best so far",
        )
    top.set_ylabel("step time (ms)")
    top.set_title("search learning curve", fontsize=11)
    top.legend(loc="upper right", fontsize=8)
    if lower:
        ax = rest[0]
        if "epsilon" in curve:
            ax.plot(x, curve["epsilon"], color="#55A868", label="epsilon")
            ax.set_ylabel("epsilon", color="#55A868")
        if "loss" in curve:
            other = ax.twinx() if "epsilon" in curve else ax
            other.plot(x, curve["loss"], color="#C44E52", lw=1, label="loss")
            other.set_ylabel("TD loss", color="#C44E52")
        ax.set_xlabel("episode")
    else:
        top.set_xlabel("episode")


# ---- (6) predicted step time broken down -------------------------------------------------


def draw_breakdown(
    fig: Any, step: float, parts: Sequence[tuple[str, float]], comm: Sequence[tuple[str, float]]
) -> None:
    """Two stacked bars: the step (compute, communication, bubble) and communication split
    by collective kind and axis, with the predicted step time marked."""
    ax = fig.add_subplot()
    palette = {"compute": "#4C72B0", "communication": "#DD8452", "bubble": "#BBBBBB"}
    left = 0.0
    for label, seconds in parts:
        ax.barh(
            [0],
            [seconds * MS],
            left=left,
            color=palette.get(label, "#999999"),
            height=0.6,
            label=label,
        )
        left += seconds * MS
    left = 0.0
    for i, (label, seconds) in enumerate(comm):
        color = COMM_COLORS[i % len(COMM_COLORS)]  # apart from the step's own colors
        ax.barh([1], [seconds * MS], left=left, color=color, height=0.6, label=label, alpha=0.85)
        left += seconds * MS
    ax.axvline(step * MS, color="#333333", ls=":", lw=1.2, label=f"step {step * MS:.2f} ms")
    rows = ["step", "collectives"] if comm else ["step"]  # no empty row when nothing is sent
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title("predicted step time", fontsize=11)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
