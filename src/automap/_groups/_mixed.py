"""ZeRO-1/2 of a mixed-precision step as DeepSpeed runs it: the data axis gathers the
compute-dtype copy of a parameter, not its float32 master (`Plan.zero_gather`).

A mixed-precision step reads its float32 parameters through casts to a 16-bit compute
dtype. ZeRO-1/2 that keeps the masters whole gathers the new float32 parameters after the
update on shards (4 bytes an element); DeepSpeed keeps the master on the shards and
gathers the 16-bit copy the model computes with (2 bytes). In one jitted step the same
collective sits at the start: a parameter read only through such casts (`narrow_params`)
enters and leaves the step on its data shard, like its optimizer state, and each of its
casts is made on the shard, then gathered whole (`cast_shards`: the runtime pins the
cast to the shard first, or XLA gathers the float32 parameter and casts after). A
parameter read through several casts to one dtype (a tied embedding: the lookup's and
the head's) is cast and gathered once: the later casts read the first's gathered copy
(`repeated_casts`; XLA merges the two casts but not their all-gathers). The cost model
charges one gather per distinct cast at its width and holds the master on shards
(`_cost/_terms.py`); parameters read in their own dtype anywhere are gathered as before.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from .._axes import DATA
from .._graph import Graph, Role
from .._plan import Plan, Spec

#: The cast a mixed-precision step reads its parameters through.
_CAST = "convert_element_type"


def narrow_params(graph: Graph, update: Collection[int]) -> dict[int, tuple[int, ...]]:
    """Per parameter leaf (tensor id) that every op outside the `update` reads through a
    cast to a narrower float (a mixed-precision step's weights; rank >= 1), the casts'
    outputs. Empty for a step that computes in its parameters' dtype."""
    consumers = graph.consumers()
    out: dict[int, tuple[int, ...]] = {}
    for leaf in graph.leaves(Role.PARAM):
        x = graph.tensors[leaf.tensor]
        readers = [graph.ops[c] for c in consumers[leaf.tensor] if c not in update]
        casts = tuple(op.outputs[0] for op in readers if op.primitive == _CAST)
        narrow = all(
            graph.tensors[c].dtype.startswith(("float", "bfloat"))
            and graph.tensors[c].itemsize < x.itemsize
            for c in casts
        )
        if x.ndim and readers and len(casts) == len(readers) and narrow:
            out[leaf.tensor] = casts
    return out


def distinct_casts(graph: Graph, casts: Sequence[int]) -> tuple[int, ...]:
    """Of a parameter's `casts` (`narrow_params`), the first to each dtype: the copies
    ZeRO-1/2 gathers (the others read them, `repeated_casts`)."""
    first: dict[str, int] = {}
    for c in casts:
        first.setdefault(graph.tensors[c].dtype, c)
    return tuple(first.values())


def repeated_casts(graph: Graph, update: Collection[int]) -> dict[int, int]:
    """Per cast of a `narrow_params` parameter that another cast to the same dtype comes
    before, that first cast: the runtime reads its gathered copy in place of gathering
    the same bytes again (and `Tables.masters` prices one gather)."""
    out: dict[int, int] = {}
    for casts in narrow_params(graph, update).values():
        first = {graph.tensors[c].dtype: c for c in distinct_casts(graph, casts)}
        out.update((c, first[graph.tensors[c].dtype]) for c in casts if c not in first.values())
    return out


def gathers_compute(zero_stage: int, mesh: Mapping[str, int], zero_gather: str) -> bool:
    """Whether a plan of this ZeRO stage and mesh gathers compute-dtype copies: ZeRO-1/2
    over a data axis of 2 or more, with `Plan.zero_gather` "compute"."""
    return zero_gather == "compute" and zero_stage in (1, 2) and mesh.get(DATA, 1) > 1


def cast_shards(graph: Graph, plan: Plan, update: Collection[int]) -> dict[int, Spec]:
    """Per cast tensor the plan gathers (`narrow_params`), the shard layout it is made in
    before its gather: its parameter's input spec, which carries the data axis; one cast
    per dtype (`distinct_casts`: the others read it). Empty unless the plan gathers
    compute-dtype copies."""
    if not gathers_compute(plan.zero_stage, plan.mesh, plan.zero_gather):
        return {}
    path = {leaf.tensor: leaf.path for leaf in graph.leaves(Role.PARAM)}
    out: dict[int, Spec] = {}
    for t, casts in narrow_params(graph, update).items():
        spec = plan.specs.get(path[t])
        if spec is not None and spec != plan.constraints.get(casts[0], spec):
            out.update((c, spec) for c in distinct_casts(graph, casts))
    return out
