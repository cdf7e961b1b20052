"""The buffers of a one-stage step, as XLA's GPU pipeline holds them, for its peak memory.

`_liveness.py` finds the moments a step's buffers peak at; this module says which buffers
there are: each tensor XLA writes to memory (`_fusion.in_memory_tensors`), from its maker
to its last reader, the residuals it stores standing in for those it makes again
(`_residuals.stand_in_map`), a recomputed layer's residuals twice, and the copies XLA
makes that no tensor of the jaxpr shows (a convolution's relaid input, a combined
all-reduce's operands). Each was read in the buffer assignment of compile-only A100s.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from .._capture import Residuals
from .._graph import Graph
from .._groups import ELEMENTWISE
from .._lowering import Lowering
from ._epilogue import epilogue_rows
from ._fusion import FUSIBLE, in_memory_tensors, is_expensive
from ._liveness import Buffers
from ._residuals import MATMULS, barrier_inputs, matmuls_alone, stand_in_map, stored_residuals
from ._rows import CandidateRow, RowTable, row_table


def step_buffers(
    graph: Graph, res: Residuals, consumers, remat: bool, lowering: Lowering
) -> Buffers:
    """The buffers of a one-stage step as XLA's GPU pipeline keeps them (`_liveness.py`):
    what it writes to memory, each from its maker to its last reader; with
    `lowering.remakes_residuals` a stored residual until the last reader of those it
    stands in for (`stored_residuals`), else the jaxpr's residuals. Under `remat`
    a layer's residuals live twice: in the first forward until its last forward reader,
    and again from the backward's first read of any of them (JAX emits a layer's
    recompute as one block before its backward; each layer's first and last forward op and
    that moment are its `blocks`), or from before the kernels that precede that read
    (`_recompute_moment`), and a layer's input its recompute reads is stored itself
    (`_residuals.barrier_inputs`). With the copies of a convolutional net
    (`convolution_copies`), and with `lowering.float32_norm_buffers` the column
    reductions' written operands (`column_operands`) and 16-bit sums held in float32
    (`_kept_wide_sum`)."""
    last = np.array([max(c) if c else -1 for c in consumers], dtype=np.int64)
    birth = np.array([-1 if t.producer is None else t.producer for t in graph.tensors])
    # the backward's first read of each tensor or of one it stands in for
    first = np.array([min((x for x in c if x > res.boundary), default=-1) for c in consumers])

    remade = lowering.remakes_residuals
    layered = {t for ts in res.layer_saved for t in ts} if remat else set()
    unlayered = [t for t in (res.saved_remat if remat else res.saved) if t not in layered]
    # a layer's input, which its recompute reads through the barrier, is stored itself
    barred = barrier_inputs(res, consumers, unlayered) if remat and remade else set()
    once = stand_in_map(graph, consumers, lowering, stored=barred) if remade else lambda r: (r,)
    again = (
        stand_in_map(graph, consumers, lowering, recomputed=True, stored=barred) if remade else once
    )

    serves: dict[int, set[int]] = {}  # stored tensor -> the residuals it is stored for

    def stand_ins(saved: Iterable[int], stored=once) -> set[int]:
        out: set[int] = set()
        for r in saved:
            for t in stored(r):
                out.add(t)
                serves.setdefault(t, set()).add(r)
                last[t] = max(last[t], last[r])
                if first[r] >= 0:
                    first[t] = first[r] if first[t] < 0 else min(first[t], first[r])
        return out

    kept = stand_ins(unlayered)
    recomputed: list[int] = []
    blocks = []
    for ts in res.layer_saved if remat else ():
        mine = sorted(stand_ins(ts, again) - kept)
        reads = first[mine][first[mine] >= 0]
        if len(reads):
            at = _recompute_moment(graph, res.boundary, int(reads.min()), lowering)
            birth[mine] = at
            made = [graph.tensors[t].producer for t in ts]
            blocks.append((min(made), max(made), at))
        recomputed += mine
    if lowering.fuses_matmul_operands:
        # a residual made again in its backward readers (a matmul's operand too, which XLA
        # writes for the forward's matmul) dies at its last forward reader
        for r in set(res.saved) - kept - set(recomputed):
            last[r] = max((c for c in consumers[r] if c <= res.boundary), default=-1)
    in_memory = in_memory_tensors(graph, sorted(kept.union(recomputed)))
    if lowering.float32_norm_buffers and not lowering.native_bf16_arithmetic:
        for t, until, operands in _remade_norm_gradients(graph, consumers, in_memory):
            last[t] = until if t not in serves else last[t]
            last[operands] = np.maximum(last[operands], _last_sum(graph, consumers, t, in_memory))
    outputs = {leaf.tensor for leaf in graph.outputs}
    ids = [
        t.id
        for t in graph.tensors
        if t.producer is not None
        and in_memory[t.id]
        and t.id not in outputs
        and t.nbytes
        and last[t.id] >= 0
    ]
    rows = [(t, birth[t], max(last[t], birth[t])) for t in ids]
    if recomputed:
        # the first forward makes them too, each dead after its last forward reader
        written = in_memory_tensors(graph, sorted(kept))
        for t in recomputed:
            reads = [c for c in consumers[t] if c <= res.boundary]
            if reads and written[t]:
                rows.append((t, graph.tensors[t].producer, max(reads)))
    rows += convolution_copies(graph, consumers)
    if lowering.float32_norm_buffers:
        rows += column_operands(graph, in_memory, _wide_sums(graph, consumers, in_memory, lowering))
    tensor, born, dies = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    # a layer input the recompute reads is held as the 16-bit value the recompute's
    # barrier takes, not as a float32 sum (`_kept_wide_sum`)
    again_ops = set(res.recomputed) if remat else set()
    narrow = {t for t in kept if any(c in again_ops for c in consumers[t])}
    width = np.array(
        [
            _held_wide(graph, consumers, t, lowering, int(t) in narrow)
            * _operand_width(graph, consumers, serves.get(int(t), ()), lowering)
            for t in tensor
        ],
        dtype=float,
    )
    block = np.array(blocks, dtype=np.int64).reshape(-1, 3)
    epilogue = apart = None
    if lowering.fuses_matmul_epilogues:
        spans = (tensor, born, dies)
        epilogue, apart = epilogue_rows(graph, consumers, res.boundary, spans, serves, in_memory)
    return Buffers(
        tensor=tensor,
        birth=born,
        death=dies,
        width=width,
        blocks=block,
        epilogue=epilogue,
        apart=apart,
    )


@dataclasses.dataclass(frozen=True)
class SplitOperands:
    """The float32 operands a plan's split gradient dots hold (`split_operands`), for the
    step's candidate moments: what each holds at each, its tensor set, and the tensor sets
    of the gradients the backward dots that read it write (any of them split keeps it)."""

    live: np.ndarray  # [moments, c] bytes alive (unsplit, at the width held)
    sets: np.ndarray  # [c]
    grads: np.ndarray  # [c, r] padded with -1


def split_operands(
    graph: Graph, res: Residuals, consumers, lowering: Lowering, tensor_set, at: np.ndarray
) -> SplitOperands | None:
    """The residuals a weight-gradient dot holds where XLA splits it beside ZeRO's data
    axis (`_beside.py`), alive at the moments `at` of a step without remat; None where
    the lowering holds none (`Lowering.holds_split_operands`).

    XLA's TPU makes a float32 matmul operand that an elementwise chain writes (a layer
    norm's output, GELU's) again inside each backward matmul that reads it, from what it
    is made of (`_residuals._remade_from`): no buffer holds it past the forward. A split
    dot runs on its piece of the operand, and the chain is not fused into it: the forward
    writes the operand in the width the matmul reads (`_operand_width`: bf16) and holds
    it until the dot (read on compile-only v5p chips: `Lowering.holds_split_operands`)."""
    if not (lowering.fuses_matmul_operands and lowering.holds_split_operands):
        return None
    once = stand_in_map(graph, consumers, lowering) if lowering.remakes_residuals else None
    kept = {t for r in res.saved for t in once(r)} if once else set(res.saved)
    rows = []
    for r in sorted(set(res.saved) - kept):
        x = graph.tensors[r]
        dots = [c for c in consumers[r] if c > res.boundary and graph.ops[c].primitive in MATMULS]
        # (one a reshape makes is read through it from what it reshapes: no buffer)
        made = x.producer is not None and graph.ops[x.producer].primitive in ELEMENTWISE
        if x.dtype == "float32" and made and dots:
            grads = sorted({int(tensor_set[graph.ops[c].outputs[0]]) for c in dots})
            width = _operand_width(graph, consumers, (r,), lowering)
            rows.append((x.nbytes * width, x.producer, max(dots), int(tensor_set[r]), grads))
    if not rows:
        return None
    nbytes, birth, death, sets, grads = zip(*rows, strict=True)
    on = (np.array(birth)[None, :] <= at[:, None]) & (at[:, None] <= np.array(death)[None, :])
    padded = np.full((len(rows), max(map(len, grads))), -1, dtype=np.int64)
    for j, g in enumerate(grads):
        padded[j, : len(g)] = g
    return SplitOperands(on * np.array(nbytes), np.array(sets, dtype=np.int64), padded)


@dataclasses.dataclass(frozen=True)
class CombinedCopies:
    """The partial sums a recomputed layer all-reduces, each at its layer's recompute
    moment (`combined_copies`)."""

    rows: RowTable  # partial-sum rows of recomputed ops (not gradients), one per op
    moment: np.ndarray  # [rows] index into `Moments.at` of the row's layer's recompute


def combined_copies(
    rows: list[CandidateRow], blocks: np.ndarray, at: np.ndarray, pad_group: int, empty_set: int
) -> CombinedCopies | None:
    """A recomputed layer's activation all-reduces (a row-parallel matmul's partial sums)
    depend on the layer's input alone, not on the backward's, and XLA's all-reduce combiner
    joins them with the backward's own: a combined all-reduce first copies its operands into
    one buffer (its result then reuses that buffer, as a lone all-reduce reuses its
    operand's). So at the layer's recompute the step holds its partial sums twice (read in
    the buffer assignment on compile-only A100s: transformer plans under remat with split
    matmuls peaked at that copy, 0.78-0.84x priced without it). `blocks`: per layer, first
    and last forward op and its recompute moment (`Buffers.blocks`), one of `at`."""
    keep, moment = [], []
    for r in rows:
        hit = np.flatnonzero((blocks[:, 0] <= r.op) & (r.op <= blocks[:, 1]))
        if len(hit):
            keep.append(r)
            moment.append(int(np.searchsorted(at, blocks[hit[0], 2])))
    if not keep:
        return None
    return CombinedCopies(
        rows=row_table(keep, pad_group, empty_set), moment=np.array(moment, dtype=np.int64)
    )


def convolution_copies(graph: Graph, consumers) -> list[tuple[int, int, int]]:
    """(tensor, birth, death) of two copies XLA's GPU pipeline makes in a convolutional
    net (read on compile-only A100s, VGG): each step input a convolution reads (a kernel,
    the images) copied once to the layout cuDNN takes and kept for every convolution
    reading it, the backward's too; and the pooled tensor of a max pool, whose backward
    scatters in place into a copy that XLA's copy insertion makes where the tensor is."""
    rows = []
    for leaf in graph.inputs:
        conv = [c for c in consumers[leaf.tensor] if graph.ops[c].primitive == CONV]
        if conv and graph.tensors[leaf.tensor].ndim == 4:
            rows.append((leaf.tensor, min(conv), max(conv)))
    for op in graph.ops:
        pooled = graph.tensors[op.inputs[1]] if op.primitive == "select_and_scatter_add" else None
        if pooled is not None and pooled.producer is not None:
            rows.append((pooled.id, pooled.producer, op.index))
    return rows


CONV = "conv_general_dilated"


def column_operands(
    graph: Graph, in_memory: np.ndarray, sums: Sequence[int] = ()
) -> list[tuple[int, int, int]]:
    """(tensor, birth, death) of the operands XLA's GPU pipeline writes for its column
    reductions: a sum over every dim but the minor one (a layer norm's scale gradient,
    summed over batch and sequence) of a tensor made by elementwise arithmetic (not a
    convert of a tensor in memory, which the reduction reads itself) is not fused with the
    kernel that makes its operand, which writes the operand for a reduction kernel of its
    own (`Lowering.float32_norm_buffers`). Read on compile-only A100s, a bf16 GPT's norms'
    backward: a float32 [batch, seq, hidden] operand per scale, written beside the stream's
    float32 cotangent. That kernel is the one that sums the norm's input gradient into the
    stream's cotangent (`sums`: the ops writing the float32 sums, `_kept_wide_sum`): XLA
    fuses the operand, which reads what the input gradient reads, into it as another
    output, so the operand is written there (at the first of `sums` from its reduction
    on), beside the sum and its operands; the head's norm, whose input gradient is
    summed in the next norm's kernel (`_remade_norm_gradients`), writes its operand there
    too (read at a 2-layer bf16 GPT's peaks at tp 8: two float32 operands, 16 MiB, beside
    the cotangent the kernel writes and the one it reads)."""
    rows = []
    for op in graph.ops:
        if op.primitive != "reduce_sum":
            continue
        x = graph.tensors[op.inputs[0]]
        p = x.producer
        if (
            p is None
            or in_memory[x.id]
            or x.ndim < 2
            or tuple(op.params.get("axes", ())) != tuple(range(x.ndim - 1))
            or graph.ops[p].primitive not in ELEMENTWISE
            or graph.ops[p].primitive == "convert_element_type"
        ):
            continue
        k = bisect.bisect_left(sums, op.index)
        at = sums[k] if k < len(sums) else None
        rows.append((x.id, p, op.index) if at is None else (x.id, at, at))
    return rows


def _held_wide(graph: Graph, consumers, t: int, lowering: Lowering, narrow: bool = False) -> float:
    """How many times its own bytes a buffer of t takes: XLA's GPU pipeline computes a
    transcendental function (`is_expensive`) of 16-bit floats in float32, and where only fusible
    ops read the result and none of them runs in 16 bits itself (on an A100 none does;
    on an H100 adds, subtracts and multiplies do: `Lowering.native_bf16_arithmetic`), it
    keeps that float32 value for them (excess precision: an A100 stores GELU's tanh for the
    backward in float32, read on compile-only A100s and H100s)."""
    x = graph.tensors[t]
    p = x.producer
    if not narrow and _kept_wide_sum(graph, consumers, t, lowering):
        return 4.0 / x.itemsize
    if (
        p is None
        or not is_expensive(graph, graph.ops[p])
        or x.dtype not in ("bfloat16", "float16")
        or not all(graph.ops[c].primitive in FUSIBLE for c in consumers[t])
        or (
            lowering.native_bf16_arithmetic
            and any(graph.ops[c].primitive in _NATIVE_BF16 for c in consumers[t])
        )
    ):
        return 1.0
    return 4.0 / x.itemsize


class Held(NamedTuple):
    """One stored residual (`held_widths`)."""

    tensor: int
    width: float  # how many times its own bytes XLA holds it at (`_operand_width`)
    serves: tuple[int, ...]  # the residuals of `saved` it is stored for


def held_widths(
    graph: Graph, saved: Iterable[int], lowering: Lowering, consumers, recomputed: bool = False
) -> tuple[Held, ...]:
    """`stored_residuals` of `saved`, each with how many times its bytes XLA holds it at
    (`_operand_width` of the residuals it is stored for) and those residuals, as
    `step_buffers` holds them: what a pipeline stage's recompute makes is priced by the
    one-stage rules, each stored tensor alive until the last backward read of what it
    serves."""
    serves: dict[int, list[int]] = {}
    for r in saved:
        for t in stored_residuals(graph, [r], lowering, consumers, recomputed):
            serves.setdefault(t, []).append(r)
    return tuple(
        Held(t, _operand_width(graph, consumers, rs, lowering), tuple(rs))
        for t, rs in sorted(serves.items())
    )


def _operand_width(graph: Graph, consumers, residuals: Iterable[int], lowering: Lowering) -> float:
    """How many times its own bytes a stored float32 tensor takes where it is kept only for
    matmuls that read it narrower (`Lowering.matmul_operand_bytes`): every residual it is
    stored for is float32 and read by default-precision matmuls alone, so XLA stores their
    operand's convert, written by the kernel that makes it (XLA's TPU: q, k, v as bf16).
    1 otherwise."""
    rs = list(residuals)
    if not lowering.matmul_operand_bytes or not rs:
        return 1.0
    for r in rs:
        x = graph.tensors[r]
        readers = [graph.ops[c] for c in consumers[r]]
        if x.dtype != "float32" or not matmuls_alone(readers):
            return 1.0
    return lowering.matmul_operand_bytes / 4.0


def _kept_wide_sum(graph: Graph, consumers, t: int, lowering: Lowering) -> bool:
    """Whether XLA's GPU pipeline keeps a 16-bit sum (an add or subtract, which an A100 runs
    in float32: `GpuFloatSupport`) as its float32 value: where a reader converts it back to
    float32, or where it sums a value narrowed from float32 for another sum to read, excess
    precision drops its round trip to 16 bits, and the kernel that makes it writes the
    float32 value (a matmul that also reads it takes a 16-bit copy, converted beside it).
    Read in the buffer assignment of a 2-layer bf16 GPT at tp 8 on compile-only A100s:
    the residual stream's sums, which the layer norms read in float32, written float32;
    and the stream's cotangent, summed through the norms' backward, float32 from one
    norm's backward to the next (`Lowering.float32_norm_buffers`). XLA also keeps the
    forward's float32 sum a norm's statistics read for its backward, not made again from
    its operands (`_fusion.statistics_operand`; under selective recomputation the
    runtime makes each layer's again, `_remat/_chains.py`, and the head's is kept)."""
    x = graph.tensors[t]
    p = x.producer
    if not (
        lowering.float32_norm_buffers
        and not lowering.native_bf16_arithmetic
        and p is not None
        and graph.ops[p].primitive in _SUMS
        and x.dtype in ("bfloat16", "float16")
    ):
        return False
    readers = [graph.ops[c] for c in consumers[t]]
    widened = any(_converts_to(graph, r, "float32") for r in readers)
    narrowed = [_narrowed_source(graph, i) is not None for i in graph.ops[p].inputs]
    # a sum of narrowed values alone is made again where it is summed (`_remade_norm_gradients`)
    kept = any(narrowed) and not all(narrowed)
    return widened or (kept and any(r.primitive in _SUMS for r in readers))


def _narrowed_source(graph: Graph, t: int) -> int | None:
    """The float32 tensor t narrows (a convert to 16 bits of it), or None."""
    p = graph.tensors[t].producer
    if p is None or graph.ops[p].primitive != "convert_element_type":
        return None
    u = graph.ops[p].inputs[0]
    narrow = graph.tensors[t].dtype in ("bfloat16", "float16")
    return u if narrow and graph.tensors[u].dtype == "float32" else None


def _recompute_moment(graph: Graph, boundary: int, first_read: int, lowering: Lowering) -> int:
    """Where a recomputed layer's residuals are made again: at the backward's first read
    of any of them, or with `lowering.early_recompute` just after the backward's last
    matmul before that read, before the kernels between (the next layer's norm backward,
    reading its all-reduced cotangent)."""
    if not lowering.early_recompute:
        return first_read
    ops = graph.ops
    last = next(
        (i for i in range(first_read - 1, boundary, -1) if ops[i].primitive == "dot_general"), None
    )
    return first_read if last is None else last + 1


def _remade_norm_gradients(
    graph: Graph, consumers, in_memory: np.ndarray
) -> list[tuple[int, int, list[int]]]:
    """(t, its last reader but a sum, the in-memory tensors its float32 value is made
    from) of each 16-bit sum of values narrowed from float32 alone that a sum reads (the
    input gradient of the stream's last norm, a head's: its two parts narrowed where the
    stream's cotangent starts; `Lowering.float32_norm_buffers`). XLA's GPU pipeline writes
    t in 16 bits for the matmuls that read it, and where the next norm's backward sums it
    into the stream's cotangent, it makes its float32 value again inside that kernel (its
    chain of elementwise ops fused in, excess precision) from what the chain reads: the
    norm's float32 input, its incoming cotangent, its statistics, alive until that kernel
    (`_last_sum`) where the model had held t in float32 (`_kept_wide_sum`). Read in the A100
    buffer assignment of a 2-layer bf16 GPT at tp 8, plain tensor parallelism: at its peak,
    the last layer's MLP backward, XLA holds the head norm's float32 input (8 MiB) and
    all-reduced cotangent (4 MiB) for the kernel of that layer's second norm's backward,
    and the 16-bit input gradient (4 MiB) to its last matmul."""
    out = []
    for op in graph.ops:
        t = op.outputs[0]
        if (
            op.primitive not in _SUMS
            or graph.tensors[t].dtype not in ("bfloat16", "float16")
            or not in_memory[t]
        ):
            continue
        sources = [_narrowed_source(graph, i) for i in op.inputs]
        readers = consumers[t]
        sums = [c for c in readers if graph.ops[c].primitive in _SUMS]
        if not sums or any(u is None for u in sources):
            continue
        until = max((c for c in readers if c not in sums), default=op.index)
        out.append((t, until, _chain_reads(graph, sources, in_memory)))
    return out


def _wide_sums(graph: Graph, consumers, in_memory: np.ndarray, lowering: Lowering) -> list[int]:
    """The ops (program order) whose kernels write a 16-bit sum as its float32 value
    (`_kept_wide_sum`): in the backward, the stream's cotangent, one a norm."""
    return [
        op.index
        for op in graph.ops
        if op.primitive in _SUMS
        and in_memory[op.outputs[0]]
        and _kept_wide_sum(graph, consumers, op.outputs[0], lowering)
    ]


def _last_sum(graph: Graph, consumers, t: int, in_memory: np.ndarray) -> int:
    """The op whose kernel sums t into the stream's cotangent: t's sum readers followed
    through the sums XLA fuses (not written) to the first whose result is written."""
    todo, out = [t], -1
    while todo:
        x = todo.pop()
        for c in consumers[x]:
            if graph.ops[c].primitive not in _SUMS:
                continue
            y = graph.ops[c].outputs[0]
            if in_memory[y]:
                out = max(out, c)
            else:
                todo.append(y)
    return out


def _chain_reads(graph: Graph, start: Iterable[int], in_memory: np.ndarray) -> list[int]:
    """The in-memory tensors a fused chain making `start` reads: walked back through
    fusible ops (elementwise, layout) to tensors a kernel writes."""
    out: set[int] = set()
    todo, seen = list(start), set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        p = graph.tensors[x].producer
        if in_memory[x] or p is None:
            out.add(x)
        elif graph.ops[p].primitive in FUSIBLE:
            todo.extend(graph.ops[p].inputs)
    return sorted(out)


def _converts_to(graph: Graph, op, dtype: str) -> bool:
    return op.primitive == "convert_element_type" and graph.tensors[op.outputs[0]].dtype == dtype


_SUMS = frozenset({"add", "add_any", "sub"})

#: What XLA's GPU pipeline runs in bfloat16 where `Lowering.native_bf16_arithmetic`.
_NATIVE_BF16 = frozenset({"add", "sub", "mul"})
