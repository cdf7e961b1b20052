"""The tables' ZeRO terms: which ops ZeRO's layout makes run on a device's data shard, and
the bytes ZeRO-3's gather of each parameter moves.

Under ZeRO a gradient is made where it meets its sharded optimizer state, and the update
runs on the shard (`_groups.zero_region`): those ops' compute is divided over the data
axis (`zero_shares`) unless their iteration space is split over it already. ZeRO-3 gathers
each parameter where an op needs it whole, at the width XLA gathers it (`gathered_bytes`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from .._graph import Graph, Role

if TYPE_CHECKING:
    from ._tables import Tables


def zero_ops(graph: Graph, pinned: Collection[int], update: Collection[int]) -> np.ndarray:
    """[n_ops] whether ZeRO's layout pins each op's result (`Tables.zero_op`): the makers
    of the `pinned` tensors (gradients made where they meet their shard) and the `update`
    ops (`_groups.zero_region` gives both)."""
    zero_op = np.zeros(len(graph.ops), dtype=bool)
    zero_op[[graph.tensors[t].producer for t in pinned]] = True
    zero_op[sorted(update)] = True
    return zero_op


def zero_shares(T: Tables, P: np.ndarray, d: int, size: float) -> np.ndarray:
    """[n_ops] the share of its work each op runs on a device under ZeRO over the mesh
    axis of code `d` and size `size` (`P`: per set, its axes): 1 / size for an op ZeRO
    pins (`Tables.zero_op`) whose iteration space is not already split over that axis,
    else 1."""
    return shares(T.zero_op, T.op_set, P, d, size)


def shares(pinned: np.ndarray, sets: np.ndarray, P: np.ndarray, d: int, size: float):
    """`zero_shares` of any entries: `pinned` and `sets`, per entry (a loop body op's too)."""
    return np.where(pinned & ~P[sets, d], 1.0 / size, 1.0)


def gathered_bytes(graph: Graph, consumers, update: Collection[int], wide: int) -> dict[int, float]:
    """Per parameter leaf, the bytes ZeRO-3's gather of it moves (whole). XLA gathers a
    sharded parameter where an op needs it whole, after the elementwise ops that keep its
    sharding: where every reader outside the `update` casts it to a narrower float (a
    mixed-precision step's weights), it gathers the cast. Read in the programs compiled
    for A100s: a bf16 gather, half the float32 parameter's bytes (XLA's CPU widens a
    16-bit collective to `wide` bytes an element: `Lowering.collective_float_bytes`)."""
    out = {}
    for leaf in graph.leaves(Role.PARAM):
        x = graph.tensors[leaf.tensor]
        readers = [graph.ops[c] for c in consumers[leaf.tensor] if c not in update]
        casts = [
            graph.tensors[op.outputs[0]]
            for op in readers
            if op.primitive == "convert_element_type"
            and graph.tensors[op.outputs[0]].dtype.startswith(("float", "bfloat"))
        ]
        narrow = readers and len(casts) == len(readers)
        per_element = (
            min(x.itemsize, max(max(c.itemsize for c in casts), wide)) if narrow else x.itemsize
        )
        out[leaf.tensor] = float(x.size * per_element)
    return out
