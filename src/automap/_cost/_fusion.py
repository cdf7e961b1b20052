"""XLA's fusion, as the cost model charges it: which tensors a fused step writes to memory
and what each kernel reads and writes.

XLA fuses elementwise chains, layout changes and reductions into kernels, so only tensors
entering or leaving a kernel touch HBM: a memory-bound op's time is its kernel's traffic,
not its own operands' (`fused_bytes`), and the buffers a step holds are the tensors its
kernels write (`in_memory_tensors`, which `_buffers.py` and `_residuals.py` build on). The
rules are XLA's fusion passes', read in its HLO (tests/test_fusion.py holds them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .._graph import Graph, TensorKind
from .._groups import ELEMENTWISE, FREE, REDUCE_SUM_LIKE
from .._lowering import Lowering

# Ops XLA fuses into loops over their operands (elementwise chains, layout changes,
# reductions as fusion roots): only tensors entering or leaving a fusion touch HBM.
FUSIBLE = (
    ELEMENTWISE
    | FREE
    | REDUCE_SUM_LIKE
    | {
        "transpose",
        "concatenate",
        "pad",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "rev",
        "split",
        "argmax",
        "argmin",
    }
)


# Elementwise ops XLA's fusion pass will not duplicate into a second consumer
# (`InstructionFusion::IsExpensive`: transcendental functions and float division): their
# result is written once and read back by every kernel that needs it.
EXPENSIVE = frozenset(
    """acos acosh asin asinh atan atan2 atanh cbrt cos cosh digamma div erf erf_inv erfc exp
    exp2 expm1 igamma lgamma log log1p logistic pow rem rsqrt sin sinh sqrt tan tanh""".split()  # noqa: SIM905
)


def is_expensive(graph: Graph, op) -> bool:
    """Whether XLA treats `op` as `EXPENSIVE`: a division by a constant is not, since XLA's
    algebraic simplifier first rewrites a / c as a * (1 / c), a cheap multiply fused into
    each reader (attention's scores / sqrt(d): XLA keeps the scores' matmul output, not
    the quotient, read on compile-only A100s and H100s)."""
    if op.primitive not in EXPENSIVE:
        return False
    return op.primitive != "div" or not _constant(graph, op.inputs[1])


def _constant(graph: Graph, t: int) -> bool:
    """Whether t is a literal, or a literal broadcast (the two forms XLA inverts)."""
    x = graph.tensors[t]
    if x.kind is TensorKind.CONST:
        return True
    p = x.producer
    return (
        p is not None
        and graph.ops[p].primitive == "broadcast_in_dim"
        and all(graph.tensors[i].kind is TensorKind.CONST for i in graph.ops[p].inputs)
    )


def fused_bytes(
    graph: Graph,
    saved: Iterable[int],
    ops: set[int] | None,
    lowering: Lowering,
) -> np.ndarray:
    """HBM bytes of each fusible op once XLA has fused it with its fusible neighbours.

    A tensor is written to memory when it must be: read by an op that cannot fuse, a step
    output, kept for the backward (`saved`), or a reduction's result. Each such write ends
    a kernel, whose root op is charged the kernel's traffic: what it writes, and the
    in-memory tensors its fused producers read (its cone, up to tensors in memory). A
    producer that two kernels need is fused into both, as XLA does, so what it reads is
    read twice (softmax's backward reads its incoming gradient before and after the
    row sum); ops inside a cone are charged nothing of their own.

    Two rules of XLA's fusion passes refine "must be written":
    - a broadcast (or iota, or elementwise work on those alone) is never written out, even
      when the backward reads it (a causal mask): every fusion that reads it regenerates it
      from its small operand (`_regenerated`; checked on XLA's CPU HLO in tests/test_fusion.py);
    - with `lowering.multi_output_fusion` (XLA's GPU pipeline: producer-consumer
      multi-output fusion, and the Triton normalization-diamond fusion on Ampere and
      later), a reduction of a tensor that its elementwise producer writes anyway (kept for
      backward, read by another kernel) runs in the producer's kernel: it does not read
      that tensor back. (`saved`, on that pipeline, is what XLA stores of the backward's
      residuals, `_residuals.written_residuals`: softmax's exp(x - max) is not among them,
      made again in its readers, so no kernel writes it.)

    - with `Lowering.float32_norm_buffers` (an A100's pipeline), a norm's input (the
      residual stream's 16-bit sum, `statistics_operand`) is written as its float32 value
      by the kernel that makes it, which computes the norm's statistics too, both row sums
      in that one pass: the sums read nothing back, and every reader of the stream (the
      normalizing kernel, the next residual add, the backward) reads 4 bytes an element.
      Read in the A100 program of a bf16 GPT at the 22B width (tp 8): per layer and norm,
      one kernel reads the stream and a block's output and writes the float32 sum with its
      two row sums, and one reads it and writes the 16-bit normalized value.

    Only `ops` run, all where None (XLA removes dead code; a first forward under
    rematerialization runs without the backward, whose reads the recompute serves)."""
    ops = set(range(len(graph.ops))) if ops is None else ops
    fusible = [op.primitive in FUSIBLE and op.index in ops for op in graph.ops]
    in_memory = in_memory_tensors(graph, saved, ops)
    nbytes = np.array([t.nbytes for t in graph.tensors], dtype=float)
    wide = _statistics_written(graph, in_memory, lowering)
    nbytes[sorted(wide)] *= 2  # a 16-bit tensor held as its float32 value
    out = np.zeros(len(graph.ops))
    cones = _Cones(graph, in_memory, fusible)
    for op in graph.ops:
        written = [t for t in op.outputs if in_memory[t]]
        if not fusible[op.index] or not written:
            continue  # not a kernel's root: its work is charged to the roots it feeds
        read = cones.reads(op)
        if lowering.multi_output_fusion and op.primitive in REDUCE_SUM_LIKE:
            read = {t for t in read if not (t in op.inputs and _written_alongside(graph, t))}
            if wide and _row_sum(graph, op):
                read -= wide  # the statistics, summed in the kernel that writes it
        out[op.index] = nbytes[written].sum() + nbytes[sorted(read)].sum()
    return out


def in_memory_tensors(
    graph: Graph, saved: Iterable[int], ops: set[int] | None = None
) -> np.ndarray:
    """Which tensors XLA writes to memory once it has fused the fusible ops (`fused_bytes`
    gives the rules): per tensor, True where a kernel writes it (or it is a step input).
    Read-only, and remembered on the graph: each cost model built on it (a recompute
    policy's variant, `CostModel.for_plan`) asks again for most of the same sets (those
    without recomputation), and each answer walks the whole program several times."""
    key = (tuple(sorted(set(saved))), None if ops is None else tuple(sorted(ops)))
    return graph.recall(
        "in_memory", graph, key, lambda: _in_memory(graph, key[0], ops), keep=RECENT_SETS
    )


# Distinct (saved, ops) sets a model build asks for: five, and as many per variant.
RECENT_SETS = 16


def _in_memory(graph: Graph, saved: Iterable[int], ops: set[int] | None) -> np.ndarray:
    ops = set(range(len(graph.ops))) if ops is None else ops
    fusible = [op.primitive in FUSIBLE and op.index in ops for op in graph.ops]
    regen = _regenerated(graph, fusible)
    in_memory = np.zeros(len(graph.tensors), dtype=bool)
    for t in graph.tensors:
        p = t.producer
        in_memory[t.id] = p is None or not fusible[p] or graph.ops[p].primitive in REDUCE_SUM_LIKE
    for op in graph.ops:
        if not fusible[op.index] and op.index in ops:
            in_memory[list(op.inputs)] = True
    in_memory[[leaf.tensor for leaf in graph.outputs]] = True
    in_memory[[t for t in saved if not regen[t]]] = True
    nbytes = np.array([t.nbytes for t in graph.tensors], dtype=float)
    out = _materialize_shared(graph, in_memory, fusible, regen.tolist(), nbytes)
    out.setflags(write=False)  # shared by every caller with the same sets
    return out


def _materialize_shared(
    graph: Graph, in_memory: np.ndarray, fusible: list[bool], regen: list[bool], nbytes: np.ndarray
) -> np.ndarray:
    """Where a fused producer feeds k kernels, XLA either fuses it into all of them (each
    reads what it reads, L bytes) or writes its result (X bytes) once for all to read: it
    picks the cheaper, as its priority fusion weighs the two, so the result is written when
    (k - 1) L > (k + 1) X (a residual stream read by a layer norm's kernels and the next
    residual add is written; a convert feeding a softmax gradient's two kernels is not).
    Iterated to a fixed point: each write makes new kernel roots upstream."""
    # A list, not the array: these loops read one entry at a time, which numpy's scalar
    # indexing makes several times slower (a 1T GPT's 88,000 ops, a dozen times a search).
    in_memory = in_memory.tolist()
    for _ in range(4):
        kernels = _kernels_reading(graph, in_memory, fusible)
        # One pass's cones stay valid as it writes tensors: ops run in graph order, and
        # the tensors op i writes are read only by later ops, so no cone cached before
        # (every one upstream of an earlier op's operands) walks through them.
        cones = _Cones(graph, in_memory, fusible)
        changed = False
        for op in graph.ops:
            if not fusible[op.index]:
                continue
            pending = [t for t in op.outputs if not in_memory[t] and not regen[t]]
            k = max((len(kernels[t]) for t in pending), default=0)
            if k < 2:
                continue
            reads = nbytes[sorted(cones.reads(op))].sum()
            for t in pending:
                if written_for(len(kernels[t]), reads, nbytes[t]):
                    in_memory[t] = changed = True
        if not changed:
            break
    return np.array(in_memory, dtype=bool)


def written_for(kernels: int, reads: float, nbytes: float, tie: bool = False) -> bool:
    """Whether XLA writes a fused value that `kernels` kernels read, rather than making it
    again in each: fused into all, each reads what it is made from (`reads` bytes); written
    once (`nbytes`), it is read by all (`_materialize_shared` gives the weighing). `tie`:
    whether it is written where the two read alike."""
    more, less = (kernels - 1) * reads, (kernels + 1) * nbytes
    return more > less or (tie and more == less)


def cone_reads(graph: Graph, in_memory, tensors: Iterable[int]) -> dict[int, set[int]]:
    """Per tensor, the in-memory tensors a kernel that makes it inside itself reads: from
    its producer's operands back through the fusible ops whose results are not written."""
    fusible = [op.primitive in FUSIBLE for op in graph.ops]
    cones = _Cones(graph, in_memory, fusible)
    return {t: cones.reads(graph.ops[graph.tensors[t].producer]) for t in tensors}


def _kernels_reading(graph: Graph, in_memory: Sequence[bool], fusible: list[bool]) -> list:
    """Per tensor not in memory, the kernel roots (ops writing a tensor to memory) whose
    fused cone computes it."""
    empty: frozenset[int] = frozenset()
    roots: list = [empty] * len(graph.tensors)
    for op in reversed(graph.ops):
        if not fusible[op.index]:
            continue
        mine = frozenset((op.index,)) if any(in_memory[t] for t in op.outputs) else empty
        for o in op.outputs:
            if not in_memory[o] and roots[o] is not mine:
                mine = mine | roots[o] if mine else roots[o]
        for t in op.inputs:
            if not in_memory[t]:
                # Shared, not copied, where t has no other reader yet (most of a chain).
                roots[t] = mine if not roots[t] else roots[t] | mine
    return roots


class _Cones:
    """The in-memory tensors a kernel reads: from its root's operands back through fused
    producers (tensors not in memory) to tensors that are. Each tensor's cone is kept, as
    the union of its producer's operands' cones: kernels share most of their cones (a
    layer's norms and residual adds), which a walk per kernel went over again each time
    (most of the cost model's build on a 48-layer model)."""

    def __init__(self, graph: Graph, in_memory: np.ndarray, fusible: list[bool]):
        self._graph, self._in_memory, self._fusible = graph, in_memory, fusible
        self._cones: dict[int, frozenset[int]] = {}

    def reads(self, root) -> set[int]:
        return set().union(*(self._of(t) for t in root.inputs))

    def _operands(self, t: int):
        """The tensors t's cone is the union of, or None where t is read from memory."""
        p = self._graph.tensors[t].producer
        if self._in_memory[t] or p is None or not self._fusible[p]:
            return None
        return self._graph.ops[p].inputs

    def _of(self, t: int) -> frozenset[int]:
        cones = self._cones
        todo = [t]  # depth first, without recursion: a fused chain may run the model deep
        while todo:
            u = todo[-1]
            if u in cones:
                todo.pop()
                continue
            operands = self._operands(u)
            if operands is None:
                cones[u] = frozenset((u,))
            elif missing := [i for i in operands if i not in cones]:
                todo.extend(missing)
                continue
            else:
                parts = {id(cones[i]): cones[i] for i in operands}.values()
                cones[u] = next(iter(parts)) if len(parts) == 1 else frozenset().union(*parts)
            todo.pop()
        return cones[t]


def walk_back(start: Iterable[int], through) -> set[int]:
    """The tensors where a walk back from `start` stops: `through(t)` gives the tensors to
    walk on to in t's place (its producer's operands; empty: drop t), or None to stop at
    t and keep it."""
    out, seen, todo = set(), set(), list(start)
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        further = through(t)
        if further is None:
            out.add(t)
        else:
            todo.extend(further)
    return out


# Ops whose result XLA recomputes inside every fusion that reads it, from operands no
# larger than the result's own regenerated inputs.
_GENERATORS = frozenset({"broadcast_in_dim", "iota"})


def _regenerated(graph: Graph, fusible: list[bool]) -> np.ndarray:
    """Tensors made by broadcasts/iotas and elementwise ops on those (and on scalars) alone:
    XLA fuses them into each consumer rather than materializing them."""
    regen = np.zeros(len(graph.tensors), dtype=bool)
    for op in graph.ops:
        if not fusible[op.index]:
            continue
        if op.primitive in _GENERATORS:
            ok = True
        elif op.primitive in ELEMENTWISE:
            ok = all(regen[t] or graph.tensors[t].ndim == 0 for t in op.inputs)
        else:
            ok = False
        if ok:
            regen[list(op.outputs)] = True
    return regen


def _written_alongside(graph: Graph, t: int) -> bool:
    """Whether a reduction of t can run inside the kernel that writes t: t comes from an
    elementwise op (a loop fusion, the root of a multi-output fusion with the reduction)."""
    p = graph.tensors[t].producer
    return p is not None and graph.ops[p].primitive in ELEMENTWISE


def statistics_operand(graph: Graph, consumers, t: int, lowering: Lowering) -> bool:
    """Whether t is a mixed-precision row normalization's input: a 16-bit float that a
    reader widens to float32 for a sum over its last axis (the norm's mean), with
    `Lowering.float32_norm_buffers` on a GPU that sums 16-bit floats in float32. XLA's GPU
    pipeline computes the statistics in a reduction kernel that also writes t's float32
    value (a multi-output fusion; excess precision drops the round trip through 16 bits,
    `_buffers._kept_wide_sum`) for the normalizing kernel, which cannot run in the
    reduction's pass; the backward reads that written buffer, not one made again from t's
    operands. Read in the A100 buffer assignment of a 2-layer bf16 GPT at tp 8: the head's
    norm, which no recompute makes again, keeps its float32 input (8 MiB) from the forward
    to its backward, where the model held the bf16 matmul output it is summed from."""
    if not lowering.float32_norm_buffers or lowering.native_bf16_arithmetic:
        return False
    if graph.tensors[t].dtype not in ("bfloat16", "float16"):
        return False
    for c in consumers[t]:
        op = graph.ops[c]
        wide = graph.tensors[op.outputs[0]]
        if op.primitive != "convert_element_type" or wide.dtype != "float32":
            continue
        if any(
            graph.ops[r].primitive == "reduce_sum" and _row_sum(graph, graph.ops[r])
            for r in consumers[wide.id]
        ):
            return True
    return False


def _statistics_written(graph: Graph, in_memory: np.ndarray, lowering: Lowering) -> set[int]:
    """The norms' inputs a kernel writes as their float32 value beside their statistics
    (`fused_bytes`): in memory, made by an elementwise op (the kernel's root, with the
    row sums as its other outputs), and read widened for a row sum (`statistics_operand`)."""
    if not lowering.float32_norm_buffers or lowering.native_bf16_arithmetic:
        return set()
    consumers = graph.consumers()
    return {
        t.id
        for t in graph.tensors
        if in_memory[t.id]
        and _written_alongside(graph, t.id)
        and statistics_operand(graph, consumers, t.id, lowering)
    }


def _row_sum(graph: Graph, op) -> bool:
    """Whether op reduces its operand over the last axis alone (a norm's statistics)."""
    return tuple(op.params.get("axes", ())) == (graph.tensors[op.inputs[0]].ndim - 1,)
