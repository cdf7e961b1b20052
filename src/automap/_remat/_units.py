"""The units full recomputation keeps one input of: the program's repeating unit (a
transformer layer: its attention block and its MLP block), found from its structure.

The pipeline's cut candidates (`_pipeline.cut_candidates`: where the crossing activation
is the residual stream) split a transformer's forward into blocks, an attention half and
an MLP half a layer. Recomputing each block from its own input keeps two residual-stream
tensors a layer, twice what Megatron keeps; so the blocks are grouped by the period of
their op signatures (primitive and output shapes, never names): the smallest p for which
block i and block i + p look alike wherever neither is the first or the last block (the
first carries the embedding's tail, the last the head's start). The grouping phase is the
one giving the fewest units (one input kept each). Blocks with no period (a lone layer, a
program that does not repeat) stay units of one block.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from .._capture import loss_boundary
from .._graph import Graph
from .._groups import Groups
from .._pipeline import cut_candidates, forward_ops


def block_ops(graph: Graph, groups: Groups) -> tuple[tuple[int, ...], ...]:
    """Per-microbatch forward ops between consecutive cut candidates, one tuple a block.
    None for a step without a loss (no forward pass to recompute): an empty tuple."""
    if loss_boundary(graph) is None:
        return ()
    fwd = forward_ops(graph, groups)
    cuts = cut_candidates(graph, groups)
    at = [bisect.bisect_left(fwd, c) for c in cuts]  # fwd is ascending
    blocks = [fwd[a:b] for a, b in itertools.pairwise(at)]
    # The last block's backward comes right after its forward: recomputing it would only
    # add work, its residuals are alive at the turn of the step either way.
    return tuple(block for block in blocks[:-1] if block)


def layer_ops(graph: Graph, groups: Groups) -> tuple[tuple[int, ...], ...]:
    """The recompute units: `block_ops` grouped into the program's repeating unit."""
    return repeating_units(graph, block_ops(graph, groups))


def layer_spans(graph: Graph, groups: Groups) -> tuple[tuple[int, int], ...]:
    """Each layer's first and last forward op: a pipeline stage starting between them cuts
    the layer (`_policy.split_at_stages`)."""
    return tuple((u[0], u[-1]) for u in layer_ops(graph, groups))


def repeating_units(graph: Graph, blocks: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """`blocks` grouped p at a time (p: `period`), in the phase giving the fewest units."""
    p = period([_signature(graph, b) for b in blocks])
    n = len(blocks)
    best: list[tuple[int, ...]] = [tuple(b) for b in blocks]
    for r in range(p):
        starts = sorted({0, *range(r, n, p)})
        units = [
            tuple(i for b in blocks[a:z] for i in b) for a, z in itertools.pairwise([*starts, n])
        ]
        if len(units) < len(best):
            best = units
    return tuple(best)


def period(signatures: Sequence[object]) -> int:
    """The smallest p at which the signatures repeat (1 where none does): every pair
    (i, i + p) alike except those with the first or the last, and one pair at least."""
    n = len(signatures)
    for p in range(1, n // 2 + 1):
        pairs = [(i, i + p) for i in range(n - p)]
        alike = [signatures[i] == signatures[j] for i, j in pairs]
        edge = [i == 0 or j == n - 1 for i, j in pairs]
        if any(alike) and all(a or e for a, e in zip(alike, edge, strict=True)):
            return p
    return 1


def _signature(graph: Graph, block: Sequence[int]) -> tuple:
    return tuple(
        (graph.ops[i].primitive, tuple(graph.tensors[t].shape for t in graph.ops[i].outputs))
        for i in block
    )
