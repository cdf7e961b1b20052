"""A matmul's elementwise chain run apart from it, where the plan splits its contraction.

Where no mesh axis splits a matmul's contraction, XLA's TPU runs the elementwise ops that
alone read its output in the matmul's own kernel (`_epilogue.py`). Where one does, each
device's kernel makes a partial sum, which is reduced and written first, and the chain
runs apart. Three rules of XLA's TPU then set what the step holds, each read in the HLO
and buffer assignment libtpu 0.0.42.1 compiles for v5p chips (a bf16 Llama whose hidden
dim the data axis splits, plans 4 on 256 chips and 7 on 64 of the TPU bench; a float32
GPT's MLP with its hidden dim on model, tests/test_tpu_memory.py), and each priced per
plan by `_epilogue.unwritten`, as the chain only runs apart where the plan splits:

- A value the chain makes that matmuls alone read is made again inside each of them (a
  convolution fusion takes its operands' producers), where that reads strictly less than
  writing it once (`_fusion.written_for`): SwiGLU's hidden gradient times silu(gate),
  made from two all-reduced [b, s, ffn] tensors for two matmuls, is never written; the
  gate's gradient, made from three, is (2 x 3 reads against 3 + 1 + 2 either way).
- A kernel of the chain reads what it makes its value from when it runs: so the tensors
  it reads are held until then, though the jaxpr's own order of the chain's ops lets them
  go earlier (the last matmul that makes a fused value again reads them at its end). The
  Llama holds the gate, up and hidden gradient, all-reduced, as it makes the gate's
  gradient; the GPT its pre-activation and hidden gradient as it makes GELU's.
- A written value takes the buffer of a same-shaped operand it reads for the last time
  (XLA's buffer sharing), but not that of an element of a combined all-reduce's result:
  XLA's TPU joins independent all-reduces, up to `Lowering.all_reduce_combine_bytes` in
  all, into one tuple-shaped all-reduce, and writes a loop fusion that reads one of its
  elements into a buffer of its own (two bf16 partial sums of the same input, 60 MiB a
  chip each: one all-reduce, and the fusion reading both a third buffer; 64 MiB each:
  two all-reduces, and the fusion over the second's). Which partial sums XLA joins is
  priced as those of matmuls that read the same operand (`siblings`: the gate and up
  projections, the queries, keys and values), by their bytes a device under the plan.
"""

from __future__ import annotations

import numpy as np

from .._graph import Graph
from ._fusion import cone_reads, written_for

# Kinds of the rows `apart_rows` returns: a buffer held longer, or one a value takes over.
HELD, SHARED = 0, 1


def apart_rows(graph: Graph, consumers, spans, owner, spared, serves, in_memory):
    """({buffer's tensor: the matmul output whose split decides} for the chains' values
    made again inside their matmul readers, [n, 5] rows (buffer, first moment, last
    moment, that matmul output, kind)) for the chains of the matmul outputs `spared`
    (`owner`: the latest such output whose chain each elementwise op is of). `spans`:
    the step's buffers (tensor, birth, last op); `serves`: what each stored residual
    stands in for."""
    made = _chain_values(graph, spans[0], owner, spared, serves)
    reads = cone_reads(graph, in_memory, made)
    fused = _fused_operands(graph, consumers, made, reads)
    held, until = _held_longer(spans, made, fused, reads)
    shared = _shared(graph, consumers, spans, made, fused, reads, until)
    rows = [(c, spans[2][c] + 1, u, m, HELD) for c, (u, m) in sorted(held.items())]
    rows += [(c, at, at, m, SHARED) for c, at, m in shared]
    return {t: made[t] for t in fused}, np.array(rows, dtype=np.int64).reshape(-1, 5)


def siblings(graph: Graph, consumers, t: int) -> list[int]:
    """The outputs of the matmuls that read the operand matmul output t is made from, t's
    among them (of the same rank: not a weight's gradient): the partial sums XLA may join
    into one all-reduce with t's. t alone where no matmul makes it (no all-reduce)."""
    op = graph.ops[graph.tensors[t].producer]
    if op.primitive != "dot_general":
        return [t]
    rank = graph.tensors[t].ndim
    out = []
    for c in sorted(set(consumers[op.inputs[0]])):
        other = graph.ops[c]
        same = other.primitive == "dot_general" and other.inputs[0] == op.inputs[0]
        if same and graph.tensors[other.outputs[0]].ndim == rank:
            out.append(other.outputs[0])
    return out


def _chain_values(graph: Graph, tensor, owner, spared, serves) -> dict[int, int]:
    """{buffer's tensor: the spared matmul output} for the values the matmuls' chains
    write (not a residual stored in another's place)."""
    made = {}
    for t in set(tensor.tolist()):
        p = graph.tensors[t].producer
        if p in owner and owner[p] in spared and serves.get(t, {t}) == {t}:
            made[t] = owner[p]
    return made


def _fused_operands(graph: Graph, consumers, made, reads) -> set[int]:
    """Of the chains' written values (`made`), those that matmuls alone read and that XLA
    would rather make in each of them than write once, weighed on what each would read
    to make it (`reads`): only where that reads strictly less."""
    nbytes = [x.nbytes for x in graph.tensors]
    fused = set()
    for t in made:
        readers = set(consumers[t])
        if not readers or any(graph.ops[c].primitive != "dot_general" for c in readers):
            continue
        if not written_for(len(readers), sum(nbytes[r] for r in reads[t]), nbytes[t], True):
            fused.add(t)
    return fused


def _held_longer(spans, made, fused, reads):
    """({buffer: (last moment, matmul output)} for the buffers the chains' kernels read
    later than their last reader in the jaxpr, {buffer: last moment read} for every
    buffer they read): a written value's kernel reads as it makes it, a fused value's
    at its last reader. A tensor's buffer is its latest made by then (a recomputed
    tensor's, not the forward's)."""
    tensor, born, dies = spans
    longest: dict[int, tuple[int, int]] = {}
    until: dict[int, int] = {}
    for b in np.flatnonzero(np.isin(tensor, list(made))).tolist():
        t = int(tensor[b])
        last = int(dies[b] if t in fused else born[b])
        for r in reads[t]:
            mine = np.flatnonzero((tensor == r) & (born <= born[b]))
            if len(mine):
                c = int(mine[np.argmax(born[mine])])
                until[c] = max(until.get(c, int(dies[c])), last)
                if dies[c] < last and last > longest.get(c, (-1,))[0]:
                    longest[c] = (last, made[t])
    return longest, until


def _shared(
    graph: Graph, consumers, spans, made, fused, reads, until
) -> list[tuple[int, int, int]]:
    """(buffer, moment, matmul output) per written value of a chain that takes over the
    buffer of a same-shaped operand read last by its kernel: a lone partial sum's where
    one is (its siblings' are not joined), else the first's (`_epilogue.unwritten` tells
    per plan whether it is an element of a combined all-reduce, which it does not take)."""
    tensor, born, _ = spans
    out = []
    for b in np.flatnonzero(np.isin(tensor, list(made))).tolist():
        t = int(tensor[b])
        if t in fused:
            continue
        x = graph.tensors[t]
        last = [
            c
            for c, u in sorted(until.items())
            if u == born[b]
            and int(tensor[c]) in reads[t]
            and (graph.tensors[int(tensor[c])].shape, graph.tensors[int(tensor[c])].dtype)
            == (x.shape, x.dtype)
        ]
        if last:
            last.sort(key=lambda c: len(siblings(graph, consumers, int(tensor[c]))) > 1)
            out.append((last[0], int(born[b]), made[t]))
    return out
