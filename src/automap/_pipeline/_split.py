"""The backward of a pipeline stage split in two: what the stage sends upstream (B), and
the weight gradients (W), which a zero-bubble schedule may run later.

Qi et al. ("Zero Bubble Pipeline Parallelism", ICLR 2024) split each microbatch's
backward into B, the gradient with respect to the stage's input, which the stage before
waits for, and W, the gradient with respect to the stage's parameters, which nothing
downstream of it in the pipeline waits for. Here the split is read off the captured step
rather than taken as two vjps: a stage's backward op is W when everything it makes
flows only into weight gradients (accumulated tensors, summed over microbatches) through
other W ops of its stage, or into the update; every other backward op is B. W's
programs then read B's outputs (each layer's output gradient) and the forward's
residuals; B's read only what the input gradient needs. That is the pair of vjps taken
from the same residuals with XLA pruning what each does not need, made explicit.

On the first stage nothing goes upstream, so its whole backward is W; on the others B
holds the chain of activation gradients through the stage's layers and W the matmuls
`x^T dy` (and the reductions for biases and norm scales) beside it.
"""

from __future__ import annotations

import dataclasses

from .._graph import Graph
from ._partition import Partition
from ._phase import Phase


def split_backward(graph: Graph, part: Partition) -> Partition:
    """`part` with each stage's weight-gradient-only backward ops moved from BWD to WGT
    (see the module doc). The same partition where no op moves (a step without
    parameters, or one already split)."""
    consumers = graph.consumers()
    accumulated = set(part.accumulated)
    phase = list(part.op_phase)

    def weight_only(t: int, stage: int) -> bool:
        if t in accumulated:
            return True
        return all(
            phase[c] is Phase.POST or (phase[c] is Phase.WGT and part.op_stage[c] == stage)
            for c in consumers[t]
        )

    # Readers come after their producer in program order: walk it backwards so each op
    # sees its readers' phases already decided.
    for i in reversed(range(len(graph.ops))):
        if phase[i] is Phase.BWD:
            s = part.op_stage[i]
            if all(weight_only(t, s) for t in graph.ops[i].outputs):
                phase[i] = Phase.WGT
    if phase == list(part.op_phase):
        return part
    return dataclasses.replace(part, op_phase=tuple(phase))
