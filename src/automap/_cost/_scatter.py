"""Which ZeRO gradients XLA's TPU compiler can reduce-scatter: by the layout of the buffer
the backward's matmul writes each one in.

A weight's gradient is a dot_general's output, in the order the transpose rule writes it:
the weight's own ([hidden, out]: the query and gate kernels of a Llama) or transposed
([out, hidden], transposed back after: its key, value, up, down and head kernels). XLA
lays that buffer as it pads least (`_tiles.py`: row-major, its last dim on the lanes,
unless the transposed layout pads less) and reduce-scatters the gradient over data only
where ZeRO's split dim is the major one of that layout, or the minor one (the lanes)
with a whole multiple of `_tiles.LANE_BYTES` in each shard's row (bf16 shards of 256 or
768 lanes scattered, of 384 not: a down kernel's [512, 1536] gradient split 4 ways on its
ffn dim, llama plan 1 of the TPU bench); the rest it all-reduces
whole, in the step's combined all-reduce, and slices. Read with
libtpu 0.0.42.1 on v5p 2x2x2, a bfloat16 1-layer Llama (hidden 512, ffn 1792) at data 4
x model 2 under ZeRO-1: the query's bf16[512, 256] and the gate's [512, 896] gradients
reduce-scattered, the transposed [256, 512] and [896, 512] ones (shards [256, 128] and
[896, 128], laid {1,0}) all-reduced whole; at hidden 256 the transposed shards [128, 64]
are laid {0,1}, the split major, and every one is reduce-scattered; at ffn 128 the
gate's [512, 64] gradient (shard [128, 64], laid {0,1}) is all-reduced whole; the same
step in float32 (f32 [256, 128] shards) and at hidden 1024 (bf16 [512, 256]) reduce-scatters
its transposed gradients, as a float32 GPT's [1024, 256] MLP one at data 4 (shard [256,
256] laid {0,1}). The rule
of `_tiles.tpu_zero_scatter` (`Lowering.scatter_least_elements`, `_tiles.minor_split`)
reads these orders. A lookup's gradient (a scatter-add into the table, in its order) is
laid alike: the embedding's bf16[512, 512] shard of [1024, 512] at model 2, ZeRO's split
on its hidden (minor) dim, all-reduced whole there.
"""

from __future__ import annotations

import numpy as np

from .._graph import Graph, Role
from .._groups import Groups, union_find, update_region
from .._remat import layer_gathers

SCATTERS = frozenset({"scatter-add", "scatter_add"})  # a lookup's gradient


def gradient_orders(graph: Graph, groups: Groups, width: int) -> tuple[np.ndarray, ...]:
    """Per tensor, for each dim of the buffer the backward writes its gradient in (a
    dot_general's output; a lookup's scatter-add, in the table's order), the tensor's own
    dim it is ([T, width], -1 past the rank and for every tensor without one: not a
    parameter, or its dims not found by group), and that buffer's itemsize ([T], 0 for
    none), and whether a lookup's scatter-add makes it ([T]); and how many of its
    gradient's parts dot_generals write, and how many other ops ([T] each: a tied
    table's lookup and head, one each)."""
    perm = np.full((len(graph.tensors), width), -1, dtype=np.int64)
    itemsize = np.zeros(len(graph.tensors), dtype=np.int64)
    lookup = np.zeros(len(graph.tensors), dtype=bool)
    parts = np.zeros((2, len(graph.tensors)), dtype=np.int64)
    gradients, update = update_region(graph, groups)
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}
    consumers = graph.consumers()
    for g in gradients:
        x = graph.tensors[g]
        p = _parameter_of(graph, g, update, params, consumers)
        if p is None:
            continue
        parts[int(graph.ops[x.producer].primitive != "dot_general"), p] += 1
        own = list(groups.tensor_groups[p][: graph.tensors[p].ndim])
        made = list(groups.tensor_groups[g][: x.ndim])
        if sorted(own) != sorted(made) or len(set(own)) != len(own):
            continue  # its dims not told apart by their groups
        perm[p, : x.ndim] = [own.index(gid) for gid in made]
        itemsize[p] = x.itemsize
        lookup[p] = graph.ops[x.producer].primitive in SCATTERS
    return perm, itemsize, lookup, parts[0], parts[1]


def _parameter_of(graph: Graph, g: int, update, params, consumers) -> int | None:
    """The parameter whose gradient `g` is: the first one read by an update op that a
    chain of update ops keeping `g`'s elements reaches (none through a reduction, say a
    global norm's, which would reach every parameter)."""
    size = graph.tensors[g].size
    seen, frontier = {g}, [g]
    while frontier:
        t = frontier.pop(0)
        for i in sorted(consumers[t]):
            if i not in update:
                continue
            op = graph.ops[i]
            found = [u for u in op.inputs if u in params and graph.tensors[u].size == size]
            if found:
                return found[0]
            for u in op.outputs:
                if graph.tensors[u].size == size and u not in seen:
                    seen.add(u)
                    frontier.append(u)
    return None


def tied_runs(graph: Graph, groups: Groups) -> tuple[np.ndarray, np.ndarray]:
    """Per parameter, the run of ZeRO-3 gradients whose buffers XLA's TPU lays alike, -1
    for none, and its place in the runs' order ([T] each, -1 for none).

    Under ZeRO-3 the runtime makes each backward layer's inputs wait for its sharded
    gradients (`_run._fsdp._after_shards`): each device reads the first element of each
    shard and ANDs the tests. XLA moves the reshapes to scalars past the ANDs, so the
    [1, 1] slices of the matrices at the head of one tie's list (up to its first gradient
    of another rank) are one elementwise chain, and a slice keeps its operand's layout:
    those gradients, in the parameter's order, are laid all row-major or all transposed.
    A parameter whose gradient ends in two ties (its bf16 transpose in one, its float32
    cast in the next) joins their runs. Read in the layout assignment of libtpu 0.0.42.1
    (a bf16 Llama, ZeRO-3, v5p): `_tiles.minor_split` says which layout a run takes."""
    n = len(graph.tensors)
    run, place = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    _, update = update_region(graph, groups)
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}
    consumers = graph.consumers()
    ties: list[tuple[int, int]] = []  # a run's members, each tied to its first
    at = 0
    for reduction in layer_gathers(graph, groups).reductions:
        ends = [t for t in reduction.tied if graph.tensors[t].ndim and graph.tensors[t].size]
        head = []
        for t in ends:
            if graph.tensors[t].ndim != 2:
                break  # a gradient of another rank ends the chain
            head.append(t)
        owners = [_parameter_of(graph, t, update, params, consumers) for t in head]
        owners = [p for p in owners if p is not None]
        if len(head) < 2 or len(owners) < 2:
            continue
        for p in owners:
            ties.append((p, owners[0]))
            run[p], place[p] = 0, at
            at += 1
    joined = run >= 0
    find = union_find(n, ties)
    run[joined] = [find(int(p)) for p in np.nonzero(joined)[0]]
    return run, place
