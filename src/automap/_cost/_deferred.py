"""What a zero-bubble schedule's deferred weight gradients hold, per stage and device.

Where a schedule splits each backward (ZB-H1, `_pipeline/_zero_bubble.py`), a
microbatch's residuals no longer all die with its backward: B frees those only it reads,
and until the microbatch's W runs the stage keeps what W reads, the residuals W reads
and the values B made for it (each layer's output gradient, which W contracts with the
layer's input into the weight gradient). The runtime drops each value after its last
reader on the stage (`_run/_pipelined.py`), so at any moment stage s holds, per
microbatch, all its residuals for those between F and B, and W's share for those between
B and W; `PipelineSchedule.live_counts` gives the two counts after every task. The
stage's residuals at 1F1B's in-flight count are priced already (`_traffic._residuals`);
this is what the deferred W's add at the stage's fullest moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .._capture import Residuals
from .._graph import Graph
from .._pipeline import Partition, Phase, PipelineSchedule


class Held(NamedTuple):
    """A value each microbatch holds for its backward, on a stage that runs one of its
    `readers` (and its `maker` too, where given): per device, per microbatch."""

    nbytes: float
    for_w: bool  # W's share (held from B to W); else one of all the residuals (F to B)
    readers: tuple[int, ...]  # op indices
    maker: int | None = None


def deferred_holds(
    graph: Graph, part: Partition, inv: Sequence[float], res: Residuals, m: int
) -> tuple[Held, ...]:
    """What a split backward's microbatches hold (`part` split, `_split.split_backward`):
    each residual a forward makes, among all the residuals of every stage whose backward
    (B or W) reads it and in W's share of every stage whose W reads it; and each value a B
    makes that a W of the same stage reads, in W's share. The stage DP sums these over
    layer segments (`_search/_cut_tables.py`), the pipeline model per stage: one list."""
    phase, consumers = part.op_phase, graph.consumers()

    def per_mb(t: int) -> float:
        b = graph.tensors[t].nbytes * inv[t]
        return b / m if t in part.batched else b

    out: list[Held] = []
    for t in res.saved:
        if phase[graph.tensors[t].producer] is not Phase.FWD:
            continue  # made once per step, held once (`_traffic._residuals`)
        back = tuple(c for c in consumers[t] if phase[c] in (Phase.BWD, Phase.WGT))
        wgt = tuple(c for c in back if phase[c] is Phase.WGT)
        if back:
            out.append(Held(per_mb(t), False, back))
        if wgt:
            out.append(Held(per_mb(t), True, wgt))
    for op in graph.ops:  # B's values that its stage's W reads
        if phase[op.index] is Phase.BWD:
            for t in op.outputs:
                wgt = tuple(c for c in consumers[t] if phase[c] is Phase.WGT)
                if wgt:
                    out.append(Held(per_mb(t), True, wgt, op.index))
    return tuple(out)


def deferred_beyond(
    schedule: PipelineSchedule, stages: int, m: int, whole: Sequence, for_w: Sequence
) -> list:
    """Per stage s, what its deferred W's hold at its fullest moment beyond its residuals
    at `schedule.stage_in_flight` microbatches, from `whole[s]` (a microbatch's residuals)
    and `for_w[s]` (W's share), read off the schedule's `live_counts`. `whole[s]` and
    `for_w[s]` may be arrays (a stage DP's every layer range): so is each result."""
    in_flight = schedule.stage_in_flight(stages, m)
    out = []
    for s, counts in enumerate(schedule.live_counts(stages, m)):
        fullest = None
        for f, w in sorted(set(counts)):
            held = f * whole[s] + w * for_w[s]
            fullest = held if fullest is None else np.maximum(fullest, held)
        out.append(np.maximum(0.0, fullest - in_flight[s] * whole[s]))
    return out


def deferred_weight_bytes(
    graph: Graph,
    part: Partition,
    inv: Sequence[float],
    res: Residuals,
    schedule: PipelineSchedule,
    m: int,
) -> list[float]:
    """Per stage, the bytes per device its deferred W's hold beyond its residuals at
    `schedule.stage_in_flight` microbatches (0 on a schedule that does not split the
    backward). `inv`: each tensor's fraction per device under the stage plan."""
    S = part.n_stages
    if not schedule.splits_backward:
        return [0.0] * S
    whole, for_w = np.zeros(S), np.zeros(S)
    stage = part.op_stage
    for held in deferred_holds(graph, part, inv, res, m):
        on = {stage[c] for c in held.readers}
        if held.maker is not None:
            on &= {stage[held.maker]}
        for s in on:
            (for_w if held.for_w else whole)[s] += held.nbytes
    return [float(b) for b in deferred_beyond(schedule, S, m, whole, for_w)]
