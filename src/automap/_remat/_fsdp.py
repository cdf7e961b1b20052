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
import itertools

from .._graph import Graph, Role, TensorKind
from .._groups import Groups, Regather, regather_plan
from .._pipeline import cut_candidates


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

    def layer(self, op: int) -> int:
        """The layer of a forward op (0: before the first cut candidate)."""
        return bisect.bisect_right(self.cuts, op)

    @property
    def n_layers(self) -> int:
        return len(self.cuts) + 1


def layer_gathers(graph: Graph, groups: Groups) -> LayerGathers:
    """The layers of `graph`'s forward and what gathers each (`LayerGathers`)."""
    rg = regather_plan(graph, groups)
    cuts = tuple(c for c in cut_candidates(graph, groups) if c <= rg.boundary)
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}
    remade = {t for i in rg.remake for t in graph.ops[i].outputs}
    lazy = frozenset(params | remade)
    inputs = _layer_inputs(graph, cuts, lazy, rg.boundary)
    anchor = (None, *inputs[:-1])
    return LayerGathers(rg, cuts, lazy, frozenset(rg.remake), anchor)


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
