"""ZeRO-3 as FSDP runs it: each layer's parameters gathered just before the layer, used,
and dead after it; gathered again for the layer's backward (and its recomputation).

XLA alone does not do this: its SPMD partitioner gathers a sharded parameter where an op
needs it whole, and its scheduler then hoists every gather, which depends only on the
step's arguments, to the start of the program (read in the CPU's scheduled HLO of a
4-layer GPT: all 101 gathers before the first layer, every parameter whole at once, and
under remat the forward's copies kept for the recompute). The runtime
(`_run/_fsdp.py`) therefore ties each layer's gathers to an activation: the sharded
parameter is selected on a value the previous layer reads, so the gather can start no
sooner than that layer does (the next layer's gather overlaps this layer's compute, as
DeepSpeed's and PyTorch's prefetch does; at most two layers' copies alive at once).

A layer here is the run of forward ops between two consecutive pipeline cut candidates
(`_pipeline.cut_candidates`, as remat finds its layers), the ops before the first
candidate (the embedding) and after the last (the head, the loss) layers too. A value made
from parameters alone (a weight's cast to the compute dtype: `_groups.Regather.remake`) is
made again in each layer that reads it, from that layer's gathered parameter.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools

from .._graph import Graph, Role, TensorKind
from .._groups import Groups, Regather, regather_plan, zero_region
from .._pipeline import cut_candidates


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One backward layer's gradients reduce-scattered before the next layer runs."""

    # the next layer's first backward op reading a floating value the backward made: its
    # such inputs wait for the reduction (and with them the rest of the backward)
    at: int
    # the sharded tensors they wait for: the ends, made before `at` (and after the previous
    # reduction's), of the gradients' update ops (a transpose, a cast): these meet the ZeRO
    # layout, so the gradients' reduce-scatters lie before them
    tied: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LayerGathers:
    """Where ZeRO-3's layer-by-layer gathers go in one program."""

    regather: Regather  # the backward's reads served by a second gather
    cuts: tuple[int, ...]  # the layers' first ops (cut candidates), ascending
    lazy: frozenset[int]  # parameters and `regather.remake`'s results: read through a gather
    remake: frozenset[int]  # `regather.remake`: run where a layer reads their results
    # per layer: the activation whose arrival lets its gathers start (the previous layer's
    # input), None where there is none (the first two layers: their gathers go first)
    anchor: tuple[int | None, ...]
    # ZeRO-3's gradients reduced layer by layer, in program order; those made after the
    # last `Reduction.after` are reduced at the end, with the update
    reductions: tuple[Reduction, ...] = ()

    @functools.cached_property
    def _reduction_ops(self) -> list[int]:
        return [r.at for r in self.reductions]

    def reduction(self, op: int) -> Reduction | None:
        """The reduction due before op `op`, None where there is none."""
        k = bisect.bisect_left(self._reduction_ops, op)
        hit = k < len(self.reductions) and self.reductions[k].at == op
        return self.reductions[k] if hit else None

    def reduced_at(self, op: int) -> int | None:
        """The op before which a gradient made by `op` is reduced (None: at the end)."""
        k = bisect.bisect_right(self._reduction_ops, op)
        return self.reductions[k].at if k < len(self.reductions) else None

    def layer(self, op: int) -> int:
        """The layer of a forward op (0: before the first cut candidate)."""
        return bisect.bisect_right(self.cuts, op)

    @property
    def n_layers(self) -> int:
        return len(self.cuts) + 1


def layer_gathers(graph: Graph, groups: Groups) -> LayerGathers:
    """The layers of `graph`'s forward and what gathers each (`LayerGathers`)."""
    return graph.recall(
        "layer_gathers", groups, None, lambda: _layer_gathers(graph, groups), keep=1
    )


def _layer_gathers(graph: Graph, groups: Groups) -> LayerGathers:
    rg = regather_plan(graph, groups)
    cuts = tuple(c for c in cut_candidates(graph, groups) if c <= rg.boundary)
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}
    remade = {t for i in rg.remake for t in graph.ops[i].outputs}
    lazy = frozenset(params | remade)
    inputs = _layer_inputs(graph, cuts, lazy, rg.boundary)
    anchor = (None, *inputs[:-1])
    lg = LayerGathers(rg, cuts, lazy, frozenset(rg.remake), anchor)
    return dataclasses.replace(lg, reductions=_reductions(graph, groups, lg))


def _reductions(graph: Graph, groups: Groups, lg: LayerGathers) -> tuple[Reduction, ...]:
    """Where each backward layer's gradients are reduced (`Reduction`). A backward layer
    starts at the first backward op reading a parameter (or its cast) that a forward layer
    reads: the backward runs the layers in reverse, so those starts, sorted, cut it into
    layers (two forward layers starting at one op, a tied embedding read by the head, make
    one)."""
    rg = lg.regather
    read_by: dict[int, set[int]] = {}
    for op in graph.ops[: rg.boundary + 1]:
        if op.index not in lg.remake:
            for t in set(op.inputs) & lg.lazy:
                read_by.setdefault(t, set()).add(lg.layer(op.index))
    backward = sorted(rg.backward)
    first: dict[int, int] = {}
    for i in backward:
        for t in set(graph.ops[i].inputs) & lg.lazy:
            for layer in read_by.get(t, ()):
                first.setdefault(layer, i)
    _, update = zero_region(graph, groups)
    consumers = graph.consumers()
    out: list[Reduction] = []
    done = 0  # update ops before this are tied already
    updates = sorted(update)
    for after in sorted(set(first.values())):
        at = _first_backward_reader(graph, rg.boundary, backward, lg.lazy, after)
        if at is None or (out and out[-1].at == at):
            continue
        ends = [
            t
            for u in updates[bisect.bisect_left(updates, done) : bisect.bisect_left(updates, at)]
            for t in graph.ops[u].outputs
            if graph.tensors[t].ndim
            and graph.tensors[t].dtype.startswith(("float", "bfloat"))
            and not any(c in update and c < at for c in consumers[t])
        ]
        if ends:
            out.append(Reduction(at, tuple(ends)))
            done = at
    return tuple(out)


def _first_backward_reader(
    graph: Graph, boundary: int, backward: list[int], lazy: frozenset[int], start: int
) -> int | None:
    """The first of the `backward` ops (sorted) from `start` on that reads a floating value
    the backward made (not a parameter's), None where there is none."""
    for i in backward[bisect.bisect_left(backward, start) :]:
        for t in graph.ops[i].inputs:
            x = graph.tensors[t]
            if (
                t not in lazy
                and x.producer is not None
                and x.producer > boundary
                and x.dtype.startswith(("float", "bfloat"))
                and x.size
            ):
                return i
    return None


def _layer_inputs(
    graph: Graph, cuts: tuple[int, ...], lazy: frozenset[int], boundary: int
) -> list[int | None]:
    """Per layer, the first floating activation it reads that an earlier op made (the
    residual stream, for a transformer's block), None where it reads none (the embedding,
    which reads integer tokens)."""
    bounds = [0, *cuts, boundary + 1]
    out: list[int | None] = []
    for start, stop in itertools.pairwise(bounds):
        found = None
        for op in graph.ops[start:stop]:
            for t in op.inputs:
                x = graph.tensors[t]
                if (
                    t not in lazy
                    and x.kind is TensorKind.INTERMEDIATE
                    and x.producer is not None
                    and x.producer < start
                    and x.dtype.startswith(("float", "bfloat"))
                ):
                    found = t
                    break
            if found is not None:
                break
        out.append(found)
    return out
