"""The step's outputs XLA holds as buffers of their own: those no donated input becomes.

A step jitted with `donate_argnums` hands XLA its old parameters and optimizer state, and
JAX aliases each donated input to an output of the same shape and dtype, the first one
not yet taken in output order (then, for inputs still unmatched, to one of the same size:
`jax._src.interpreters.mlir._set_up_aliases`); XLA writes that output over the input, so
the update runs in place. Every other output is a buffer of its own, made by the op that
makes it and alive to the end of the program, beside the arguments: a step that donates
nothing holds its old and its new state at the update (read in XLA's buffer assignment of
programs compiled for A100s: a data-parallel BERT that donates nothing peaks at its
update, the reduced gradients and every new parameter and moment beside the old ones;
priced in place it was 0.75x XLA's figure).

An output that is an input returned as it is, or a constant, is made by no op: JAX hands
back the input's buffer, and it is not counted here.

Per device an output is as the plan splits it, and as ZeRO shards the state it is the new
value of (`_groups.state_inputs`): a new moment over the data axis from stage 1, a new
parameter from stage 3 (ZeRO-1/2 gather the new parameters whole after the update)."""

from __future__ import annotations

import collections
from collections.abc import Collection

import numpy as np

from .._graph import Graph, Role
from .._groups import state_inputs
from ._liveness import NO_BLOCKS, Buffers

#: Rows of `output_coef` and of `Moments.outputs`: what ZeRO does to each. NEW_MASTERS:
#: the new parameters whose float32 masters ZeRO-1/2 may keep on shards (`Tables.masters`).
NEW_PARAMS, NEW_OPT_STATE, OTHER_OUTPUTS, NEW_MASTERS = range(4)
_ROW = {Role.PARAM: NEW_PARAMS, Role.OPT_STATE: NEW_OPT_STATE}


def aliased_outputs(graph: Graph) -> set[int]:
    """Positions in `graph.outputs` that a donated input becomes (JAX's matching: by shape
    and dtype, in order; then by size)."""
    donated = [graph.tensors[leaf.tensor] for leaf in graph.inputs if leaf.donated]
    outs = [graph.tensors[leaf.tensor] for leaf in graph.outputs]
    taken: set[int] = set()
    for key in (lambda t: (t.shape, t.dtype), lambda t: (t.size, t.itemsize)):
        free = collections.defaultdict(collections.deque)
        for i, t in enumerate(outs):
            if i not in taken:
                free[key(t)].append(i)
        left = []
        for t in donated:
            if free[key(t)]:
                taken.add(free[key(t)].popleft())
            else:
                left.append(t)
        donated = left
    return taken


def held_outputs(graph: Graph, masters: Collection[int] = ()) -> tuple[Buffers, ...]:
    """The outputs held apart from the arguments, as buffers from the op that makes each to
    the program's last op: (new parameters, new optimizer state, other outputs, new
    parameters of the `masters`)."""
    aliased = aliased_outputs(graph)
    state = state_inputs(graph)
    last = len(graph.ops) - 1
    rows: list[list[int]] = [[], [], [], []]
    seen: set[int] = set()
    for i, leaf in enumerate(graph.outputs):
        t = graph.tensors[leaf.tensor]
        if i in aliased or t.producer is None or t.id in seen or not t.nbytes:
            continue
        seen.add(t.id)
        same = state.get(leaf.path)
        row = _ROW.get(same.role, OTHER_OUTPUTS) if same else OTHER_OUTPUTS
        rows[NEW_MASTERS if same and same.tensor in masters else row].append(t.id)
    return tuple(
        Buffers(
            tensor=np.array(ts, dtype=np.int64),
            birth=np.array([graph.tensors[t].producer for t in ts], dtype=np.int64),
            death=np.full(len(ts), last, dtype=np.int64),
            width=np.ones(len(ts)),
            blocks=NO_BLOCKS,
        )
        for ts in rows
    )


def output_coef(
    held: tuple[Buffers, ...], nbytes: np.ndarray, tensor_set, n_sets: int, before=None
):
    """[4, n_sets] bytes of the held outputs by group set, a row per `held` kind; with
    `before` (op indices: the update's), only those made by an op not in it (a loss, a
    BatchNorm's statistics), alive already when the gradients are reduced."""
    rows = []
    for b in held:
        keep = np.ones(len(b.tensor), bool) if before is None else ~np.isin(b.birth, before)
        t = b.tensor[keep]
        rows.append(np.bincount(tensor_set[t], nbytes[t], minlength=n_sets))
    return np.stack(rows)


def held_bytes(
    coef: np.ndarray,
    inv: np.ndarray,
    zinv: np.ndarray | None,
    zero_stage: int,
    sharded_masters: bool = False,
):
    """Bytes per device of the held outputs under a plan (`coef`: [4, ..., n_sets], as
    `output_coef` or `Moments.outputs`; `inv` per set, `zinv` the same also divided by
    the data axis where ZeRO shards, None without ZeRO): a number, or one per moment.
    `sharded_masters`: ZeRO-1/2 keeps the masters on shards (`_terms.Layout`)."""
    zeroed = None if zinv is None else coef @ zinv
    return held_by_kind(coef @ inv, zeroed, zero_stage, sharded_masters)


def held_by_kind(
    plain: np.ndarray, zeroed: np.ndarray | None, zero_stage: int, sharded_masters: bool = False
):
    """The held outputs' bytes from their kinds' (`plain`: [4, ...] as the plan splits
    them; `zeroed`: the same also divided by the data axis, None without ZeRO): ZeRO
    shards a new moment from stage 1, a new parameter from stage 3, a new master from
    stage 1 where it keeps the masters on shards, else from stage 3."""
    on = zeroed is not None
    params = zeroed[NEW_PARAMS] if on and zero_stage >= 3 else plain[NEW_PARAMS]
    state = zeroed[NEW_OPT_STATE] if on and zero_stage >= 1 else plain[NEW_OPT_STATE]
    sharded = on and (zero_stage >= 3 or (zero_stage >= 1 and sharded_masters))
    masters = zeroed[NEW_MASTERS] if sharded else plain[NEW_MASTERS]
    return params + state + plain[OTHER_OUTPUTS] + masters
