"""The layout a value made from constants leaves its pipeline program in when another
program reads it.

A pipeline stage runs its forward and its backward as programs of their own, so a value
one reads from the other is an output of the first program. Where the plan does not pin
that output, XLA lays it out as its sharding propagation finds it. A broadcast of a
constant has nothing to propagate from, so it leaves replicated: every device holds the
whole batch's copy. One case read in a dump: a Llama pipeline on a v5p slice, cut inside
a layer. Its stage 0 backward read layer 1's causal mask, broadcast to [batch, heads, q,
k], as pred[512, 2, 4, 128, 128]: 64 MiB a chip. The plan splits that batch over data 16,
and the cost model prices 4 MiB. So a value made from constants alone leaves a forward
program in the plan's layout of it, the layout `_cost/_stage_layouts.stage_layouts` prices.
Other values keep the layout XLA's propagation gives them. Pinned as well, a sequence-
parallel GPT's backward gathered a small value again that its forward had left whole.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._errors import ApplyError
from .._graph import Graph
from ._accumulate import axes_entry
from ._recompute import literal_made
from ._shared import check_divisible


def handed_shardings(
    graph: Graph,
    outputs: Iterable[int],
    layout: Callable[[int], tuple] | None,
    mesh: Mesh,
    stage_mesh: Mapping[str, int],
    pinned: Collection[int],
) -> dict[int, NamedSharding]:
    """Per output of a program (`outputs`, of `graph` at the program's shapes) made from
    literals alone (`_recompute.literal_made`), its sharding on the stage's `mesh` by the
    plan's layout (`layout`: `_recompute.plan_layout`; None for a plan with no
    assignment, which pins nothing). Left out: what the program pins already (`pinned`),
    and a value whose shape the plan's layout does not divide (XLA lays it out)."""
    if layout is None:
        return {}
    literal = literal_made(graph)
    out: dict[int, NamedSharding] = {}
    for t in outputs:
        if t in pinned or t not in literal:
            continue
        spec = tuple(axes_entry(axes) if axes else None for axes in layout(t))
        try:
            check_divisible(f"tensor {t}", tuple(graph.tensors[t].shape), spec, stage_mesh)
        except ApplyError:
            continue
        out[t] = NamedSharding(mesh, PartitionSpec(*spec))
    return out
