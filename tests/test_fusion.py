"""What a fused kernel reads and writes, as the cost model charges it (`_cost/_fusion.py`,
`_fused_bytes`), held against XLA's compiled HLO where the CPU backend shows the rule.

A causal transformer's attention softmax is the case that matters: its [B, h, S, S] tensors
are the largest memory-bound traffic of a training step, so a kernel boundary charged there
that XLA does not make moves a whole step's price (Megatron's one-stage rows, issue 13)."""

import functools
import re

import jax
import numpy as np
import pytest

from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel
from automap._zoo import get_model

B, HEADS, S = 2, 2, 64
SPEC = get_model(
    "gpt-1.3b",
    layers=2,
    hidden=32,
    heads=HEADS,
    seq=S,
    vocab=128,
    batch=B,
    positions="learned",
)


@functools.cache
def step():
    args = SPEC.abstract_args()
    graph = capture(SPEC.step_fn, *args)
    hlo = jax.jit(SPEC.step_fn).lower(*args).compile().as_text()
    return graph, hlo


def entry_values(hlo: str) -> dict[str, tuple[str, list[str]]]:
    """{name: (result type, operand names)} of the ENTRY computation's instructions."""
    body = hlo[hlo.index("\nENTRY ") :]
    body = body[body.index("{\n") : body.index("\n}")]
    out = {}
    for line in body.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) [\w\-]+\((.*)", line)
        if m:
            args = m.group(3).split("), ")[0]
            out[m.group(1)] = (m.group(2).split("{")[0], re.findall(r"%([\w.\-]+)", args))
    return out


def charged(graph, cluster: Cluster) -> np.ndarray:
    """Bytes each op is charged for, unsharded."""
    rate = cluster.hbm_bandwidth * cluster.memory_efficiency
    return CostModel(graph, cluster).tables.op_coef * rate


@pytest.mark.slow  # a GPT compiled
def test_a_causal_mask_is_regenerated_in_each_fusion_never_written():
    graph, hlo = step()
    # XLA's CPU pipeline (its fusion rules for broadcasts are those of the GPU one) keeps
    # no [B, h, S, S] predicate buffer: the mask is made again from iota in every fusion
    # that reads it, though the backward reads it too.
    types = [t for t, _ in entry_values(hlo).values()]
    assert f"f32[{B},{HEADS},{S},{S}]" in types  # the scores are there
    assert f"pred[{B},{HEADS},{S},{S}]" not in types
    masks = {t.id for t in graph.tensors if t.shape == (B, HEADS, S, S) and t.dtype == "bool"}
    model = CostModel(graph, Cluster.preset("a100", devices=1))
    assert masks & set(model.residuals.saved), "the jaxpr keeps the mask for the backward"
    bytes_ = charged(graph, model.cluster)
    touching = [op.index for op in graph.ops if masks & {*op.inputs, *op.outputs}]
    assert touching and all(bytes_[i] == 0 for i in touching)


def softmax_sums(graph) -> list:
    """The forward's reduce_sum over exp(x - max) of each head: [B, h, S, S] -> [B, h, S]."""
    return [
        op
        for op in graph.ops
        if op.primitive == "reduce_sum"
        and graph.tensors[op.inputs[0]].shape == (B, HEADS, S, S)
        and graph.ops[graph.tensors[op.inputs[0]].producer].primitive == "exp"
    ]


def test_a_reduction_reads_back_what_its_producer_wrote_only_where_xla_does():
    graph, hlo = step()
    sums = softmax_sums(graph)
    assert sums
    exp_bytes = graph.tensors[sums[0].inputs[0]].nbytes
    sum_bytes = graph.tensors[sums[0].outputs[0]].nbytes
    # The CPU compiles the sum as a kernel of its own that reads exp(x - max) back from
    # memory: a fusion whose [B, h, S] result reads a [B, h, S, S] buffer.
    values = entry_values(hlo)
    reads_back = [
        name
        for name, (t, operands) in values.items()
        if t == f"f32[{B},{HEADS},{S}]"
        and any(values.get(o, ("",))[0] == f"f32[{B},{HEADS},{S},{S}]" for o in operands)
    ]
    assert reads_back
    cpu = charged(graph, Cluster.preset("cpu", devices=1))
    assert [cpu[op.index] for op in sums] == pytest.approx([exp_bytes + sum_bytes] * len(sums))
    # XLA's GPU pipeline fuses the sum into the kernel that writes exp (multi-output
    # fusion; on Ampere and later the Triton softmax fusion): only the sum is written.
    gpu = charged(graph, Cluster.preset("a100", devices=1))
    assert [gpu[op.index] for op in sums] == pytest.approx([sum_bytes] * len(sums))


def scores_tensors(graph, dtype: str) -> set[int]:
    return {t.id for t in graph.tensors if t.shape == (B, HEADS, S, S) and t.dtype == dtype}


def test_a_producer_two_kernels_need_is_read_by_both():
    # Softmax's backward sums dP * p over each row, then scales dP by the sum: two kernels
    # (the second needs the first's result), both fed by converting dP (bfloat16, from the
    # dot) to float32. XLA fuses the convert into both rather than write the float32 copy,
    # so each kernel reads dP and the saved exp(x - max).
    graph, _ = step()
    model = CostModel(graph, Cluster.preset("a100", devices=1))
    bytes_ = charged(graph, model.cluster)
    boundary = model.residuals.boundary
    dots = {op.index for op in graph.ops if op.primitive == "dot_general"}
    d_p = [t for t in scores_tensors(graph, "bfloat16") if graph.tensors[t].producer in dots]
    exp = [
        t
        for t in scores_tensors(graph, "float32")
        if graph.ops[graph.tensors[t].producer].primitive == "exp"
    ]
    big = graph.tensors[exp[0]].nbytes + graph.tensors[d_p[0]].nbytes
    row_sums = [
        op.index
        for op in graph.ops
        if op.index > boundary
        and op.primitive == "reduce_sum"
        and graph.tensors[op.inputs[0]].shape == (B, HEADS, S, S)
    ]
    readers = {i for op in graph.ops if op.primitive == "dot_general" for i in op.inputs}
    scaled = [
        graph.tensors[t].producer
        for t in scores_tensors(graph, "bfloat16")
        if t in readers
        and graph.tensors[t].producer > boundary
        and graph.tensors[t].producer not in dots
    ]
    assert len(row_sums) == len(scaled) == 2  # one per layer
    small = graph.tensors[exp[0]].nbytes / S  # [B, h, S]-sized operands and results
    for i in row_sums:
        assert big <= bytes_[i] <= big + 4 * small
    for i in scaled:
        out = graph.tensors[graph.ops[i].outputs[0]].nbytes
        assert big + out <= bytes_[i] <= big + out + 4 * small


def test_a_first_forward_under_remat_writes_nothing_the_recompute_makes_again():
    # With full recomputation the backward reads exp(x - max) from the recompute: the
    # first forward keeps nothing of it, so its kernel (the row sum's) does not write it.
    graph, _ = step()
    model = CostModel(graph, Cluster.preset("a100", devices=1))
    T = model.tables
    rate = model.cluster.hbm_bandwidth * model.cluster.memory_efficiency
    again = set(model.residuals.recomputed)
    exps = [
        op.index
        for op in graph.ops
        if op.primitive == "exp"
        and op.index in again
        and graph.tensors[op.outputs[0]].shape == (B, HEADS, S, S)
    ]
    assert exps  # the first layer is recomputed
    for i in exps:
        assert T.op_coef[i] * rate >= graph.tensors[graph.ops[i].outputs[0]].nbytes
        assert T.remat_op_coef[i] == 0
    # The layer's forward as a whole moves less the first time than when recomputed.
    assert T.remat_op_coef.sum() < T.op_coef[sorted(again)].sum()


def test_a_residual_stream_many_kernels_read_is_written_once():
    # Each block adds to the residual stream, and a layer norm's row sums and the next
    # add read it: fusing every add into every reader would read the whole history of
    # the stream again in each layer. XLA writes it (its priority fusion weighs the two);
    # so a layer norm's row sum reads one stream's worth, whatever the depth.
    graph, _ = step()
    bytes_ = charged(graph, Cluster.preset("a100", devices=1))
    boundary = CostModel(graph, Cluster.preset("a100", devices=1)).residuals.boundary
    stream = B * S * 32 * 4  # [B, S, hidden] float32
    sums = [
        op.index
        for op in graph.ops
        if op.index <= boundary
        and op.primitive == "reduce_sum"
        and graph.tensors[op.inputs[0]].shape == (B, S, 32)
    ]
    assert len(sums) >= 4  # two layer norms per block, mean and mean of squares
    assert all(bytes_[i] <= 2 * stream for i in sums)
