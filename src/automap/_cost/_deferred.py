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

from .._capture import Residuals
from .._graph import Graph
from .._pipeline import Partition, Phase, PipelineSchedule


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
    phase, stage, consumers = part.op_phase, part.op_stage, graph.consumers()

    def per_mb(t: int) -> float:
        b = graph.tensors[t].nbytes * inv[t]
        return b / m if t in part.batched else b

    def readers(t: int, phases: tuple[Phase, ...]) -> set[int]:
        return {stage[c] for c in consumers[t] if phase[c] in phases}

    whole, for_w = [0.0] * S, [0.0] * S  # per microbatch: all residuals, W's share
    for t in res.saved:
        if phase[graph.tensors[t].producer] is not Phase.FWD:
            continue  # made once per step, held once (`_traffic._residuals`)
        for s in readers(t, (Phase.BWD, Phase.WGT)):
            whole[s] += per_mb(t)
        for s in readers(t, (Phase.WGT,)):
            for_w[s] += per_mb(t)
    for op in graph.ops:  # B's values that its stage's W reads
        if phase[op.index] is Phase.BWD:
            for t in op.outputs:
                if stage[op.index] in readers(t, (Phase.WGT,)):
                    for_w[stage[op.index]] += per_mb(t)
    in_flight = schedule.stage_in_flight(S, m)
    out = []
    for s, counts in enumerate(schedule.live_counts(S, m)):
        fullest = max(f * whole[s] + w * for_w[s] for f, w in counts)
        out.append(max(0.0, fullest - in_flight[s] * whole[s]))
    return out
