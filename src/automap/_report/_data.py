"""The numbers behind the plan report's panels, apart from any drawing.

Kept free of matplotlib so that the folding of specs into rows, the simulated pipeline
schedule and the curve reader can be tested and reused (by `automap bench`, say) alone.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Sequence
from pathlib import Path

from .._cluster import Cluster
from .._errors import ClusterError, PlanError
from .._pipeline import Timed, pipeline_schedule
from .._plan import Cost, Plan, Spec
from ._format import human_bytes, human_time

LINK_WORDS = {"intra": "in node", "inter": "across nodes", "mixed": "spans nodes"}
CURVE_ALIASES = {  # the DQN searcher's own row names, read as the documented columns
    "best_time": "best_time_s",
    "current_time": "current_time_s",
    "exploration": "epsilon",
}


def sharding_rows(plan: Plan) -> list[tuple[str, list[str]]]:
    """(label, axis per dimension) per parameter or batch leaf pattern, layers folded.

    Optimizer state mirrors the parameters and is left out to keep the map readable.
    """
    roles = dict(plan.decisions.get("arg_roles") or {})
    if not roles:  # an older plan: the first argument is the parameters by convention
        roles = {"0": "param"}
    grouped: dict[tuple[str, str, Spec], list[int]] = {}
    for path, spec in plan.specs.items():
        m = re.match(r"\[(\d+)\](.*)", path)
        arg, rest = (m.group(1), m.group(2)) if m else ("", path)
        role = roles.get(arg, "input")
        if role == "opt_state":
            continue
        keys = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", rest)
        name = "/".join(a or b or c for a, b, c in keys) or f"arg {arg}"
        numbers = re.findall(r"\d+", name)
        grouped.setdefault((role, re.sub(r"\d+", "*", name), spec), []).append(
            int(numbers[0]) if numbers else -1
        )
    order = {"param": 0, "batch": 1}
    split = [(r, p) for r, p, _ in grouped]  # a pattern on several rows: layers differ
    rows = []
    for (role, pattern, spec), layers in sorted(
        grouped.items(), key=lambda kv: (order.get(kv[0][0], 2), kv[0][1], str(kv[0][2]))
    ):
        label = pattern if role == "param" else f"{role}: {pattern}"
        if len(layers) > 1:
            label += f"  ×{len(layers)}"
        if split.count((role, pattern)) > 1 and min(layers) >= 0:
            label += f"  (at {_ranges(sorted(set(layers)))})"
        rows.append((label, ["+".join(e) if isinstance(e, tuple) else (e or "") for e in spec]))
    return rows


def _ranges(xs: list[int]) -> str:
    out, start = [], xs[0]
    for a, b in zip(xs, [*xs[1:], None], strict=True):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}–{a}")
            start = b
    if len(out) > 4:  # an alternating pattern would make a label longer than the map
        return ", ".join(out[:3]) + f", … ({len(xs)} in all)"
    return ", ".join(out)


def pipeline_ops(
    stages: int,
    microbatches: int,
    schedule: str,
    times: Sequence[tuple[float, ...]],
    chunks: int = 1,
) -> list[Timed]:
    """The schedule named `schedule` simulated in time, (stage, phase, microbatch, start,
    end) per unit: the same simulation the cost model and the runtime use (point-to-point
    not drawn). `stages` counts the plan's stages, `chunks` of them per device group
    (`Plan.virtual_stages`)."""
    run = pipeline_schedule(schedule, chunks)
    return run.simulate(stages // chunks, microbatches, times)


def stage_times(plan: Plan) -> tuple[list[tuple[float, ...]], str]:
    """Per stage, seconds per microbatch of (forward, backward), or of (forward, B, W) where
    the plan's schedule splits the backward (ZB-H1), and the unit: the cost model's, from
    `plan.decisions["stage_times"]`, else shares of the predicted compute, else units."""
    n = len(plan.stages)
    split = _splits_backward(plan)
    given = plan.decisions.get("stage_times")
    if given and len(given) == n:
        parts = [tuple(float(x) for x in t) if isinstance(t, Sequence) else float(t) for t in given]
        return [_phase_times(t, split) for t in parts], "ms"
    if plan.predicted is not None and plan.predicted.compute_s > 0:
        tau = plan.predicted.compute_s / max(1, plan.microbatches)
        return [_phase_times(tau, split)] * n, "ms"
    return [_phase_times(3.0, split)] * n, "units"


def _splits_backward(plan: Plan) -> bool:
    try:
        return pipeline_schedule(plan.schedule, plan.virtual_stages).splits_backward
    except PlanError:  # a schedule not registered here: the drawing names it in one line
        return False


def _phase_times(t: float | tuple[float, ...], split: bool) -> tuple[float, ...]:
    """One stage's times as the schedule runs them. One number is forward + backward, split
    1:2 (a backward costs about two forwards); a split backward's B and W are taken equal
    (Qi et al.'s assumption) where only their sum is given. A triple kept as it is."""
    if not isinstance(t, tuple):
        t = (t / 3, 2 * t / 3)
    if split and len(t) == 2:
        return (t[0], t[1] / 2, t[1] / 2)
    return t


def memory_bars(plan: Plan) -> list[tuple[str, dict[str, float]]]:
    per_stage = plan.decisions.get("stage_memory")
    if per_stage:
        return [
            (f"stage {i}", {k: float(v) for k, v in d.items()}) for i, d in enumerate(per_stage)
        ]
    cost = plan.predicted
    parts = dict(cost.memory_breakdown) or {"total": cost.memory_bytes}
    return [("peak device", {k: float(v) for k, v in parts.items()})]


def read_curve(path: str | Path) -> dict[str, list[float]]:
    """Columns of a learning-curve CSV as floats (blank or unparsable cells become NaN);
    any column may be missing, episodes count from 1 when there is no episode column."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    out: dict[str, list[float]] = {}
    for key in rows[0] if rows else ():
        name = CURVE_ALIASES.get(key.strip(), key.strip())
        out[name] = [_float(r.get(key)) for r in rows]
    out.setdefault("episode", [float(i + 1) for i in range(len(rows))])
    return out


def _float(text: str | None) -> float:
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def breakdown(cost: Cost) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    parts = [("compute", cost.compute_s), ("communication", cost.comm_s), ("bubble", cost.bubble_s)]
    comm = sorted(
        ((f"{c.kind} on {c.axis}", c.time_s) for c in cost.collectives), key=lambda p: -p[1]
    )
    if len(comm) > 6:  # a legend past six entries stops being read
        comm = [*comm[:5], ("other collectives", sum(t for _, t in comm[5:]))]
    return [p for p in parts if p[1] > 0], comm


def cluster_of(plan: Plan) -> Cluster | None:
    """The cluster the plan names, when it is a preset: node boundaries need it."""
    prov = plan.provenance
    if prov.cluster not in Cluster.presets():
        return None
    try:
        return Cluster.preset(prov.cluster, devices=prov.devices or plan.devices)
    except ClusterError:
        return None


def axis_links(plan: Plan, cluster: Cluster | None) -> dict[str, str]:
    if cluster is None:
        return {}
    try:
        return {k: LINK_WORDS[v.kind] for k, v in cluster.axis_links(plan.mesh).items()}
    except ClusterError:  # a plan for more devices than this cluster: draw it without links
        return {}


def device_ranges(devices: Sequence[int]) -> str:
    """ "0–3" for a contiguous block (as pipeline stages have), else the list folded."""
    xs = sorted(devices)
    return _ranges(xs) if xs else "—"


def stage_rows(plan: Plan) -> list[tuple[str, ...]]:
    """Per pipeline stage: its forward op range, its devices, its mesh, its (forward,
    backward) seconds per microbatch and its memory per device, as the plan records them
    (`stage_times`, `stage_memory` in its decisions: blank where it has none)."""
    times = plan.decisions.get("stage_times") or []
    memory = plan.decisions.get("stage_memory") or []
    rows = []
    for s, st in enumerate(plan.stages):
        mesh = " × ".join(f"{k}={v}" for k, v in st.mesh.items()) or "one device"
        fwd = bwd = mem = ""
        if len(times) == len(plan.stages):
            t = times[s]
            # (fwd, B, W) where the backward is split: its backward is B + W
            f, b = (t[0], sum(t[1:])) if isinstance(t, Sequence) else (t / 3, 2 * t / 3)
            fwd, bwd = human_time(float(f)), human_time(float(b))
        if len(memory) == len(plan.stages):
            mem = human_bytes(sum(float(v) for v in memory[s].values()))
        rows.append(
            (
                str(s),
                f"[{st.op_start}, {st.op_stop})",
                f"{device_ranges(st.devices)} ({len(st.devices)})",
                mesh,
                fwd,
                bwd,
                mem,
            )
        )
    return rows
