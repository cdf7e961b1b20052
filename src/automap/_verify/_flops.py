"""FLOPs per device: the cost model's count of a plan next to XLA's `cost_analysis()`.

The cost model prices compute from the captured graph's FLOPs (`_capture/_flops.py`: a
multiply-accumulate is two, one per elementwise output, transcendentals included), each
op divided by the sharding divisor of its iteration space under the plan, and the ops a
remat plan recomputes counted twice. XLA's `compiled.cost_analysis()` of the partitioned
program counts the FLOPs one device runs. Read with jax 0.10 on the CPU backend, it
differs from the graph's count in three ways, which the comparison accounts for:

- transcendentals (exp, log, tanh, rsqrt, sqrt...) are counted apart from "flops"
  (`cost_analysis()["transcendentals"]`): XLA's side here is their sum, as the graph
  counts them;
- a while loop's body is counted once, whatever its trip count (a scan of 10 matmuls
  counts one): the graph counts the body times its trips, which is what runs. The
  comparison uses the graph's count *as XLA counts*: every loop body once;
- a convolution counts only the kernel taps that meet the input (padding is not data),
  where the graph counts padding as data, as published CNN FLOP counts do: the count as
  XLA counts it takes the taps that meet the input, per spatial dimension.

What is left is small and named: reductions count n - 1 adds (the graph n), the
all-reduce of a collective adds its sums, and XLA's algebraic simplifier removes a few
elementwise ops. The ZeRO update runs on shards, which the cost model's compute does not
divide (an optimizer update is a few FLOPs per parameter, far below the matmuls).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._axes import DATA, PIPE
from .._cost import AxisCosts, CostModel, split_alone, split_compute, zero_shares
from .._graph import Graph, Op
from .._groups import body_tensor_groups, rule
from .._pipeline import partition
from .._plan import Plan

#: Primitives whose graph count differs from XLA's by the loop and padding rules above.
LOOP_PRIMITIVES = frozenset({"scan", "while", "cond"})


def compiled_flops(compiled: Any) -> float | None:
    """FLOPs per device of a compiled program by XLA's cost analysis: "flops" plus
    "transcendentals" (the graph counts a transcendental as one FLOP); None where the
    backend does not say."""
    stats = compiled.cost_analysis()
    if isinstance(stats, (list, tuple)):  # older jax: one dict per program
        stats = stats[0] if stats else None
    if stats is None:
        return None
    return float(stats.get("flops", 0.0)) + float(stats.get("transcendentals", 0.0))


def xla_counted_flops(graph: Graph, op: Op) -> float:
    """An op's FLOPs as XLA's cost analysis counts them: loop bodies once, convolutions
    without the padded taps; every other op as the graph counts it."""
    bodies = graph.bodies.get(op.index) if op.primitive in LOOP_PRIMITIVES else None
    if bodies:
        priced = [b for b in bodies if b.priced] or list(bodies)
        return sum(xla_counted_flops(b.graph, bop) for b in priced for bop in b.graph.ops)
    if op.primitive == "conv_general_dilated":
        return _conv_flops_without_padding(graph, op)
    return op.flops


def _conv_flops_without_padding(graph: Graph, op: Op) -> float:
    """2 x (batch x output features) x (input features per group) x, per spatial dim, the
    (output position, kernel tap) pairs that land on a real input element (XLA's
    HloCostAnalysis for convolutions, dilations and strides included)."""
    p = op.params
    dn = p["dimension_numbers"]
    lhs = graph.tensors[op.inputs[0]].shape
    rhs = graph.tensors[op.inputs[1]].shape
    out = graph.tensors[op.outputs[0]].shape
    pairs = 1
    spatial = zip(dn.lhs_spec[2:], dn.rhs_spec[2:], dn.out_spec[2:], strict=True)
    for i, (li, ri, oi) in enumerate(spatial):
        o = np.arange(out[oi])[:, None] * p["window_strides"][i]
        k = np.arange(rhs[ri])[None, :] * p["rhs_dilation"][i]
        pos = o + k - p["padding"][i][0]
        dil = p["lhs_dilation"][i]
        pairs *= int(np.sum((pos >= 0) & (pos <= (lhs[li] - 1) * dil) & (pos % dil == 0)))
    batch_features = out[dn.out_spec[0]] * out[dn.out_spec[1]]
    return 2.0 * batch_features * rhs[dn.rhs_spec[1]] * pairs


def live_ops(graph: Graph) -> np.ndarray:
    """Per op, whether a result reaches a step output: XLA removes the others."""
    live = {leaf.tensor for leaf in graph.outputs}
    out = np.zeros(len(graph.ops), dtype=bool)
    for op in reversed(graph.ops):
        if any(t in live for t in op.outputs):
            out[op.index] = True
            live.update(op.inputs)
    return out


def op_divisors(model: CostModel, plan: Plan, mesh: dict[str, int], split=None) -> np.ndarray:
    """Per op, 1 / the sharding divisor of its iteration space under the plan: the share
    of its FLOPs one device runs, as the cost model prices compute (ZeRO's pinned
    gradients and update ops on the device's data shard included, and the gradient dots
    XLA splits beside data on their 1/n pieces, `_cost/_beside.py`: where `split` is
    true, [n_ops], for a pipeline's stages, `_stage_comm.split_alone`)."""
    state = model.state(model.plan_assignment(plan), mesh, detail=True)  # a row per op
    share = state.inv[model.tables.op_set]
    if plan.zero_stage >= 1 and mesh.get(DATA, 1) > 1:
        d, n = list(mesh).index(DATA) + 1, mesh[DATA]
        share = share * zero_shares(model.tables, state.P, d, n)
        ops = model.beside.ops(state, AxisCosts(model.cluster, mesh), d)
        ops = ops if split is None else ops[split[ops]]
        share[ops] -= split_compute(share[ops], n)
    # A loop's own set is empty (its bodies' ops carry its compute, each on its own
    # split): its share is its bodies' ops' shares, weighted by their FLOPs.
    for op in model.graph.ops:
        if op.primitive in LOOP_PRIMITIVES and model.graph.bodies.get(op.index):
            share[op.index] = _loop_share(model, op, state.inv)
    return share


def _loop_share(model: CostModel, op: Op, inv: np.ndarray) -> float:
    """The share of loop op's FLOPs one device runs: its priced bodies' ops (nested loops
    through theirs), each divided by the split of its iteration set, as XLA counts them."""
    T, ng = model.tables, len(model.groups.groups)
    index = {tuple(sorted(int(g) for g in row if g < ng)): i for i, row in enumerate(T.sets)}
    split = T.splittable

    def walk(op: Op, g: Graph, tgs) -> tuple[float, float]:
        run = total = 0.0
        bodies = g.bodies[op.index]
        priced = [b.priced for b in bodies]
        for body, btg in zip(bodies, body_tensor_groups(op, g, tgs, ng), strict=True):
            if not body.priced and any(priced):
                continue
            for bop in body.graph.ops:
                if bop.primitive in LOOP_PRIMITIVES and body.graph.bodies.get(bop.index):
                    r, t = walk(bop, body.graph, btg)
                else:
                    r_ = rule(bop, body.graph)
                    outs = {x for o in bop.outputs for x in btg[o] if split[x]}
                    red = {x for t_, d in r_.reduced if split[x := btg[t_][d]]} - outs
                    key = tuple(sorted(outs | red))
                    t = bop.flops
                    r = t * (inv[index[key]] if key in index else 1.0)
                run, total = run + r, total + t
        return run, total

    run, total = walk(op, model.graph, model.groups.tensor_groups)
    return run / total if total else 1.0


def op_runs(model: CostModel, plan: Plan) -> np.ndarray:
    """Per op, how many times one step runs its whole-batch work: 1, and 2 for an op
    a remat plan recomputes in the backward (matmuls included); 0 for dead ops."""
    runs = live_ops(model.graph).astype(float)
    if plan.remat:
        again = list(model.for_plan(plan).residuals.recomputed)
        runs[again] += runs[again]
    return runs


def per_op_flops(
    model: CostModel, plan: Plan, mesh: dict[str, int], split=None
) -> tuple[np.ndarray, ...]:
    """Per op, FLOPs per device per step: (as the graph counts them, as XLA counts them);
    `split`: as `op_divisors`."""
    share = op_divisors(model, plan, mesh, split) * op_runs(model, plan)
    graph = model.graph
    counted = np.array([op.flops for op in graph.ops], dtype=float)
    as_xla = np.array([xla_counted_flops(graph, op) for op in graph.ops], dtype=float)
    return counted * share, as_xla * share


def predicted_flops(model: CostModel, plan: Plan) -> tuple[float, float]:
    """FLOPs per device per step of a one-program plan: (the cost model's, the same
    counted as XLA's cost analysis counts them)."""
    counted, as_xla = per_op_flops(model, plan, dict(plan.mesh))
    return float(counted.sum()), float(as_xla.sum())


def predicted_stage_flops(model: CostModel, plan: Plan) -> tuple[tuple[float, float], ...]:
    """Per pipeline stage, FLOPs per device per step (every microbatch's share summed):
    (the cost model's, as XLA counts them). The stage mesh is the plan's without "pipe"."""
    stage_mesh = {k: v for k, v in plan.mesh.items() if k != PIPE}
    bounds = [(st.op_start, st.op_stop) for st in plan.stages]
    part = partition(model.graph, model.groups, bounds, plan.microbatches)
    split = split_alone(model.graph, part, max(1, int(plan.microbatches)))  # `op_divisors`
    counted, as_xla = per_op_flops(model, plan, stage_mesh, split)
    stage = np.array(part.op_stage)
    return tuple(
        (float(counted[stage == s].sum()), float(as_xla[stage == s].sum()))
        for s in range(part.n_stages)
    )


def ratio_note(predicted: float, as_xla: float) -> str:
    """Why the graph's count and the XLA-convention count differ, when they do."""
    if math.isclose(predicted, as_xla, rel_tol=1e-9):
        return ""
    return (
        f"FLOPs: the cost model counts {predicted:.4g} per device; XLA's cost analysis "
        "counts a loop body once and no padded convolution taps, so the graph's count "
        f"compared with XLA's is {as_xla:.4g} (this module's doc)"
    )
