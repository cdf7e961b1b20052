"""Which of the backward's residuals XLA stores, and which it makes again.

The jaxpr says what the backward reads from the forward (`Residuals`); XLA stores less: a
residual its fusion can make again cheaply in each reader (an elementwise chain's result)
is never written, and the operands it is made from are stored in its place
(`stored_residuals`); on a GPU, so is a recomputed layer's expensive elementwise result
(GELU's tanh). The activations a plan keeps, and the buffers it holds
(`_buffers.step_buffers`), are those stored ones (`kept_residuals`), read on compile-only
A100s; tests/test_residual_memory.py holds the rules. A pipeline stage's forward and
backward are two programs, so there the runtime chooses what its backward makes again
(`_remat.remake_residuals`) and `stage_residuals` prices that.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import numpy as np

from .._capture import Residuals
from .._graph import Graph
from .._groups import ELEMENTWISE, FREE, REDUCE_SUM_LIKE
from .._lowering import Lowering
from .._pipeline import Partition, Phase
from .._remat import remake_residuals
from ._fusion import FUSIBLE, is_expensive, statistics_operand, walk_back


def stored_residuals(
    graph: Graph,
    saved: Iterable[int],
    lowering: Lowering,
    consumers=None,
    recomputed: bool = False,
    stored: Collection[int] = (),
) -> tuple[int, ...]:
    """Of the tensors the backward reads from the forward (`saved`), those XLA stores.

    A residual made by a cheap elementwise or layout op (not `EXPENSIVE`) that only fusible
    ops read is never written: XLA fuses its producer into each of its readers, the
    forward's and the backward's, and makes it again there from the producer's operands,
    which are stored in its place (recursively: GELU's polynomial chain is made again from
    the matmul output and the tanh). Residuals an unfusible op reads (a matmul's operand),
    expensive results and reductions stay stored. With `lowering.remakes_residuals` (XLA's
    GPU pipeline), a row normalization's expensive results are made again too
    (`_normalizes`), and a residual converted back to the type it was narrowed from is read
    as its wider source (`_widened_source`), which is stored or made again in turn.
    `recomputed`: the residuals are a recomputed layer's, made again in its backward
    (`_remade_from`)."""
    consumers = graph.consumers() if consumers is None else consumers
    start = list(saved)
    if lowering.remakes_residuals:
        start += [u for t in start if (u := _widened_source(graph, consumers, t)) is not None]

    def remade_from(t: int) -> list[int] | None:
        return None if t in stored else _remade_from(graph, consumers, t, lowering, recomputed)

    return tuple(sorted(walk_back(start, remade_from)))


def kept_residuals(
    graph: Graph, res: Residuals, lowering: Lowering, consumers
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What one program keeps for its backward, without and with rematerialization.

    With `lowering.remakes_residuals` (XLA's GPU pipeline) the residuals XLA
    stores (`stored_residuals`) of the jaxpr's: of every residual without remat; with it,
    of those no layer recomputes and the layer inputs, and of the largest layer's (made
    again by its recompute, alive in its backward: `recomputed`). Without, the jaxpr's
    sets."""
    if not lowering.remakes_residuals:
        return res.saved, res.saved_remat
    layered = {t for ts in res.layer_saved for t in ts}
    once = [t for t in res.saved_remat if t not in layered]
    again = [t for t in res.saved_remat if t in layered]
    barred = barrier_inputs(res, consumers, once)  # stored themselves
    remat = set(stored_residuals(graph, once, lowering, consumers, stored=barred))
    remat |= set(stored_residuals(graph, again, lowering, consumers, True, barred))
    return stored_residuals(graph, res.saved, lowering, consumers), tuple(sorted(remat))


def written_residuals(
    graph: Graph, res: Residuals, lowering: Lowering, consumers
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What the step's kernels write for its backward, as XLA stores it (`stored_residuals`),
    for the time the memory-bound kernels take (`_compute.compute_inputs`): the residuals of
    the whole step (those a recompute makes again included: it writes what its backward
    reads), and those of a recomputed program's first forward (the residuals no layer makes
    again, a layer input stored as itself through its barrier). A residual XLA makes again
    in its readers is not written by the forward nor read back by the backward: its readers
    read the operands it is made from. Without `lowering.remakes_residuals`, the jaxpr's.

    Read on a bf16 GPT at the 22B width (hidden 6144, microbatch 4, tp 8, A100s, no
    recomputation): its layer norms' float32 `2x`, `x - mean` and `rsqrt(var) * scale`,
    which the jaxpr saves, are in no XLA kernel's outputs. Priced as written, the residual
    stream's kernels were charged 7.7 GB a layer per device where XLA's fusions move 4.7;
    as stored, 4.0 (slopes over 2 and 4 layers; tests/test_fusion.py holds 2 layers)."""
    made_again = {t for ts in res.layer_saved for t in ts}
    once = [t for t in res.saved if t not in made_again]
    if not lowering.remakes_residuals:
        return tuple(res.saved), tuple(once)
    barred = barrier_inputs(res, consumers, once)
    return (
        stored_residuals(graph, res.saved, lowering, consumers),
        stored_residuals(graph, once, lowering, consumers, stored=barred),
    )


def barrier_inputs(res: Residuals, consumers, saved: Iterable[int]) -> set[int]:
    """Of the residuals no layer recomputes (`saved`), those a recomputed op reads: a
    layer's input, which the recompute takes through its barrier (`_run/_recompute.py`), so
    XLA stores it itself (16-bit) rather than making it again from its operands, as it may
    a residual its fusions read (`stored_residuals`). Read in the A100 programs of a bf16
    GPT under full recomputation: one stream tensor a layer (split under sequence
    parallelism), not the stream's summands (the embedding's lookup and each layer's
    projections: 2 x 12.6 MB a layer at tp 8, held whole where the stream is split)."""
    again = set(res.recomputed)
    return {t for t in saved if any(c in again for c in consumers[t])}


def stand_in_map(graph: Graph, consumers, lowering: Lowering, recomputed: bool = False, stored=()):
    """`stored_residuals` of one residual at a time, memoized: r -> the tensors XLA stores
    in its place (r itself, or the operands it is made again from; and its wider source's
    where a reader converts it back, `_widened_source`). `recomputed`: of a recomputed
    layer's residuals. `stored`: tensors XLA stores themselves (`barrier_inputs`)."""
    memo: dict[int, frozenset[int]] = {t: frozenset((t,)) for t in stored}

    def stored(r: int) -> frozenset[int]:
        todo = [r]
        while todo:
            t = todo[-1]
            if t in memo:
                todo.pop()
                continue
            further = _remade_from(graph, consumers, t, lowering, recomputed)
            if further is None:
                memo[t] = frozenset((t,))
            elif all(i in memo for i in further):
                memo[t] = frozenset().union(*(memo[i] for i in further))
            else:
                todo.extend(i for i in further if i not in memo)
                continue
            todo.pop()
        return memo[r]

    def stored_or_widened(r: int) -> frozenset[int]:
        u = _widened_source(graph, consumers, r)
        return stored(r) if u is None else stored(r) | stored(u)

    return stored_or_widened


_CHEAP = ELEMENTWISE | FREE


def _remade_from(
    graph: Graph, consumers, t: int, lowering: Lowering, recomputed: bool = False
) -> list[int] | None:
    """The operands XLA makes residual t again from (`stored_residuals`), or None: stored.

    With `lowering.fuses_matmul_operands` (XLA's TPU) a matmul reader fuses a float32
    chain too, and an expensive result of any width is made again like a cheap one (a
    bf16 Llama's SwiGLU sigmoid, read on compile-only v5p chips).
    With `lowering.remakes_residuals` an expensive elementwise result is made again too
    where it is part of a row normalization (`_normalizes`), or where it is a recomputed
    layer's (`recomputed`): the first forward makes it in the kernel that feeds its next
    matmul and keeps it there for the backward (GELU's tanh, stored), but the recompute
    runs only what the backward reads, so no forward kernel makes it and XLA fuses it
    into its backward readers, which make it again from the matmul output (read on
    compile-only A100s: a recomputed GELU's tanh is in no buffer; the backward's one
    multi-output kernel makes the GELU for the weight gradient and the input gradient)."""
    p = graph.tensors[t].producer
    if p is None:
        return []  # a step input: stored as such, not an activation
    op = graph.ops[p]
    rows, depth = lowering.fused_row_elements, lowering.fused_row_contraction
    if rows and _shift_apart(graph, t, (rows, depth), _apart_bounds(lowering)):
        return None
    if recomputed and rows and _row_kernel_exp(graph, t, rows):
        return None
    if not recomputed and statistics_operand(graph, consumers, t, lowering):
        return None
    # a matmul reader fuses a float32 operand's chain too (with the convert it runs it
    # in), but a recompute writes what its backward's matmuls read (XLA's TPU: a
    # recomputed GELU output as bf16, the width `_buffers` then holds it at)
    fused = lowering.fuses_matmul_operands and graph.tensors[t].dtype == "float32"
    fused = fused and not recomputed
    readers = FUSIBLE | MATMULS if fused else FUSIBLE
    remade = (
        op.primitive in _CHEAP
        and (
            fused
            or not is_expensive(graph, op)
            or lowering.fuses_matmul_operands
            or (lowering.remakes_residuals and (recomputed or _normalizes(graph, t)))
        )
        and all(graph.ops[c].primitive in readers for c in consumers[t])
    )
    return [i for i in op.inputs if graph.tensors[i].ndim] if remade else None


#: The matmul primitive: on XLA's TPU its kernel fuses the chains that make its operands.
MATMULS = frozenset({"dot_general"})


def matmuls_alone(readers) -> bool:
    """Whether some ops read a tensor and all are default-precision matmuls: the ones
    `Lowering.matmul_operand_bytes` runs narrower than a float32 operand."""
    return bool(readers) and all(
        op.primitive in MATMULS and default_precision(op) for op in readers
    )


def default_precision(op) -> bool:
    """Whether a matmul runs at the backend's default precision (no `precision`, no wider
    result asked for than its operands)."""
    return op.params.get("precision") is None and op.params.get("preferred_element_type") in (
        None,
        "float32",
    )


def _apart_bounds(lowering: Lowering) -> tuple[float, float]:
    """The longest row and contraction whose softmax shift XLA writes apart (no bound
    where the lowering gives none: `Lowering.apart_row_elements`)."""
    rows, depth = lowering.apart_row_elements, lowering.apart_row_contraction
    return (rows or math.inf, depth or math.inf)


def _shift_apart(graph: Graph, t: int, above: tuple[int, int], up_to: tuple[float, float]) -> bool:
    """Whether t is a softmax's shift written apart (`Lowering.fused_row_elements`): a
    matmul's output less a reduction of that output over its last axis, rows longer than
    `above[0]` and at most `up_to[0]`, the matmul contracting more than `above[1]` and at
    most `up_to[1]` elements (the graph's shapes: a plan that splits them is not read)."""
    op = graph.ops[graph.tensors[t].producer]
    if op.primitive != "sub" or len(op.inputs) != 2:
        return False
    a, b = op.inputs
    x = graph.tensors[a]
    if not x.ndim or not above[0] < x.shape[-1] <= up_to[0]:
        return False
    dot = _matmul_made(graph, a)
    if dot is None or not above[1] < _contraction(graph, dot) <= up_to[1]:
        return False
    todo, seen = [(b, 0)], set()
    while todo:  # b: a's row reduction, broadcast back (through a max, a stop_gradient)
        y, depth = todo.pop()
        p = graph.tensors[y].producer
        if p is None or y in seen or depth > 6:
            continue
        seen.add(y)
        r = graph.ops[p]
        if r.primitive in REDUCE_SUM_LIKE:
            if r.inputs[0] == a and tuple(r.params.get("axes", ())) == (x.ndim - 1,):
                return True
        elif r.primitive in _CHEAP:
            todo.extend((i, depth + 1) for i in r.inputs)
    return False


def _row_kernel_exp(graph: Graph, t: int, row_limit: int) -> bool:
    """Whether t is a recomputed softmax's exp that XLA's TPU writes from the matmul
    kernel making its scores: exp(x - max) over rows of at most `row_limit`, x made from
    the matmul's output by elementwise and layout ops (a widening convert, a scale, a
    broadcast mask). The kernel reduces each row inside (`Lowering.fused_row_elements`)
    and writes the exp and its row sums, never the scores, so the exp the backward reads
    is stored at its width, not made again from the scores. Read on compile-only v5p
    chips (libtpu 0.0.42.1): a recomputed bf16 Llama layer's f32 [128, 2, 4, 128, 128]
    exp, one output of the kernel of its query-key matmul, held through the layer's
    backward (llama plan 7 of the TPU bench, data 64 on v5p 4x4x4); a layer the forward
    keeps holds what the cost model prices already, so only recomputed ones are read."""
    op = graph.ops[graph.tensors[t].producer]
    if op.primitive != "exp":
        return False
    shift = graph.tensors[op.inputs[0]].producer
    if shift is None or graph.ops[shift].primitive != "sub":
        return False
    x = graph.ops[shift].inputs[0]
    if not graph.tensors[x].ndim or graph.tensors[x].shape[-1] > row_limit:
        return False
    # back to the matmul, through its kernel's elementwise and layout ops
    return _back_to_matmul(graph, x, 8, _through_kernel) is not None


def _through_kernel(graph: Graph, op, t: int) -> int | None:
    """The one float operand of t's size that elementwise or layout op `op` makes t from
    (the rest broadcasts), else None."""
    floats = [i for i in op.inputs if _full_float(graph, i, graph.tensors[t].size)]
    return floats[0] if op.primitive in _CHEAP | _LAYOUT and len(floats) == 1 else None


_LAYOUT = frozenset({"transpose"})
_FLOATS = frozenset({"float32", "bfloat16", "float16"})


def _full_float(graph: Graph, t: int, size: int) -> bool:
    """Whether t is a float array of `size` elements that is no broadcast (a mask's, a
    constant's: a kernel reads their small sources)."""
    x, p = graph.tensors[t], graph.tensors[t].producer
    broadcast = p is not None and graph.ops[p].primitive == "broadcast_in_dim"
    return x.size == size and x.dtype in _FLOATS and not broadcast


def _matmul_made(graph: Graph, t: int, depth: int = 3):
    """The matmul whose output t is, or that t is made from alone by elementwise ops with
    operands far smaller than it (a scale, a mask's broadcast), in its type; else None."""
    return _back_to_matmul(graph, t, depth + 1, _through_small)


def _through_small(graph: Graph, op, t: int) -> int | None:
    """The one operand not far smaller than t that elementwise op `op` makes t from, in
    t's type, else None."""
    big = [i for i in op.inputs if 8 * graph.tensors[i].nbytes > graph.tensors[t].nbytes]
    if op.primitive not in _CHEAP or len(big) != 1 or op.primitive == "convert_element_type":
        return None  # (a 16-bit matmul's output widened is reduced in its own kernel)
    return big[0]


def _back_to_matmul(graph: Graph, t: int, steps: int, follow):
    """The matmul t is made from within `steps` ops, each step back through the operand
    `follow(graph, op, t)` names (None: no way back), else None."""
    for _ in range(steps):
        p = graph.tensors[t].producer
        if p is None:
            return None
        op = graph.ops[p]
        if op.primitive in MATMULS:
            return op
        t = follow(graph, op, t)
        if t is None:
            return None
    return None


def _contraction(graph: Graph, dot) -> int:
    """Elements a matmul contracts per output element."""
    (lhs_contract, _), _ = dot.params["dimension_numbers"]
    shape = graph.tensors[dot.inputs[0]].shape
    return int(np.prod([shape[d] for d in lhs_contract], dtype=np.int64))


def _normalizes(graph: Graph, t: int, depth: int = 8) -> bool:
    """Whether t is part of a row normalization (a softmax's exp or division): made by
    elementwise and layout ops from a reduction over a tensor's last axis, within `depth`
    ops. XLA's GPU pipeline fuses such a chain, its reductions included, into one Triton
    kernel that it also fuses into each reader, so an expensive op there is made again from
    the chain's input like a cheap one (read on compile-only A100s: the backward of a
    softmax reads the scores, not the probabilities it made in the forward)."""
    todo, seen = [(t, 0)], set()
    while todo:
        x, d = todo.pop()
        p = graph.tensors[x].producer
        if p is None or x in seen or d > depth:
            continue
        seen.add(x)
        op = graph.ops[p]
        if op.primitive in REDUCE_SUM_LIKE:
            operand = graph.tensors[op.inputs[0]]
            if tuple(op.params.get("axes", ())) == (operand.ndim - 1,):
                return True
        elif op.primitive in _CHEAP:
            todo.extend((i, d + 1) for i in op.inputs if graph.tensors[i].ndim)
    return False


def _widened_source(graph: Graph, consumers, t: int) -> int | None:
    """u, where t narrows float u (a convert to 16 bits) and a reader of t converts it back
    to u's type: XLA, allowed excess precision (its default), drops the round trip, so that
    reader reads u itself (a mixed-precision softmax's backward reads its float32 result,
    not the 16-bit probabilities, read on compile-only A100s). Else None."""
    p = graph.tensors[t].producer
    if p is None or graph.ops[p].primitive != "convert_element_type":
        return None
    u = graph.ops[p].inputs[0]
    wide, narrow = graph.tensors[u], graph.tensors[t]
    if not (_is_float(wide.dtype) and _is_float(narrow.dtype)) or narrow.itemsize >= wide.itemsize:
        return None
    back = any(
        graph.ops[c].primitive == "convert_element_type"
        and graph.tensors[graph.ops[c].outputs[0]].dtype == wide.dtype
        for c in consumers[t]
    )
    return u if back else None


def _is_float(dtype: str) -> bool:
    return dtype.startswith("float") or dtype == "bfloat16"


def stage_residuals(
    graph: Graph,
    part: Partition,
    res: Residuals,
    consumers,
    remat: bool,
    generated,
    remakes: bool = True,
) -> list[tuple[int, ...]]:
    """Per pipeline stage, the activations its B program reads from a forward: the
    jaxpr's residuals (under `remat`, the layers' inputs and what no layer recomputes),
    held by the stages that read them in a backward or in a layer the backward recomputes
    (the stage that made one and only sends it on frees it once sent,
    `_run/_pipelined.py`), less what its B makes again (`_remat.remake_residuals`) or
    makes itself (`generated`: a causal mask), plus what it makes them from. Not
    `remakes` (a backward split into B and W, whose W reads F's residuals as they are):
    every residual read in a backward, as the jaxpr has it."""
    phase, stage = part.op_phase, part.op_stage
    layered = {t for ts in res.layer_saved for t in ts} if remat else set()
    recomputed = set(res.recomputed) if remat else set()
    held: list[set[int]] = [set() for _ in range(part.n_stages)]
    for t in res.saved_remat if remat else res.saved:
        if t in layered or t in generated:
            # made again in its layer's backward (`_remade.recomputed_values`), or by the
            # B program that reads it (`generated`: a causal mask)
            continue
        holders = {stage[c] for c in consumers[t] if phase[c] in _BACKWARD or c in recomputed} or {
            stage[graph.tensors[t].producer]
        }
        for s in holders:
            held[s].add(t)
    if not remakes:
        return [tuple(sorted(ts)) for ts in held]
    # What else a B program reads from outside its stage's forward (gradients, weight
    # casts): kept whatever it makes again, so free to make a residual from.
    reads = [set(ts) for ts in held]
    for op in graph.ops:
        s = stage[op.index]
        if phase[op.index] is Phase.BWD or op.index in recomputed:
            reads[s].update(t for t in op.inputs if not _made_in(part, graph, t, s))
    out = []
    for s, ts in enumerate(reads):
        rm = remake_residuals(graph, part, s, ts, consumers)
        out.append(tuple(t for t in rm.stored if t in held[s] or _forward_made(part, graph, t)))
    return out


#: A microbatch's backward, whole (B) or split into B and W (ZB-H1).
_BACKWARD = (Phase.BWD, Phase.WGT)


def _made_in(part: Partition, graph: Graph, t: int, s: int) -> bool:
    """Whether stage s's forward made t."""
    p = graph.tensors[t].producer
    return p is not None and part.op_stage[p] == s and part.op_phase[p] is Phase.FWD


def _forward_made(part: Partition, graph: Graph, t: int) -> bool:
    p = graph.tensors[t].producer
    return p is not None and part.op_phase[p] is Phase.FWD
