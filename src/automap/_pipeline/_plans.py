"""Building pipeline plans: where a stage may start, and the Plan for a set of cuts.

A cut before forward op k sends, per microbatch, every forward tensor made before k and
read at or after it (and, in the backward pass, their gradients the other way). Between
layers that is the residual stream alone; inside a layer it is more (the residual plus the
branch being computed). `cut_candidates` keeps the cheap ones: the bottoms of the valleys
of that crossing size (one per run of cheap cuts), which for a transformer are the two residual adds of each block,
for a CNN the block outputs. That is the pipeline task's pruning: a search picks stage
boundaries among a few dozen candidates instead of thousands of ops.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from .._axes import PIPE
from .._errors import PlanError
from .._graph import Graph
from .._groups import Groups, plan_from_assignment
from .._plan import Plan, Stage
from ._partition import forward_ops
from ._registry import pipeline_schedule

#: Cuts crossing at most this factor of the typical cheap crossing form one run, which
#: gives one candidate (a layer norm's statistics add a few percent; a block's body 2x+).
BAND = 1.25
#: Valley bottoms under this fraction of the median crossing are not activation-sized.
FLOOR = 0.05
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def crossing_bytes(graph: Graph, groups: Groups) -> tuple[tuple[int, ...], np.ndarray]:
    """(forward op indices, bytes per microbatch crossing a cut before each of them)."""
    fwd = forward_ops(graph, groups)
    pos = {i: k for k, i in enumerate(fwd)}
    consumers = graph.consumers()
    delta = np.zeros(len(fwd) + 1)
    for i in fwd:
        for t in graph.ops[i].outputs:
            last = max((pos[c] for c in consumers[t] if c in pos), default=-1)
            if last > pos[i]:  # alive across every cut in (producer, last reader]
                delta[pos[i] + 1] += graph.tensors[t].nbytes
                delta[last + 1] -= graph.tensors[t].nbytes
    return fwd, np.cumsum(delta)[: len(fwd)]


def cut_candidates(graph: Graph, groups: Groups) -> tuple[int, ...]:
    """Forward op indices where a pipeline stage may start (op 0 excluded).

    The layer-boundary level is the commonest valley bottom of the crossing bytes among
    those not negligible (at least FLOOR of the median crossing): the residual stream
    between repeated layers. Every maximal run of cuts within BAND of it gives one candidate, its cheapest
    (first) cut. The band lets a run go through a layer norm
    (the residual plus its per-token statistics) but not through a block's body."""
    return tuple(run.candidate for run in cut_runs(graph, groups))


@dataclasses.dataclass(frozen=True)
class CutRun:
    """One run of cheap cuts (`cut_candidates`): every cut in it, with its crossing bytes."""

    cuts: tuple[int, ...]  # forward op indices a stage may start at, ascending
    crossing: tuple[float, ...]  # bytes per microbatch crossing each
    candidate: int  # the cheapest (first) of them: the run's cut candidate


def cut_runs(graph: Graph, groups: Groups) -> tuple[CutRun, ...]:
    """The runs of cheap cuts behind `cut_candidates`, one per candidate. A run may go
    through a layer norm: where a post-LN layer (BERT's) ends with its norm, the run's
    cheapest cut (the residual add, before the norm) lies inside the layer, and a later
    cut of the same run (after the norm) is the layer's end."""
    return graph.recall("cut_runs", groups, None, lambda: _cut_runs(graph, groups), keep=1)


def _cut_runs(graph: Graph, groups: Groups) -> tuple[CutRun, ...]:
    fwd, cross = crossing_bytes(graph, groups)
    if len(fwd) < 2:
        return ()
    inner = cross[1:]
    bottoms = [
        inner[k]
        for k in range(len(inner))
        if (k == 0 or inner[k] <= inner[k - 1]) and (k + 1 == len(inner) or inner[k] < inner[k + 1])
    ]
    # Bottoms far below the activations (the token ids before the embedding, the loss's
    # scalars) are cheap cuts too, but they are not the level a layer boundary sits at.
    # Repeated layers repeat their boundary's crossing: the commonest bottom is the level.
    level = [b for b in bottoms if b >= FLOOR * float(np.median(inner))] or bottoms
    counts = collections.Counter(level)
    typical = min(counts, key=lambda b: (-counts[b], b))
    low = inner <= BAND * typical
    out: list[int] = []  # the best position of each run
    runs: list[list[int]] = []  # the positions of each run
    k = 0
    while k < len(inner):
        if not low[k]:
            k += 1
            continue
        j = k
        while j + 1 < len(inner) and low[j + 1]:
            j += 1
        best = k + int(np.argmin(inner[k : j + 1]))
        between = (graph.ops[i].primitive for i in fwd[out[-1] + 1 : best + 1]) if out else ()
        if out and not any(p in _MATMULS for p in between):
            # No layer between the two runs (a layer norm's own bump): one candidate.
            if inner[best] < inner[out[-1]]:
                out[-1] = best
            runs[-1].extend(range(k, j + 1))
        else:
            out.append(best)
            runs.append(list(range(k, j + 1)))
        k = j + 1
    return tuple(
        CutRun(tuple(fwd[q + 1] for q in run), tuple(float(inner[q]) for q in run), fwd[b + 1])
        for b, run in zip(out, runs, strict=True)
    )


def uniform_cuts(graph: Graph, groups: Groups, n_stages: int) -> tuple[int, ...]:
    """`n_stages - 1` candidates that split the forward work (FLOPs) as equally as they can:
    for a stack of equal layers, equal numbers of layers per stage."""
    if n_stages < 1:
        raise PlanError(f"a pipeline needs at least one stage, not {n_stages}.")
    cands = cut_candidates(graph, groups)
    if n_stages - 1 > len(cands):
        raise PlanError(
            f"{n_stages} pipeline stages need {n_stages - 1} cuts, but this step has only "
            f"{len(cands)} cheap places to cut between layers. Use fewer stages."
        )
    fwd = forward_ops(graph, groups)
    done = np.cumsum([graph.ops[i].flops for i in fwd])  # work finished after each op
    total = float(done[-1]) if len(done) else 0.0
    pos = {i: k for k, i in enumerate(fwd)}
    before = [float(done[pos[c] - 1]) for c in cands]  # work before each candidate
    cuts: list[int] = []
    lo = 0
    for s in range(1, n_stages):
        # Leave enough candidates after this one for the remaining cuts.
        hi = len(cands) - (n_stages - 1 - s)
        target = total * s / n_stages
        k = min(range(lo, hi), key=lambda k: (abs(before[k] - target), k))
        cuts.append(cands[k])
        lo = k + 1
    return tuple(cuts)


def pipeline_plan(
    graph: Graph,
    groups: Groups,
    cuts: Sequence[int],
    stage_mesh: Mapping[str, int],
    assignment: Mapping[int, str | None],
    microbatches: int = 1,
    schedule: str = "1f1b",
    name: str = "pipeline",
    *,
    zero_stage: int = 0,
    virtual_stages: int = 1,
) -> Plan:
    """The Plan with stages starting at `cuts` (forward op indices, ascending, 0 left out),
    each on its own copy of `stage_mesh` (contiguous device blocks, in stage order), the
    group -> axis `assignment` inside every stage, and the microbatch schedule.
    `virtual_stages` v > 1 (interleaved schedules): the cuts give S * v stages and stage
    p runs on device group p % S, chunk p // S of it."""
    run = pipeline_schedule(schedule, virtual_stages)  # known, and able to run v chunks
    if (len(cuts) + 1) % virtual_stages:
        raise PlanError(
            f"{len(cuts) + 1} pipeline stages do not split into {virtual_stages} virtual "
            f"stages per device group; give a multiple of {virtual_stages} stages."
        )
    run.check((len(cuts) + 1) // virtual_stages, microbatches)
    if PIPE in stage_mesh:
        raise PlanError('the stage mesh cannot have a "pipe" axis: that one is the stages.')
    starts = [0, *cuts]
    if any(b <= a for a, b in itertools.pairwise(starts)):
        raise PlanError(f"pipeline cuts {list(cuts)} must be ascending and after op 0.")
    # With ZeRO, as for one stage: the gradients and the update pinned to the ZeRO layout.
    # A stage sums its gradients whole over the microbatches and its "reduce" program
    # reduce-scatters them into that layout once per step (`_run/_accumulate.py`). Its
    # POST program gathers the new parameters (`Plan.zero_gather` "compute" is one stage's).
    inner = plan_from_assignment(
        graph, groups, stage_mesh, assignment, name=name, zero_stage=zero_stage,
        zero_gather="params",
    )  # fmt: skip
    per = math.prod(stage_mesh.values()) if stage_mesh else 1
    stops = [*cuts, len(graph.ops)]
    groups = len(starts) // virtual_stages
    stages = tuple(
        Stage(a, b, tuple(range(s % groups * per, (s % groups + 1) * per)), dict(stage_mesh))
        for s, (a, b) in enumerate(zip(starts, stops, strict=True))
    )
    return Plan(
        mesh={PIPE: groups, **stage_mesh},
        specs=inner.specs,
        out_specs=inner.out_specs,
        constraints=inner.constraints,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        zero_stage=zero_stage,
        name=name,
        assignment=inner.assignment,
        decisions={**inner.decisions, "cuts": list(cuts)},
    )
