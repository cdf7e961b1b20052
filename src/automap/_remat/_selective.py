"""Selective recomputation (Korthikanti et al., MLSys 2023, §4): recompute only each
layer's attention core, QKᵀ, the softmax, its dropout and the attention over V, which
holds O(s²) activations per layer for little arithmetic; keep everything else.

The core is found from the program's structure, not from names: inside a layer, a matmul
of two activations (neither operand made from parameters alone: not a projection) whose
result reaches, through ops that are not matmuls, an operand of a second such matmul. The
core is the two matmuls, the ops on the paths between them (mask, scale, softmax,
dropout), and what feeds only those paths inside the layer (the causal mask, the dropout
bits), but not what makes Q, K or V. A layer without that pattern (an MLP) has no core,
so a program without attention recomputes nothing under this policy.

The "projections" policy (`projection_gaps`) recomputes the complement of the matmuls with
a weight: per layer, every op on activations that is not a projection (norms, rotary, the
attention core, the MLP's activation and product, the residual adds), so that only the
layer's input and its projections' outputs stay alive. It is MaxText's `remat_policy=
minimal` (`save_only_these_names` over the query, key, value, attention-out and MLP
projections' outputs; `decoders.py`, `minimal_policy`) and JAX's
`checkpoint_policies.dots_with_no_batch_dims_saveable` on a transformer layer: a
projection's weight has no batch dimension, the attention's two products do.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._graph import Graph, Role

DOT = "dot_general"


def attention_cores(graph: Graph, layers: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Per layer, the ops of its attention core(s) in program order (empty: none)."""
    data = _from_data(graph, max((i for layer in layers for i in layer), default=-1))
    return tuple(_cores(graph, layer, data) for layer in layers)


def projection_gaps(graph: Graph, layers: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Per layer, its ops other than projections and what makes their weights, in program
    order: what the "projections" policy recomputes (the module's docstring). A projection
    is a matmul with an operand made from parameters alone; the ops on parameters alone
    that make such an operand (a weight's cast) are left to the projections, which read
    them, while those feeding the rest (a causal mask, rotary angles) are made again with
    it, as selective recomputation makes the mask with the core."""
    data = _from_data(graph, max((i for layer in layers for i in layer), default=-1))
    return tuple(_gaps(graph, layer, data) for layer in layers)


def _gaps(graph: Graph, layer: Sequence[int], data: set[int]) -> tuple[int, ...]:
    producer = {t: i for i in layer for t in graph.ops[i].outputs}
    projections = {
        i
        for i in layer
        if graph.ops[i].primitive == DOT and not all(t in data for t in graph.ops[i].inputs)
    }
    weights = [t for i in projections for t in graph.ops[i].inputs if t not in data]
    fenced = _ancestors(graph, weights, producer, set())
    return tuple(i for i in layer if i not in projections and i not in fenced)


def _from_data(graph: Graph, last: int) -> set[int]:
    """Tensors that depend on a non-parameter input (the batch, a key): activations."""
    out = {leaf.tensor for role in (Role.BATCH, Role.OTHER) for leaf in graph.leaves(role)}
    for op in graph.ops[: last + 1]:
        if any(t in out for t in op.inputs):
            out.update(op.outputs)
    return out


def _cores(graph: Graph, layer: Sequence[int], data: set[int]) -> tuple[int, ...]:
    inside = set(layer)
    producer = {t: i for i in layer for t in graph.ops[i].outputs}
    pair = [
        i
        for i in layer
        if graph.ops[i].primitive == DOT and all(t in data for t in graph.ops[i].inputs)
    ]
    core: set[int] = set()
    for d2 in pair:
        for operand in graph.ops[d2].inputs:
            path = _path_from_matmul(graph, operand, producer, set(pair))
            if path is None:
                continue
            d1, between = path
            others = [t for t in graph.ops[d2].inputs if t != operand]
            fenced = {d1, d2} | _ancestors(graph, graph.ops[d1].inputs, producer, set())
            fenced |= _ancestors(graph, others, producer, set())
            side = _ancestors(graph, _reads(graph, between), producer, fenced)
            core |= {d1, d2} | between | {i for i in side if graph.ops[i].primitive != DOT}
    return tuple(i for i in layer if i in core and i in inside)


def _path_from_matmul(graph: Graph, tensor: int, producer, matmuls: set[int]):
    """(the activation matmul `tensor` descends from through non-matmul ops, the ops on
    the way), or None. Breadth-first up the producers; the nearest matmul wins."""
    seen: set[int] = set()
    frontier = [tensor]
    while frontier:
        nxt = []
        for t in frontier:
            i = producer.get(t)
            if i is None or i in seen:
                continue
            if i in matmuls:
                return i, _between(graph, i, tensor, producer)
            if graph.ops[i].primitive == DOT:
                continue  # a projection: not the attention core's path
            seen.add(i)
            nxt.extend(graph.ops[i].inputs)
        frontier = nxt
    return None


def _between(graph: Graph, d1: int, tensor: int, producer) -> set[int]:
    """Ops on the paths from d1's output to `tensor` (d1 excluded)."""
    made = set(graph.ops[d1].outputs)
    out: set[int] = set()
    memo: dict[int, bool] = {}

    def reaches(t: int) -> bool:
        if t in made:
            return True
        if t in memo:
            return memo[t]
        memo[t] = False
        i = producer.get(t)
        if i is None or i == d1 or graph.ops[i].primitive == DOT:
            return False
        hit = [reaches(s) for s in graph.ops[i].inputs]
        if any(hit):
            out.add(i)
            memo[t] = True
        return memo[t]

    reaches(tensor)
    return out


def _reads(graph: Graph, ops: set[int]) -> list[int]:
    return [t for i in ops for t in graph.ops[i].inputs]


def _ancestors(graph: Graph, tensors, producer, stop: set[int]) -> set[int]:
    """Ops inside the layer that `tensors` depend on, not walking past `stop` or matmuls."""
    out: set[int] = set()
    todo = list(tensors)
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in out or i in stop:
            continue
        out.add(i)
        if graph.ops[i].primitive != DOT:
            todo.extend(graph.ops[i].inputs)
    return out
