"""Per-device size of every tensor under a pipeline stage's intra-stage plan: what the
stage's memory (`_traffic.py`), its sends (`_sends.py`) and its ZeRO collectives
(`_zero.py`) read each tensor's bytes by."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from .._graph import Graph


@dataclasses.dataclass(frozen=True, eq=False)
class Layouts:
    """Per-device size of every tensor under an intra-stage plan."""

    inv: np.ndarray  # [n_tensors] 1 / sharding divisor of the tensor's layout
    on_data: np.ndarray  # [n_tensors] the layout already splits it on the data axis
    data_size: int  # size of the data axis (1 without one): what ZeRO shards over


def stage_layouts(
    graph: Graph, tensor_groups, codes: np.ndarray, mesh: Mapping[str, int], data_axis
):
    """Layouts from axis codes per group (1-based in mesh order, 0: none), as `CostModel`
    reads an assignment: a tensor split on several groups' axes is divided by each
    distinct axis once."""
    sizes = [1, *mesh.values()]
    d = list(mesh).index(data_axis) + 1 if data_axis in mesh else 0
    # Each tensor's axis per dim, padded with "none" (code 0) past its rank: the stage DP
    # asks for every point it prices, and a loop over the tensors took a tenth of it.
    axes = np.append(np.asarray(codes, dtype=np.int64), 0)[_group_table(graph, tensor_groups)]
    split = np.ones(len(graph.tensors))  # a product of whole numbers: exact
    for a in range(1, len(sizes)):
        split[(axes == a).any(axis=1)] *= sizes[a]
    inv = 1.0 / split
    on_data = (axes == d).any(axis=1) if d else np.zeros(len(graph.tensors), dtype=bool)
    return Layouts(inv, on_data, int(sizes[d]) if d else 1)


def _group_table(graph: Graph, tensor_groups) -> np.ndarray:
    """[n_tensors, most dims] the group of each tensor's dims, padded with -1 (which
    `stage_layouts` reads as a group with no axis); made once per graph and groups."""
    held = graph.memo.get("group_table")
    if held is None or held[0] is not tensor_groups:
        width = max((len(tg) for tg in tensor_groups), default=0)
        table = np.full((len(tensor_groups), max(width, 1)), -1, dtype=np.int64)
        for t, tg in enumerate(tensor_groups):
            table[t, : len(tg)] = tg
        held = graph.memo["group_table"] = (tensor_groups, table)
    return held[1]
