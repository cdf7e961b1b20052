"""A pipeline stage's memory terms and FLOPs read from the XLA programs it runs.

A pipeline step is not one program: per stage the runtime runs "pre" programs once
(casts and copies of the step's inputs), "F" and "B" once per microbatch, a "reduce" of
the accumulated gradients and "post" programs once (the optimizer update, in pieces
interleaved with other stages'). XLA's buffer assignment sees one program at a time, so
a stage's peak is combined from what the runtime holds between its programs:

    peak = held inputs + gradients + in_flight x (F's outputs) + max(F's, B's temporaries)

- held inputs: the step's input leaves the stage reads (parameters, optimizer state, the
  batch), each as the runtime places it (`jax.device_put` with the plan's spec on the
  stage mesh: the arguments XLA is handed, per device);
- gradients: the stage's accumulated gradients, XLA's "reduce" program's arguments (with
  one microbatch, no reduce: its B program's outputs);
- F's outputs (the residuals its B reads, and the activation sent on) are held for every
  microbatch in flight at the stage's peak (GPipe: all of them; 1F1B: the warm-up depth);
- the largest per-microbatch program's temporaries (its gathers, partial sums, a remat
  B's recomputed layer).

Left out, and why: the "pre" programs' outputs (16-bit copies of f32 parameters, where a
step casts them once; verify's small models run in f32), the "post" programs' own
temporaries (an elementwise update, after the activations are gone), and the copies
`jax.device_put` makes of the sends between stages (one microbatch's activation).
FLOPs are summed, each program times its runs (`_flops.compiled_flops`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .._pipeline import Phase
from ._flops import compiled_flops


def stage_memory_parts(
    pipe: Any, programs: Sequence[Any], stage: int, in_flight: int
) -> dict[str, float]:
    """A stage's memory by the module doc's terms, per device ({} where the backend gives
    no buffer assignment). `am.verify` shows it as XLA's breakdown; its peak figure is
    `run.memory`'s, which also holds the values the runtime keeps between programs (verify
    adds them to the breakdown as "held between programs")."""
    stats = [(p.kind, p.compiled.memory_analysis()) for p in programs if p.stage == stage]
    if not stats or any(s is None for _, s in stats):
        return {}
    reduced = [s.argument_size_in_bytes for kind, s in stats if kind is Phase.REDUCE]
    grads = (
        sum(reduced)
        if reduced
        else max((s.output_size_in_bytes for kind, s in stats if kind is Phase.BWD), default=0)
    )
    fwd = max((s.output_size_in_bytes for kind, s in stats if kind is Phase.FWD), default=0)
    per_mb = (Phase.FWD, Phase.BWD)
    temp = max((s.temp_size_in_bytes for kind, s in stats if kind in per_mb), default=0)
    return {
        "held inputs": float(held_inputs(pipe, stage)),
        "gradients": float(grads),
        "in-flight F outputs": float(in_flight * fwd),
        "temporaries": float(temp),
    }


def held_inputs(pipe: Any, stage: int) -> float:
    """Bytes per device of the step's input leaves that `stage` reads, by their specs."""
    graph, op_stage = pipe.graph, pipe.part.op_stage
    sizes = dict(pipe.meshes[stage].shape)
    consumers = graph.consumers()
    total = 0.0
    for leaf in graph.inputs:
        if not any(op_stage[c] == stage for c in consumers[leaf.tensor]):
            continue
        axes = [
            a for e in pipe.spec[leaf.tensor] for a in ((e,) if isinstance(e, str) else e or ())
        ]
        total += graph.tensors[leaf.tensor].nbytes / math.prod(sizes[a] for a in axes)
    return total


def stage_flops(programs: Sequence[Any], stage: int) -> float | None:
    """FLOPs per device per step of one stage: its programs' counts times their runs."""
    total = 0.0
    for p in programs:
        if p.stage != stage:
            continue
        flops = compiled_flops(p.compiled)
        if flops is None:
            return None
        total += flops * p.runs
    return total
