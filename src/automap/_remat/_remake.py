"""What a pipeline stage's forward hands its backward: the residuals worth keeping, the
cheap elementwise chains made again.

One jitted program lets XLA fuse an elementwise chain into each of its readers, so a
layer norm's float32 intermediates and the tanh-GELU's six tensors are never written. A
pipeline stage runs its forward and its backward as two programs, and every tensor the
backward reads from the forward is an output of the first: a buffer held per microbatch
in flight. So the runtime chooses, as a remat policy of "save the dots, remake the cheap
chains" (`jax.checkpoint_policies.dots_saveable`): a residual made by an elementwise or
layout op, read in the backward by fusible ops only (not a matmul's operand), is made
again in the backward from the tensors it comes from, when those cost less to keep than
it does (nothing for GELU's products of the stored matmul output and its tanh; the
previous layers' projection outputs for a layer norm's `x - mean`). The backward runs
those forward ops first; XLA fuses them into their readers there.

The runtime (`_run/_segments.remake_segments`) and the cost model
(`_cost/_traffic.stage_memory`) read the same `Remake`, so the price is the program's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from .._graph import Graph, TensorKind
from .._groups import ELEMENTWISE, FREE, REDUCE_SUM_LIKE
from .._pipeline import Partition, Phase

# What the backward may make again: elementwise and layout ops (transcendental ones too:
# Megatron's fused bias-GELU backward makes its tanh again from the GELU's input).
_REMAKES = ELEMENTWISE | FREE
# Readers that take a remade value inside their own fusion (a matmul does not: its
# operands are worth keeping).
FUSED_READERS = ELEMENTWISE | FREE | REDUCE_SUM_LIKE | {"transpose", "concatenate", "pad"}


@dataclasses.dataclass(frozen=True)
class Remake:
    """A stage backward's reads from its forward, and what it makes again instead."""

    stored: tuple[int, ...]  # tensors the backward reads from outside it (sorted)
    ops: tuple[int, ...]  # forward ops the backward runs again, program order
    remade: tuple[int, ...]  # the residuals (and chain values) those ops make again


def remake_residuals(
    graph: Graph, part: Partition, stage: int, reads: Collection[int], consumers=None
) -> Remake:
    """Of `reads` (what stage `stage`'s backward reads from outside it), those its
    forward makes and the backward can make again for less than it costs to keep them.

    In program order, a residual made by an elementwise or layout op that only fusible
    ops read outside the forward is made again from its chain's sources (walking back
    through such ops to tensors kept already, tensors made outside the forward, or ones
    an op not remade makes), where the sources that would be new buffers per microbatch
    hold fewer bytes than it: a narrowed copy is never traded for its wider source, nor
    a sum for two operands. Kept already: the backward's other reads, step inputs, and
    values made once per step (a causal mask of iotas)."""
    fwd = part.ops(stage, Phase.FWD)
    consumers = graph.consumers() if consumers is None else consumers
    inside = set(fwd)
    made = {t for i in fwd for t in graph.ops[i].outputs}
    stored = {t for t in reads if t not in made}
    remade: set[int] = set()
    for t in sorted((t for t in reads if t in made), key=lambda t: graph.tensors[t].producer):
        fused = _fused(graph, t, inside, consumers)
        chain = remade_chain(graph, t, inside, stored) if fused else None
        if chain is None:
            stored.add(t)
            continue
        through, sources = chain
        new = sum(
            graph.tensors[u].nbytes for u in sources - stored if _per_microbatch(part, graph, u)
        )
        if new < graph.tensors[t].nbytes:
            remade |= through
            stored |= sources
        else:
            stored.add(t)
    ops = sorted({graph.tensors[t].producer for t in remade})
    return Remake(tuple(sorted(stored)), tuple(ops), tuple(sorted(remade)))


def _per_microbatch(part: Partition, graph: Graph, t: int) -> bool:
    """Whether t is made once per microbatch (not a step input nor a per-step value)."""
    p = graph.tensors[t].producer
    return p is not None and part.op_phase[p].per_microbatch


def _fused(graph: Graph, t: int, inside: set[int], consumers) -> bool:
    """Whether every reader of t outside the forward takes it inside its own fusion."""
    return all(graph.ops[c].primitive in FUSED_READERS for c in consumers[t] if c not in inside)


def remade_chain(
    graph: Graph,
    t: int,
    inside: set[int],
    stored: set[int],
    runs: frozenset[str] | set[str] = _REMAKES,
    from_narrow: bool = False,
) -> tuple[set[int], set[int]] | None:
    """(the tensors made again to make t, t included; the tensors they are made from), or
    None where t's own op cannot be made again: the walk back through ops of `inside`
    whose primitive is in `runs`, stopping at `stored` tensors. `from_narrow`: a convert
    that widens a float is made again from its narrow input, not from what made that
    (selective recomputation's norm chains, `_chains.py`)."""
    through: set[int] = set()
    sources: set[int] = set()
    todo = [t]
    while todo:
        u = todo.pop()
        if u in through or u in sources:
            continue
        tensor = graph.tensors[u]
        p = tensor.producer
        if tensor.kind is TensorKind.CONST:
            continue  # the program's constants: every program has its own
        if u != t and u in stored:
            sources.add(u)
            continue
        if p is None or p not in inside or graph.ops[p].primitive not in runs:
            if u == t:
                return None
            sources.add(u)
            continue
        through.add(u)
        op = graph.ops[p]
        narrow = graph.tensors[op.inputs[0]].nbytes < tensor.nbytes
        if from_narrow and op.primitive == "convert_element_type" and narrow:
            sources.add(op.inputs[0])
            continue
        todo.extend(op.inputs)
    return through, sources


def generated(graph: Graph, part: Partition) -> dict[int, tuple[int, ...]]:
    """Values made once per step from nothing the step reads (a causal mask: iotas,
    compared and broadcast), each with the ops that make it, program order.

    The per-step programs would make each once and hold it all step for the programs
    that read it (one mask per layer, held by every stage's backward); the runtime makes
    it in each per-microbatch program that reads it instead, as XLA makes a broadcast of
    iotas inside each kernel that reads it (`_run/_segments.generate_in_readers`)."""
    return part.derived(graph, "generated", lambda: _generated(graph, part))


def _generated(graph: Graph, part: Partition) -> dict[int, tuple[int, ...]]:
    out: dict[int, tuple[int, ...]] = {}
    for op in graph.ops:
        if part.op_phase[op.index].per_microbatch or op.primitive not in _REMAKES:
            continue
        made = [t for t in op.inputs if graph.tensors[t].kind is not TensorKind.CONST]
        # A batched one (an iota over the batch) differs per microbatch: sliced, not made.
        if all(t in out for t in made) and part.batched.isdisjoint(op.outputs):
            chain = tuple(sorted({op.index, *(i for t in made for i in out[t])}))
            out.update((t, chain) for t in op.outputs)
    return out
