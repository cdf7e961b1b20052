"""`automap report`: one static HTML page that pictures a plan before it costs cluster hours.

Every image is a PNG embedded as base64 and the styles are inline, so the page opens in
a browser with no network (no CDN, no web fonts). Panels: the mesh, which tensor dimension
is split on which axis, the pipeline schedule, memory per device against the limit, the
search's learning curve, and the predicted step time broken down, with provenance and the
collectives as tables. A plan without a prediction still renders; panels that need one
say so.

Plan fields read beyond the dataclass (all optional, in `plan.decisions`):
- "arg_roles": {arg index: role}, as `am.plan` writes it: which arguments are parameters.
- "stage_times": per pipeline stage, seconds per microbatch, either one number (forward +
  backward, split 1:2 since a backward pass costs about two forwards), a [forward,
  backward] pair, or [forward, B, W] where the schedule splits the backward (ZB-H1; its
  B and W are drawn in colours of their own, taken equal where only the backward is
  given). Without it every stage gets an equal share of `predicted.compute_s`.
- "stage_memory": per stage, a memory breakdown {"params": bytes, ...}: one bar each.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._axes import PIPE
from .._cluster import Cluster
from .._errors import AutomapError
from .._plan import Cost, Plan
from .._version import __version__
from . import _plots as plots
from ._data import (
    axis_links,
    breakdown,
    cluster_of,
    memory_bars,
    pipeline_ops,
    read_curve,
    sharding_rows,
    stage_rows,
    stage_times,
)
from ._format import human_bytes, human_time, spec_text

MAX_HEATMAP_ROWS = 80


# ---- entry points ------------------------------------------------------------------------


def render_report(
    plan: Plan | str | Path, *, cluster: Cluster | None = None, curve: str | Path | None = None
) -> str:
    """A complete HTML page for `plan` (a Plan, or the path of a plan file: then a learning
    curve saved next to it as `<stem>.curve.csv` is found by itself)."""
    plan, curve_path = _resolve(plan, curve)
    cluster = cluster or cluster_of(plan)
    sections = [
        (
            "mesh",
            "Device mesh",
            _img(_mesh_fig(plan, cluster), "device mesh"),
            _mesh_note(plan, cluster),
        ),
        ("sharding", "Which dimension is split on which axis", *_sharding_section(plan)),
        ("pipeline", "Pipeline schedule", *_schedule_section(plan)),
        ("memory", "Memory per device", *_memory_section(plan, cluster)),
        ("curve", "Search learning curve", *_curve_section(curve_path)),
        ("step-time", "Predicted step time", *_breakdown_section(plan)),
        ("collectives", "Collectives", "", _collectives_table(plan.predicted)),
    ]
    body = "".join(
        f'<section id="{sid}"><h2>{html.escape(title)}</h2>{image}{note}</section>'
        for sid, title, image, note in sections
    )
    title = f"Auto-MAP plan report — {plan.name or 'plan'}"
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{_header(plan, cluster)}{body}"
        f"<footer>automap {html.escape(__version__)}: every figure is a prediction of the "
        f"cost model, not a measurement.</footer></body></html>\n"
    )


def write_report(
    plan: Plan | str | Path,
    path: str | Path,
    *,
    cluster: Cluster | None = None,
    curve: str | Path | None = None,
    png: str | Path | None = None,
) -> Path:
    """Write the HTML report to `path`; with `png`, also one PNG of the main panels."""
    plan, curve_path = _resolve(plan, curve)
    cluster = cluster or cluster_of(plan)
    path = Path(path)
    path.write_text(render_report(plan, cluster=cluster, curve=curve_path), encoding="utf-8")
    if png is not None:
        Path(png).write_bytes(plots.png_bytes(_combined_fig(plan, cluster, curve_path)))
    return path


def _resolve(plan: Plan | str | Path, curve: str | Path | None) -> tuple[Plan, Path | None]:
    if curve is not None and not Path(curve).is_file():
        raise AutomapError(f"no learning-curve file at {curve}: check the path or leave it out.")
    if isinstance(plan, Plan):
        return plan, None if curve is None else Path(curve)
    source = Path(plan)
    beside = source.with_name(source.stem + ".curve.csv")
    found = Path(curve) if curve is not None else beside if beside.is_file() else None
    return Plan.load(source), found


# ---- header and tables -------------------------------------------------------------------


def _header(plan: Plan, cluster: Cluster | None) -> str:
    prov = plan.provenance
    what = prov.model or prov.fn or "a captured step"
    if prov.overrides:
        what += " (" + ", ".join(f"{k}={v}" for k, v in prov.overrides.items()) + ")"
    where = cluster.name if cluster else prov.cluster or "unknown"
    rows = [
        ("model / function", what),
        ("cluster", f"{where}, {prov.devices or plan.devices} devices"),
        ("mesh", " × ".join(f"{k}={v}" for k, v in plan.mesh.items()) or "one device"),
        (
            "pipeline",
            f"{max(1, len(plan.stages))} stage(s), {plan.microbatches} microbatch(es), {plan.schedule}",
        ),
        ("ZeRO stage / remat", f"{plan.zero_stage} / {plan.remat_label}"),
        ("searcher, seed", f"{prov.searcher or 'unknown'}, {prov.seed}"),
        ("search time", f"{prov.search_time_s:.1f} s"),
        ("made by automap", prov.version),
        ("program fingerprint", prov.fingerprint[:16] or "unknown"),
        *(("note", text) for text in prov.notes),
    ]
    cost = plan.predicted
    if cost is None:
        rows.append(("prediction", "no prediction in this plan"))
    else:
        verdict = "yes" if cost.feasible else f"no: {cost.reason}"
        rows += [
            ("predicted step time", human_time(cost.step_time_s)),
            ("peak memory per device", human_bytes(cost.memory_bytes)),
            ("MFU", f"{cost.mfu:.1%}"),
            ("fits in memory", verdict),
        ]
    return _table(("", ""), rows, cls="kv", show_head=False)


def _table(
    head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "", show_head: bool = True
) -> str:
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    thead = (
        "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" if show_head else ""
    )
    return f'<table class="{cls}">{thead}{cells}</table>'


def _collectives_table(cost: Cost | None) -> str:
    if cost is None:
        return _note("no prediction in this plan")
    if not cost.collectives:
        return _note("no collectives: every device works on its own (or there is one device).")
    total = sum(c.time_s for c in cost.collectives) or 1.0
    rows = [
        (
            c.kind,
            c.axis,
            c.count,
            human_bytes(c.bytes),
            human_time(c.time_s),
            f"{c.time_s / total:.0%}",
        )
        for c in sorted(cost.collectives, key=lambda c: -c.time_s)
    ]
    head = ("kind", "mesh axis", "times per step", "bytes per device", "time", "share")
    return _table(head, rows)


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _img(fig: Any, alt: str) -> str:
    data = base64.b64encode(plots.png_bytes(fig)).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


# ---- (1) mesh ----------------------------------------------------------------------------


def _mesh_fig(plan: Plan, cluster: Cluster | None, fig: Any = None) -> Any:
    pos = plots.mesh_layout(plan.mesh)[0]  # sized to the grid: a row of 4 or 8 rows of 8
    cols, rows = max(p[0] for p in pos) + 1, max(p[1] for p in pos) + 1
    fig = fig or plots.new_figure(min(12.0, 4.5 + 0.55 * cols), min(10.0, 1.6 + 0.55 * rows))
    per_node = cluster.devices_per_node if cluster and cluster.devices_per_node < 4096 else None
    # Interleaved: a device group is labelled by its first stage (chunk 0).
    stage_of = {d: i for i, st in reversed(list(enumerate(plan.stages))) for d in st.devices}
    plots.draw_mesh(fig, plan.mesh, per_node, axis_links(plan, cluster), stage_of)
    return fig


def _mesh_note(plan: Plan, cluster: Cluster | None) -> str:
    text = "Devices are numbered as jax.devices() orders them; the last mesh axis varies fastest."
    if plan.pipelined:
        text += (
            ' The "pipe" axis is the pipeline: each dashed box is one stage\'s sub-mesh, and '
            "sN under a device is the stage it runs. "
            + "; ".join(f"stage {r[0]}: devices {r[2]}" for r in stage_rows(plan))
            + "."
        )
    if cluster is None:
        text += " Cluster unknown: node boundaries not drawn (pass a cluster to see them)."
    return _note(text)


# ---- (2) sharding ------------------------------------------------------------------------


def _sharding_fig(plan: Plan, fig: Any = None) -> Any:
    rows = sharding_rows(plan)[:MAX_HEATMAP_ROWS]
    fig = fig or plots.new_figure(11.0, 1.2 + 0.26 * max(len(rows), 1))
    axes = [k for k in plan.mesh if k != PIPE]  # the pipe axis splits layers, not tensors
    plots.draw_sharding(fig, [r[0] for r in rows], [r[1] for r in rows], axes)
    return fig


def _sharding_section(plan: Plan) -> tuple[str, str]:
    rows = sharding_rows(plan)
    note = "Rows: parameters (numbers folded into *, ×n leaves) and batch inputs; columns: tensor dimensions; color: the mesh axis that splits it."
    if len(rows) > MAX_HEATMAP_ROWS:
        note += (
            f" The map shows the first {MAX_HEATMAP_ROWS} of {len(rows)} rows; the table lists all."
        )
    if plan.pipelined:
        stage_axes = " × ".join(k for k in plan.mesh if k != PIPE) or "one device"
        note += (
            f" A pipeline plan's specs are on the stage mesh ({stage_axes}): every stage "
            "splits the parameters it holds this way; the pipe axis splits no tensor, it "
            "gives each stage its own layers (see the stages table under the schedule)."
        )
    if plan.zero_stage:
        note += f" ZeRO stage {plan.zero_stage}: optimizer state (from stage 2 also gradients) is split on the data axis."
    table = _table(
        ("leaves", "sharding"),
        [(label, spec_text(tuple(c or None for c in cells))) for label, cells in rows],
    )
    return _img(_sharding_fig(plan), "sharding heat map"), _note(note) + table


# ---- (3) pipeline schedule ---------------------------------------------------------------


def _schedule_fig(plan: Plan, fig: Any = None) -> tuple[Any | None, str]:
    cost, n = plan.predicted, len(plan.stages)
    if n <= 1:
        if cost is None:
            return None, "no prediction in this plan (and no pipeline: one stage)."
        fig = fig or plots.new_figure(11.0, 2.2)
        parts = [("compute", cost.compute_s, "#4C72B0"), ("communication", cost.comm_s, "#DD8452")]
        plots.draw_single_stage(fig, parts, "no pipeline: the whole step on every device")
        return (
            fig,
            "No pipeline: one stage runs the whole step; communication is drawn after compute (the model's sum, before any overlap).",
        )
    times, unit = stage_times(plan)
    ops = pipeline_ops(n, plan.microbatches, plan.schedule.lower(), times, plan.virtual_stages)
    span = max(e for *_, e in ops)
    v = plan.virtual_stages  # a device group runs v of the n (virtual) stages drawn
    idle = 1 - sum(e - s for *_, s, e in ops) / (span * (n // v))
    fig = fig or plots.new_figure(11.0, 1.6 + 0.55 * n)
    chunks = f" ({v} per device group)" if v > 1 else ""
    title = (
        f"{plan.schedule.upper()}: {n} stages{chunks} × {plan.microbatches} microbatches, "
        f"{idle:.0%} idle"
    )
    plots.draw_schedule(fig, ops, n, title, unit)
    given = plan.decisions.get("stage_times")
    split = any(len(t) == 3 for t in times)  # the schedule splits the backward: B and W
    if given and len(given) == n:
        source = _times_source(given, split)
    elif unit == "ms":
        source = "equal shares of the predicted compute; backward drawn as twice the forward"
    else:
        source = "unit times (no prediction in this plan); backward twice the forward"
    if split and not (given and len(given) == n):
        source += ", split into equal B and W"
    note = f"{title} (simulated from the stage times: {source})."
    if cost is not None:
        # The drawing is the microbatch phase alone; the cost model's step also holds what
        # runs once per step (the update) and the point-to-point sends between stages.
        note += (
            f" Drawn span {human_time(span)}; the cost model's step {human_time(cost.step_time_s)} "
            f"adds the once-per-step work (the optimizer update) and the sends between "
            f"stages; its bubble (idle time of the busiest stage): {human_time(cost.bubble_s)}."
        )
    return fig, note


def _times_source(given: Sequence[Any], split: bool) -> str:
    """What the drawn stage times are: the cost model's, and how a backward given whole
    (or a stage given as one number) was shared out."""
    whole = (
        "forward, B (input gradients) and W (weight gradients)" if split else "forward and backward"
    )
    source = f"the cost model's {whole} of each stage per microbatch"
    source += " (plan.decisions['stage_times'])"
    if not all(isinstance(t, Sequence) for t in given):
        source += "; a single number is drawn as 1/3 forward, 2/3 backward"
    if split and not all(isinstance(t, Sequence) and len(t) == 3 for t in given):
        source += "; a backward given whole is drawn as equal B and W"
    return source


STAGE_HEAD = (
    "stage",
    "ops (forward cut)",
    "devices",
    "stage mesh",
    "forward / mb",
    "backward / mb",
    "memory / device",
)


def _schedule_section(plan: Plan) -> tuple[str, str]:
    fig, note = _schedule_fig(plan)
    text = _note(note)
    if plan.pipelined:
        text += _table(STAGE_HEAD, stage_rows(plan)) + _note(
            "Ops: each stage's range of the captured program's op indices; its forward ops "
            "are those in the range, its backward and update ops follow their inputs' stage. "
            "mb: one microbatch."
        )
    return ("" if fig is None else _img(fig, "pipeline schedule")), text


# ---- (4) memory, (5) curve, (6) step-time breakdown --------------------------------------


def _limit(plan: Plan, cluster: Cluster | None) -> float:
    limit = plan.predicted.memory_limit_bytes if plan.predicted else math.inf
    return cluster.memory_limit if not math.isfinite(limit) and cluster else limit


def _memory_fig(plan: Plan, cluster: Cluster | None, fig: Any = None) -> Any:
    bars = memory_bars(plan)
    fig = fig or plots.new_figure(11.0, 1.6 + 0.5 * len(bars))
    plots.draw_memory(fig, bars, _limit(plan, cluster))
    return fig


def _memory_section(plan: Plan, cluster: Cluster | None) -> tuple[str, str]:
    if plan.predicted is None:
        return "", _note("no prediction in this plan")
    limit = _limit(plan, cluster)
    bars = memory_bars(plan)
    parts = list(dict.fromkeys(k for _, d in bars for k in d))  # every part, first-seen order
    rows = [(k, *(human_bytes(d.get(k, 0.0)) for _, d in bars)) for k in parts]
    rows.append(("total", *(human_bytes(sum(d.values())) for _, d in bars)))
    shown = human_bytes(limit) if math.isfinite(limit) else "unknown"
    rows.append(("limit", *([shown] * len(bars))))
    head = ("part", *(f"{name}, bytes per device" for name, _ in bars))
    note = (
        _note(
            "One bar per pipeline stage (plan.decisions['stage_memory']): a stage's devices "
            "hold its own layers' parameters, gradients and optimizer state, and the "
            "activations of the microbatches in flight under the schedule."
        )
        if len(bars) > 1
        else ""
    )
    return _img(_memory_fig(plan, cluster), "memory per device"), _table(head, rows) + note


def _curve_fig(curve: Mapping[str, list[float]], fig: Any = None) -> Any:
    fig = fig or plots.new_figure(11.0, 5.0)
    plots.draw_curve(fig, curve)
    return fig


def _curve_section(path: Path | None) -> tuple[str, str]:
    if path is None:
        return "", _note(
            "no learning curve: pass one, or save it next to the plan as <plan>.curve.csv."
        )
    curve = read_curve(path)
    if not curve["episode"]:
        return "", _note(f"{path.name} has no rows.")
    best = [v for v in curve.get("best_time_s", []) if math.isfinite(v)]
    note = f"{len(curve['episode'])} episodes from {path.name}" + (
        f"; best {human_time(min(best))}." if best else "."
    )
    return _img(_curve_fig(curve), "learning curve"), _note(note)


def _breakdown_fig(cost: Cost, fig: Any = None) -> Any:
    fig = fig or plots.new_figure(11.0, 2.6)
    plots.draw_breakdown(fig, cost.step_time_s, *breakdown(cost))
    return fig


def _breakdown_section(plan: Plan) -> tuple[str, str]:
    cost = plan.predicted
    if cost is None:
        return "", _note("no prediction in this plan")
    rows = [(k, human_time(v)) for k, v in (("step", cost.step_time_s), *breakdown(cost)[0])]
    summed = sum(c.time_s for c in cost.collectives)
    text = f"Collectives sum to {human_time(summed)}; communication in the step: {human_time(cost.comm_s)}."
    return _img(_breakdown_fig(cost), "step time breakdown"), _table(
        ("part", "time"), rows
    ) + _note(text)


# ---- the combined PNG --------------------------------------------------------------------


def _combined_fig(plan: Plan, cluster: Cluster | None, curve: Path | None) -> Any:
    panels: list[tuple[float, Any]] = [(4.0, lambda f: _mesh_fig(plan, cluster, f))]
    panels.append(
        (
            1.6 + 0.26 * min(len(sharding_rows(plan)), MAX_HEATMAP_ROWS),
            lambda f: _sharding_fig(plan, f),
        )
    )
    if plan.predicted is not None or plan.pipelined:
        panels.append(
            (
                2.2 if not plan.pipelined else 1.6 + 0.55 * len(plan.stages),
                lambda f: _schedule_fig(plan, f),
            )
        )
    if plan.predicted is not None:
        panels.append((2.0 + 0.4 * len(memory_bars(plan)), lambda f: _memory_fig(plan, cluster, f)))
        panels.append((2.6, lambda f: _breakdown_fig(plan.predicted, f)))
    if curve is not None and read_curve(curve)["episode"]:
        panels.append((4.5, lambda f: _curve_fig(read_curve(curve), f)))
    heights = [h for h, _ in panels]
    fig = plots.new_figure(12.0, sum(heights))
    fig.suptitle(f"Auto-MAP plan — {plan.name or 'plan'}", fontsize=14)
    for sub, (_, draw) in zip(
        fig.subfigures(len(panels), 1, height_ratios=heights), panels, strict=True
    ):
        draw(sub)
    return fig


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;max-width:1200px;
margin:24px auto;padding:0 16px;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.3em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:1.8em}
img{max-width:100%;height:auto;display:block;margin:8px 0}
table{border-collapse:collapse;margin:8px 0;font-size:.92em}
td,th{border:1px solid #ddd;padding:3px 10px;text-align:left;vertical-align:top}
th{background:#f3f3f3}table.kv td:first-child{font-weight:600;background:#fafafa}
.note{color:#555;font-size:.92em}footer{margin-top:2em;color:#777;font-size:.85em}
"""
