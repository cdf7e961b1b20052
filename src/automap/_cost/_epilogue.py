"""A matmul's elementwise epilogue: the matmul outputs XLA's TPU never writes, per plan.

XLA's TPU fuses the elementwise ops that alone read a matmul's output into the matmul's
kernel (an output fusion): the kernel writes what they make, not the matmul's result
(`Lowering.fuses_matmul_epilogues`; `epilogue_rows` marks the buffers it may spare,
for `_buffers.step_buffers`). Where a mesh axis splits the matmul's contraction, each device's kernel makes a
partial sum, which must be reduced before any reader sees it: that one is written. Which
contractions a plan splits is its layout's, not the graph's, so the buffers are tabled
apart from the step's moments (as `_buffers.split_operands` are) and taken out per plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .._graph import Graph
from .._groups import ELEMENTWISE
from ._kernel import split_reductions
from ._liveness import Buffers
from ._rows import CandidateRow, RowTable, row_table


def epilogue_rows(graph: Graph, consumers, boundary: int, spans, serves, in_memory) -> np.ndarray:
    """Per buffer (`spans`: tensor, birth and last op of each), whether it is a matmul's
    output that only elementwise ops read, which XLA's TPU computes in the matmul's kernel
    (its output fusion: the kernel writes what those ops make, not the matmul's result)
    where no mesh axis splits the matmul's contraction (`unwritten`). Not a forward buffer
    kept for the backward, nor one stored in place of another residual (`serves`: a
    matmul reads that one through it). Where two matmuls' outputs meet in one elementwise
    chain (SwiGLU's silu(gate) x up), only the later kernel runs it: the earlier output is
    written for it to read.

    Read in the HLO compiled for v5p chips (libtpu 0.0.42.1): a float32 GPT's backward
    runs GELU's derivative times the incoming gradient, its convert to bf16 and the bias
    gradient's sum in the kernel of the matmul that makes that gradient, one a layer
    (gpt plans 1 on 64 and on 256 chips of the TPU bench, with and without remat), and
    never writes that matmul's float32 output; most other matmuls run a bias add and a
    convert so. Held by tests/test_tpu_memory.py."""
    tensor, born, dies = spans
    chains: dict[int, set[int]] = {}  # candidate tensor -> the elementwise ops it feeds
    for t in sorted(set(tensor.tolist())):
        p = graph.tensors[t].producer
        if p is None or graph.ops[p].primitive != "dot_general" or serves.get(t, {t}) != {t}:
            continue
        chain = _chain(graph, consumers, t, in_memory)
        if chain:
            chains[t] = chain
    owner: dict[int, int] = {}  # elementwise op -> the latest candidate whose chain has it
    for t in sorted(chains, key=lambda t: graph.tensors[t].producer):
        for c in chains[t]:
            owner[c] = t
    spared = {t for t, ops in chains.items() if all(owner[c] == t for c in ops)}
    held = (born <= boundary) & (boundary < dies)  # made in the forward, read in the backward
    return np.isin(tensor, list(spared)) & ~held


def _chain(graph: Graph, consumers, t: int, in_memory) -> set[int] | None:
    """The elementwise ops fused downstream of tensor t, up to the tensors written; None
    where one of them makes a value that a kernel of another kind reads unwritten (a
    convert a reduction reads): the matmul's kernel would have to write that value in its
    place, and XLA writes the matmul's output instead."""
    ops: set[int] = set()
    todo = [t]
    while todo:
        for c in consumers[todo.pop()]:
            if graph.ops[c].primitive not in ELEMENTWISE:
                return None
            if c not in ops:
                ops.add(c)
                todo += [o for o in graph.ops[c].outputs if not in_memory[o]]
    return ops


@dataclasses.dataclass(frozen=True)
class Epilogues:
    """The buffers a step's matmuls may spare (one column each), at the step's moments."""

    live: np.ndarray  # [moments, c] bytes alive at each moment (unsplit, at the width held)
    sets: np.ndarray  # [c] the tensor set of each
    rows: RowTable | None  # the partial-sum rows of their matmuls (None: no contraction splits)
    owner: np.ndarray  # [rows] the column whose matmul each row is of
    # `live` where the attention cores run as the flash kernel (None where none can)
    flash: np.ndarray | None = None


def epilogues(
    graph: Graph,
    buf: Buffers,
    at: np.ndarray,
    tensor_set: np.ndarray,
    partial: Sequence[CandidateRow],
    n_groups: int,
    empty: int,
    flash: Buffers | None = None,
) -> Epilogues | None:
    """The `Epilogues` of the step whose buffers are `buf` at its candidate moments `at`
    (`Moments.at`); `partial`: the step's partial-sum rows; `flash`: its buffers as the
    flash kernel leaves them, if it may run. None where none may be spared."""
    if buf.epilogue is None or not buf.epilogue.any():
        return None
    idx = np.flatnonzero(buf.epilogue)
    tensor = buf.tensor[idx]
    nbytes = np.array([graph.tensors[t].nbytes for t in tensor.tolist()], dtype=float)
    on = (buf.birth[idx][None, :] <= at[:, None]) & (at[:, None] <= buf.death[idx][None, :])
    by_op: dict[int, list[CandidateRow]] = {}
    for r in partial:
        by_op.setdefault(r.op, []).append(r)
    mine, owner = [], []
    for c, t in enumerate(tensor.tolist()):
        for r in by_op.get(graph.tensors[t].producer, ()):
            mine.append(r)
            owner.append(c)
    return Epilogues(
        live=on * (nbytes * buf.width[idx]),
        flash=None if flash is None else on * (nbytes * flash.width[idx]),
        sets=tensor_set[tensor],
        rows=row_table(mine, n_groups, empty) if mine else None,
        owner=np.array(owner, dtype=np.int64),
    )


def less_unwritten(copied, both, codes: np.ndarray, P: np.ndarray, L):
    """What a plan `L` holds at each moment beside the step's buffers (`copied`, per
    moment, or None) less what its matmuls do not write (`unwritten` of `both`, the
    `Tables.epilogues` pair: without and with remat)."""
    spared = unwritten(both[int(L.remat)], codes, P, L.made_inv, L.flash) if both else None
    if spared is None:
        return copied
    return -spared if copied is None else copied - spared


def unwritten(
    E: Epilogues | None, codes: np.ndarray, P: np.ndarray, made_inv: np.ndarray, flash=False
):
    """[moments] bytes per device of `E`'s buffers the plan does not write: those of the
    matmuls whose contraction no mesh axis splits (`codes`, the axis code of each group;
    `P`, which axes each set is split over: `_kernel.split_reductions`),
    laid as `made_inv` lays each set (`flash`: of the buffers the flash kernel leaves).
    None where there are none."""
    if E is None:
        return None
    live = E.flash if flash and E.flash is not None else E.live
    fused = np.ones(len(E.sets), dtype=bool)
    if E.rows is not None:
        fused[E.owner[split_reductions(E.rows, codes, P)[1].any(axis=1)]] = False
    return live[:, fused] @ made_inv[E.sets[fused]] if fused.any() else None
