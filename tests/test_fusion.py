"""What a fused kernel reads and writes, as the cost model charges it (`_cost/_fusion.py`,
`_fused_bytes`), held against XLA's compiled HLO where the CPU backend shows the rule.

A causal transformer's attention softmax is the case that matters: its [B, h, S, S] tensors
are the largest memory-bound traffic of a training step, so a kernel boundary charged there
that XLA does not make moves a whole step's price (Megatron's one-stage rows, issue 13)."""

import functools
import math
import re

import jax
import numpy as np
import pytest

from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel, layout_rate, seqpar_terms
from automap._groups import layouts
from automap._search import Problem
from automap._space import Recipe, recipe_plan
from automap._verify import compile_plan, shape_bytes
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
    # XLA's GPU pipeline writes no exp(x - max): the softmax runs in one kernel (on Ampere
    # and later the Triton softmax fusion), and the backward makes what it reads of it
    # again from the scores (`_cost/_residuals.py`; the A100 program of this GPT
    # holds no float32 [B, h, S, S] buffer). No kernel writes it, so none reads it back:
    # the sum reads the 16-bit scores it is made from.
    gpu = charged(graph, Cluster.preset("a100", devices=1))
    assert all(gpu[graph.tensors[op.inputs[0]].producer] == 0 for op in sums)
    assert all(sum_bytes < gpu[op.index] < exp_bytes for op in sums)


def scores_tensors(graph, dtype: str) -> set[int]:
    return {t.id for t in graph.tensors if t.shape == (B, HEADS, S, S) and t.dtype == dtype}


def test_a_producer_two_kernels_need_is_read_by_both():
    # Softmax's backward sums dP * p over each row, then scales dP by the sum: two kernels
    # (the second needs the first's result), both fed by converting dP (bfloat16, from the
    # dot) to float32. XLA fuses the convert into both rather than write the float32 copy,
    # so each kernel reads dP, and the 16-bit scores p is made again from (a GPU stores
    # no exp(x - max): `_cost/_residuals.py`).
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
    big = 2 * graph.tensors[d_p[0]].nbytes  # dP and the scores, both bfloat16
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
    # The GELU's tanh (an expensive result, stored for the backward where nothing is
    # recomputed) is made again by the recompute under full recomputation: the first
    # forward keeps nothing of it, so its kernel does not write it.
    graph, _ = step()
    model = CostModel(graph, Cluster.preset("a100", devices=1))
    T = model.tables
    rate = model.cluster.hbm_bandwidth * model.cluster.memory_efficiency
    again = set(model.residuals.recomputed)
    tanhs = [op.index for op in graph.ops if op.primitive == "tanh" and op.index in again]
    assert tanhs  # the first layer is recomputed
    for i in tanhs:
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


def entry_kernels(hlo: str) -> list[tuple[str, list[str]]]:
    """Per memory-bound kernel of the ENTRY computation (a fusion other than a matmul's):
    the array types it writes and reads, as "bf16[1,2048,6144]"."""
    body = hlo[hlo.index("\nENTRY ") :]
    body = body[body.index("{\n") : body.index("\n}")]
    types, out = {}, []
    for line in body.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)", line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        types[name] = re.findall(r"[a-z]\w*\[[\d,]*\]", shape)
        operands = re.findall(r"%([\w.\-]+)", rest[: rest.find(")")])
        called = rest.partition("calls=")[2].split(",")[0]
        if opcode == "fusion" and "gemm" not in name + called:  # not a Triton matmul
            out.append((types[name], [x for o in operands for x in types.get(o, [])]))
    return out


def stream_bytes(
    batch: int, seq: int, sequence_parallel: bool, clip_norm: float | None = None
) -> tuple[float, float]:
    """(model, XLA) bytes per device of the memory-bound kernels that read or write the
    residual stream ([batch x sequence, hidden], whole or split on the sequence), on a
    2-layer bf16 GPT of Korthikanti's 22B width at tp 8 compiled for 8 A100s. The model's:
    each op's priced kernel, on 1/t of the sequence where sequence parallelism runs it so,
    and its layout transposes (`seqpar_terms`, as `CostModel.estimate` reads them)."""
    hidden, t = 6144, 8
    spec = get_model(
        "gpt-1.3b", layers=2, hidden=hidden, heads=64, seq=seq, batch=batch, vocab=1024,
        dtype="bfloat16", positions="learned", softmax="fused", clip_norm=clip_norm,
    )  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    cluster = Cluster.preset("a100", devices=t)
    problem = Problem.build(step, args, cluster)
    graph = problem.graph
    plan = recipe_plan(
        graph, problem.groups, cluster, Recipe(tp=t, sequence_parallel=sequence_parallel)
    )
    # XLA's Triton GEMM finds no tiling for the sequence-parallel program's matmuls
    options = {"xla_gpu_enable_triton_gemm": False} if sequence_parallel else None
    hlo = compile_plan(step, plan, args, target="a100", options=options)[1].as_text()
    rows = batch * seq
    counted = (rows, rows // t) if sequence_parallel else (rows,)

    def stream(x: str) -> bool:
        dims = [int(d) for d in x[x.index("[") + 1 : -1].split(",") if d and d != "1"]
        return len(dims) >= 2 and dims[-1] == hidden and math.prod(dims[:-1]) in counted

    xla = sum(
        sum(shape_bytes(x) for x in (*written, *read))
        for written, read in entry_kernels(hlo)
        if any(stream(x) for x in (*written, *read))
    )
    lay = layouts(graph, problem.groups, plan.assignment)
    whole = {
        x.id
        for x in graph.tensors
        if x.ndim and x.shape[-1] == hidden and x.size == rows * hidden and not any(lay[x.id])
    }
    rate = cluster.hbm_bandwidth * cluster.memory_efficiency
    split, transposed = frozenset(), ()
    if sequence_parallel:
        terms = seqpar_terms(graph, problem.groups, plan, layout_rate=layout_rate(cluster))
        split, transposed = terms.compute_ops, terms.transposed
    charged = sum(
        seconds * rate / (t if i in split else 1)
        for i, seconds, _ in problem.estimate(plan).per_op
        if graph.ops[i].primitive != "dot_general"
        and whole.intersection((*graph.ops[i].inputs, *graph.ops[i].outputs))
    )
    return charged + rate * sum(transposed), xla


@pytest.mark.slow  # a 2-layer GPT of the 22B width compiled for 8 A100s (about 10 s)
@pytest.mark.gpu_compile
def test_the_residual_streams_kernels_move_what_xlas_a100_fusions_move():
    # The stream's norms, adds and casts on a 2-layer bf16 GPT of Korthikanti's 22B width
    # at tp 8 (the stream held whole on each device): XLA's A100 kernels that read or write
    # a [batch x sequence, hidden] tensor move 3.25 GB; the model charged 5.25 GB while its
    # kernels wrote each residual the jaxpr saves, 2.93 GB while they wrote the stream in
    # 16 bits and its norms' statistics read it back twice, 3.16 GB now. They write what
    # XLA stores (`_cost/_residuals.py`): the layer norms' float32 `2x`, `x - mean` and
    # `rsqrt(var) * scale`, which the jaxpr saves for the backward, are made again in
    # their readers; and the kernel that makes a norm's input writes its float32 value
    # beside both statistics (`_fusion.statistics_operand`), which its readers read.
    charged, xla = stream_bytes(batch=1, seq=2048, sequence_parallel=False)
    assert charged == pytest.approx(xla, rel=0.05)


@pytest.mark.slow  # the same GPT at microbatch 4, sequence-parallel (about 15 s)
@pytest.mark.gpu_compile
def test_a_sequence_parallel_streams_kernels_move_what_xlas_a100_fusions_move():
    # Split on the sequence over tp 8, the batch-major stream ([4, 2048, 6144]) is
    # gathered and reduce-scattered sequence-major (an A100's collectives work on the
    # major dim: `Lowering.major_dim_collectives`), and XLA transposes each gathered copy
    # a matmul reads (twice where a weight gradient reads a gathered cotangent) and each
    # scattered matmul output: 20 kernels of 201 MB, and two adds of partial sums that
    # write the collective's layout. Every kernel on the stream runs on its 1/8 (the
    # norms' statistics and backward too, not only the ops that write split tensors),
    # the adds of partial sums before their reduce-scatter on the whole buffer. XLA's
    # kernels move 6.66 GB; the model charged 5.13 GB without the transposes, its
    # reductions whole and its partial sums' adds on 1/8; 6.45 GB now. (Gradients clipped,
    # as Korthikanti's: unclipped, XLA fuses the position table's gradient into its Adam
    # update, a kernel this count would take for the stream's.)
    charged, xla = stream_bytes(batch=4, seq=2048, sequence_parallel=True, clip_norm=1.0)
    assert charged == pytest.approx(xla, rel=0.05)
