"""What selective recomputation makes again besides the attention cores: each layer norm's
float32 chain, from the bf16 tensor it widens (Megatron-LM keeps a norm's bf16 input,
Korthikanti et al.'s 2sbh per norm, and its fused kernel widens it again in the backward).

One jitted program leaves XLA to choose what its backward reads: on an A100 it keeps the
forward's float32 copies of the stream (the norm's `x - mean`, its `x * 2/n`, each 4sbh)
for the norms' backward, fused with the residual add that makes them, and frees the bf16
sum. A chain unit makes those values again in the backward from the bf16 sum, which then
stays alive in their place (`_recompute.recompute_units` keeps a unit's inputs): what
Megatron keeps.

A chain is found from the program, as `_remake.remake_residuals` finds a pipeline stage's:
a residual of a layer (outside its attention core) made by elementwise, layout or
summing ops, read in the backward only by ops that take it inside their own fusion, made
again from the tensors its chain starts from (walking back through such ops, stopping at
what a widening convert reads, at a value kept anyway, and at any other op's output),
where those hold fewer bytes than it: a float32 copy of a bf16 sum is made again, a sum
of two bf16 operands (a GELU's input, as wide as both) is not.

Under sequence parallelism a norm's output, kept split, is read afresh by the backward
(`regathered_reads`, `Recompute.rereading`), so that XLA gathers it again for the weight
gradients as Megatron-LM does, instead of keeping the forward's gathered copy. On a
2-layer bf16 GPT at tp 8 compiled for A100s (tests/test_seqpar.py) the two together took
XLA's buffer assignment from 114.4 to 98.0 MB (plain) and 73.5 to 54.6 MB (split).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .._graph import Graph, TensorKind
from .._groups import ELEMENTWISE, FREE, REDUCE_SUM_LIKE
from .._plan import Plan
from ._remake import FUSED_READERS, remade_chain

# What a chain runs again: elementwise, layout and summing ops (a norm's mean and
# variance), fused by XLA into the backward kernels that read them.
_CHAIN = ELEMENTWISE | FREE | REDUCE_SUM_LIKE
_WIDENS = "convert_element_type"
_DOT = "dot_general"


def widened_chains(
    graph: Graph,
    layers: Sequence[Sequence[int]],
    cores: Sequence[Sequence[int]],
    saved: Collection[int],
    boundary: int,
) -> tuple[tuple[int, ...], ...]:
    """The chains (forward ops, program order) that selective recomputation makes again
    in `layers` (outside `cores`, the attention cores), one unit per set of chains that
    share an op (a norm's). `saved`: the tensors the backward reads from the forward."""
    consumers = graph.consumers()
    units: list[set[int]] = []
    for layer, core in zip(layers, cores, strict=True):
        inside = set(layer) - set(core)
        made = {t for i in inside for t in graph.ops[i].outputs}
        residuals = sorted((t for t in saved if t in made), key=lambda t: graph.tensors[t].producer)
        kept = {t for t in saved if t not in made}
        chains: list[set[int]] = []
        for t in residuals:
            fused = _fused(graph, t, boundary, consumers)
            chain = remade_chain(graph, t, inside, kept, _CHAIN, True) if fused else None
            if chain is None:
                kept.add(t)
                continue
            through, sources = chain
            ops = {graph.tensors[u].producer for u in through}
            new = sum(graph.tensors[u].nbytes for u in sources - kept)
            if new < graph.tensors[t].nbytes and _widened(graph, ops):
                chains.append(ops)
                kept |= sources
            else:
                kept.add(t)
        units += _merged(chains)
    return tuple(tuple(sorted(u)) for u in sorted(units, key=min))


def _fused(graph: Graph, t: int, boundary: int, consumers) -> bool:
    """Whether every backward reader of t takes it inside its own fusion."""
    return all(graph.ops[c].primitive in FUSED_READERS for c in consumers[t] if c > boundary)


def _widened(graph: Graph, ops: set[int]) -> bool:
    """Whether the chain widens a narrower float (a norm's float32 from a bf16 sum). A
    GELU's chain made again too (Megatron's fused bias-GELU backward remakes its tanh)
    took XLA's float32 tanh off the split plan's peak (2-layer bf16 GPT, tp 8, A100: 54.6
    -> 52.5 MB), but the plain plan's price fell further than what XLA holds (81.8 -> 73.5
    MB against 98.0 -> 93.3): left to XLA until the model prices that plan's peak."""
    for i in ops:
        op = graph.ops[i]
        if op.primitive != _WIDENS:
            continue
        src, out = graph.tensors[op.inputs[0]], graph.tensors[op.outputs[0]]
        if src.nbytes < out.nbytes and src.kind is not TensorKind.CONST:
            return True
    return False


def _merged(chains: list[set[int]]) -> list[set[int]]:
    """`chains` joined where they share an op (one norm's: made again at once)."""
    out: list[set[int]] = []
    for chain in chains:
        hits = [u for u in out if u & chain]
        for u in hits:
            out.remove(u)
            chain = chain | u
        out.append(chain)
    return out


def regathered_reads(
    graph: Graph, plan: Plan, layers: Sequence[Sequence[int]], boundary: int
) -> tuple[int, ...]:
    """Under sequence parallelism, the split stream tensors a layer (of `layers`) makes
    that a backward matmul reads whole (each norm's output, for its weight gradients):
    Megatron-LM keeps them split and gathers them again in the backward (Korthikanti et
    al. §4.2.2), where one program left to XLA keeps the forward's gathered copy (4 x 4
    MB at the peak of a 2-layer GPT at tp 8 for A100s, tests/test_seqpar.py). Not the
    head's: the backward reads it first, before the copy would have died."""
    consumers, inside = graph.consumers(), {i for layer in layers for i in layer}
    out = []
    for t in split_constraints(plan):
        p = graph.tensors[t].producer
        if p not in inside or p > boundary:
            continue
        if any(c > boundary and graph.ops[c].primitive == _DOT for c in consumers[t]):
            out.append(t)
    return tuple(sorted(out))


def split_constraints(plan: Plan) -> tuple[int, ...]:
    """The tensors `plan` constrains split on its sequence-parallel axis (none without
    one): what `regathered_reads` picks from, so a part of the cost model's key for it."""
    axis = plan.sequence_parallel
    if axis is None:
        return ()
    return tuple(sorted(t for t, spec in plan.constraints.items() if axis in _axes(spec)))


def _axes(spec) -> set[str]:
    out: set[str] = set()
    for e in spec:
        out.update([e] if isinstance(e, str) else (e or ()))
    return out
