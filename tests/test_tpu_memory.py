"""What XLA's TPU holds in memory for a step, read in its buffer assignment on compile-only
v5p chips (`automap._verify._tpu`) and held against the cost model's TPU lowering."""

import dataclasses
import re

import jax
import pytest

import automap as am
from _scripts import load_script
from automap._capture import find_residuals
from automap._cost import CostModel, stored_residuals
from automap._groups import build_groups, plan_from_assignment
from automap._lowering import Lowering
from automap._verify import compile_plan, verify
from automap._zoo import get_model

# Every test here loads libtpu: `-m tpu_compile` selects them (tests/test_verify_tpu.py).
pytestmark = pytest.mark.tpu_compile


def _llama(layers: int, batch: int, ffn: int = 1536):
    """A bfloat16 Llama (hidden 512, SwiGLU `ffn`, 8 heads in 2 key/value groups, seq 128):
    (step, args), the step jitted with its state donated."""
    spec = get_model(
        "llama", layers=layers, hidden=512, heads=8, kv_heads=2, ffn=ffn, seq=128,
        vocab=4096, batch=batch, dtype="bfloat16",
    )  # fmt: skip
    return jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()


def _hidden_split(step, args, dump):
    """(graph, plan, compiled) of `step` with its residual stream's hidden dim split 4
    ways, under full remat, compiled for v5p 2x2x1 and dumped into the folder `dump`."""
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    hidden = groups.of(next(op for op in graph.ops if op.primitive == "dot_general").inputs[0], 2)
    plan = plan_from_assignment(graph, groups, {"model": 4}, {hidden: "model"})
    plan = dataclasses.replace(plan, remat=True)
    options = {"xla_dump_to": str(dump), "xla_dump_hlo_as_text": True}
    return graph, plan, compile_plan(step, plan, args, target="v5p:2x2x1", options=options)


@pytest.mark.slow  # compiled for 4 v5p chips: ~45 s on two loaded cores
def test_a_tpu_makes_a_bf16_swiglus_sigmoid_again_in_the_backward():
    # XLA's TPU stores a bf16 Llama's gate and up matmul outputs for the backward and
    # makes the SwiGLU's sigmoid again from the gate output in the backward's kernel
    # (negate, exp, add, divide fused there): no buffer holds it. Priced as the A100
    # keeps it (a bf16 transcendental stored as the float32 it is computed in, 2x its
    # bytes), the step is 1.08x XLA's buffers (1 layer, 32 sequences a chip); 0.97x as
    # the TPU keeps it (`_cost._residuals._remade_from`). The GPU still stores it.
    step, args = _llama(layers=1, batch=128)
    graph = am.capture(step, *args)
    saved = find_residuals(graph).saved
    made = lambda lowering: {  # noqa: E731
        graph.ops[graph.tensors[t].producer].primitive
        for t in stored_residuals(graph, saved, lowering)
        if graph.tensors[t].producer is not None
    }
    assert "logistic" in made(Lowering.gpu())
    assert "logistic" not in made(Lowering.tpu())
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=4), cluster=v5p)
    report = verify(step, plan, *args, target="v5p:2x2x1")
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.05)
    kept = CostModel(graph, v5p.with_lowering(fuses_matmul_operands=False)).estimate(plan)
    assert kept.memory_bytes > 1.05 * report.xla_memory_bytes


def _all_reduces_in_place(dump) -> tuple[int, int]:
    """(results written over their operand, results elsewhere) of every all-reduce in a
    TPU program's buffer assignment, `dump` its `xla_dump_to` folder: a result whose
    operand is a buffer of its own there (not a value XLA moved to VMEM) at that
    operand's allocation and offset, a combined all-reduce's per operand."""
    hlo = next(dump.glob("*jit_step*after_optimizations.txt")).read_text()
    text = next(dump.glob("*jit_step*after_optimizations-buffer-assignment.txt")).read_text()
    where, allocation = {}, None
    for line in text.splitlines():
        if line.startswith("allocation"):
            allocation = line.split(":")[0]
        elif m := re.match(r" value: <\d+ (\S+) @0> \(size=\d+,offset=(\d+)\)", line):
            where.setdefault(m.group(1), (allocation, int(m.group(2))))
    same = elsewhere = 0
    for m in re.finditer(r"%(all-reduce[.\d]*) = (\(.*?\)|\S+) all-reduce\(([^)]*)\)", hlo):
        name, combined = m.group(1), m.group(2).startswith("(")
        operands = [re.sub(r"/\*index=\d+\*/", "", o).strip(" %") for o in m.group(3).split(",")]
        for i, operand in enumerate(operands):
            result = where.get(f"{name}{{{i}}}" if combined else f"{name}{{}}")
            source = where.get(operand) or where.get(f"{operand}{{}}")
            if result and source:
                same, elsewhere = (
                    (same + 1, elsewhere) if result == source else (same, elsewhere + 1)
                )
    return same, elsewhere


@pytest.mark.slow  # compiled for 4 v5p chips: ~15 s on two loaded cores
def test_a_tpu_reduces_a_recomputed_layers_partial_sums_in_place(tmp_path):
    # A bf16 Llama whose residual stream's hidden dimension is split 4 ways, under full
    # remat: the gate and up matmuls contract the split dimension, so each recomputed
    # layer all-reduces their [64, 128, 1536] partial sums. XLA's GPU combiner copies a
    # combined all-reduce's operands into one buffer (`_buffers.combined_copies`); XLA's
    # TPU writes every all-reduce's result over its operand, so the recompute holds its
    # partial sums once (`Lowering.concatenates_combined`). Priced with the copies the
    # step is 1.26x XLA's buffers (2 layers, 64 sequences a chip); without, 1.07x: at
    # HBM's busiest step XLA's memory-space assignment holds the recomputed gate output
    # (bf16 [64, 128, 1536], 24 MiB) in the chip's VMEM, which `memory_analysis()` leaves
    # out and the model does not price (0.95x both memories' live bytes there). It was
    # 0.99x while the model made the recomputed softmax's exp again from the scores.
    step, args = _llama(layers=2, batch=64)
    graph, plan, compiled = _hidden_split(step, args, tmp_path)
    same, elsewhere = _all_reduces_in_place(tmp_path)
    assert same >= 8 and elsewhere == 0  # the layers' partial sums, twice under remat
    report = verify(step, plan, *args, target="v5p:2x2x1", compiled=compiled)
    assert report.collectives_match, report.mismatches
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.1)
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    copied = CostModel(graph, v5p.with_lowering(concatenates_combined=True)).estimate(plan)
    assert copied.memory_bytes > 1.2 * report.xla_memory_bytes


def _held(dump, compiled, report) -> float:
    """What a TPU program holds: libtpu's live peak (the arguments, the outputs and HBM's
    busiest temporaries) where HBM's temporaries are the busier; where the chip's VMEM
    holds more at its busiest, libtpu's figure is VMEM's alone, and what HBM and VMEM hold
    together at their busiest step is (`read_buffer_assignment.together`: an activation
    moved to VMEM counted there, a prefetched copy once)."""
    reader = load_script("read_buffer_assignment")
    hbm, vmem = reader.read(dump), reader.read(dump, space=reader.VMEM)
    if hbm.busiest()[1] >= vmem.busiest()[1]:
        return report.xla_live_peak_bytes
    _, in_hbm, in_vmem = reader.together(hbm, reader.apart(hbm, vmem))
    stats = compiled.memory_analysis()
    args = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    return args + in_hbm + in_vmem


def _output_fusion_ops(dump) -> list[set[str]]:
    """The ops of each output fusion (a matmul's kernel and what XLA fused into it) of a
    TPU program, `dump` its `xla_dump_to` folder."""
    hlo = next(dump.glob("*jit_step*after_optimizations.txt")).read_text()
    bodies = {
        m.group(1): m.group(2)
        for m in re.finditer(r"\n%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S)
    }
    fused = re.findall(r"fusion\([^\n]*kind=kOutput, calls=%([\w.\-]+)", hlo)
    return [set(re.findall(r"= \S+ ([\w-]+)\(", bodies.get(name, ""))) for name in fused]


@pytest.mark.slow  # compiled twice for 4 v5p chips: ~50 s on two loaded cores
@pytest.mark.parametrize("split", [False, True])
def test_a_tpu_runs_gelus_derivative_in_the_matmuls_kernel_where_its_contraction_is_whole(
    tmp_path, split
):
    # A 1-layer float32 GPT (hidden 512, 64 sequences) under full remat on v5p 2x2x1. At
    # data 4, XLA's TPU runs GELU's derivative (its tanh) times the incoming gradient, and
    # the bias gradient's sum, in the kernel of the backward matmul that makes that
    # gradient, which never writes its f32 [16, 128, 2048] output: priced as written (the
    # rule off) the step is 1.09x what XLA's program holds (`_held`: here HBM and VMEM at
    # once, VMEM the busier), as spared 1.02x (`_cost/_epilogue.py`). With the hidden dim
    # on model (4), the matmuls make partial sums to all-reduce first: no kernel runs GELU
    # beside a matmul, and the chain runs apart (`_cost/_apart.py`): its kernel holds the
    # all-reduced pre-activation and hidden gradient, and writes GELU's gradient over the
    # latter, which it reads last, so it holds what a matmul's kernel running it would
    # (1.04x XLA's live peak either way).
    spec = get_model(
        "gpt2-xl", layers=1, hidden=512, heads=4, seq=128, batch=64, vocab=512, dtype="float32"
    )
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    dot = next(op for op in graph.ops if op.primitive == "dot_general")
    wanted = {groups.of(dot.inputs[0], 2 if split else 0): "model" if split else "data"}
    plan = plan_from_assignment(graph, groups, {"model": 4} if split else {"data": 4}, wanted)
    plan = dataclasses.replace(plan, remat=True)
    dump = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True}
    compiled = compile_plan(step, plan, args, target="v5p:2x2x1", options=dump)
    derivative = {"convolution", "tanh", "multiply", "reduce"}  # with the bias gradient
    in_a_matmul = any(derivative <= ops for ops in _output_fusion_ops(tmp_path))
    assert in_a_matmul is not split
    report = verify(step, plan, *args, target="v5p:2x2x1", compiled=compiled)
    held = _held(tmp_path, compiled[1], report)
    assert report.predicted_memory_bytes == pytest.approx(held, rel=0.05)
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    written = CostModel(graph, v5p.with_lowering(fuses_matmul_epilogues=False)).estimate(plan)
    if split:
        assert written.memory_bytes == report.predicted_memory_bytes
    else:
        assert written.memory_bytes > 1.05 * held


def _written_over(dump, shape: str) -> list[tuple[bool, bool]]:
    """Per loop fusion of `shape` that a TPU program runs on all-reduced operands, `dump`
    its `xla_dump_to` folder: (whether it writes over one of those operands' buffers,
    whether one of them is an element of a combined all-reduce's result)."""
    hlo = next(dump.glob("*jit_step*after_optimizations.txt")).read_text()
    text = next(dump.glob("*jit_step*after_optimizations-buffer-assignment.txt")).read_text()
    where = {}
    for m in re.finditer(r" value: <\d+ (\S+) @0> \(size=\d+,offset=(\d+)\)", text):
        where.setdefault(m.group(1), int(m.group(2)))
    element = {  # a get-tuple-element of a combined all-reduce -> that element's value
        m.group(1): f"{m.group(2)}{{{m.group(3)}}}"
        for m in re.finditer(
            r"%([\w.\-]+) = \S+ get-tuple-element\(%(all-reduce[.\d]*)\), index=(\d)", hlo
        )
    }
    out = []
    pattern = rf"\n  %([\w.\-]+) = {re.escape(shape)}\{{[^}}]*\}} fusion\(([^)]*)\), kind=kLoop"
    for m in re.finditer(pattern, hlo):
        operands = [o.strip(" %") for o in m.group(2).split(",")]
        reduced = [
            element.get(o, o) for o in operands if o.startswith("all-reduce") or o in element
        ]
        if reduced:
            over = where.get(m.group(1)) in {where.get(r) for r in reduced}
            out.append((over, any(r.endswith("}") for r in reduced)))
    return out


@pytest.mark.slow  # compiled once for 4 v5p chips: ~30 s on two loaded cores
@pytest.mark.parametrize("batch", [128, 48])
def test_a_tpu_runs_a_split_swiglus_backward_apart_from_its_matmuls(tmp_path, batch):
    # A 1-layer bf16 Llama whose hidden dim (512) is split 4 ways, SwiGLU 4096, remat: the
    # gate, up and down matmuls contract the split dim, so the backward's chain runs apart
    # from them (`_cost/_apart.py`). XLA's TPU makes the hidden gradient times silu(gate)
    # again in both matmuls that read it, and holds the gate, up and hidden gradient,
    # all-reduced, while it makes the gate's gradient. At 128 sequences the gate and up
    # partial sums (128 MiB a chip each) are two all-reduces, and that gradient is
    # written over one of them: priced so, 0.95x XLA's buffers; as the matmuls' own
    # epilogues would run it, 1.22x. At 48 (48 MiB each) they are one combined
    # all-reduce, whose elements it is not written over: 0.95x; as if written over one,
    # 0.76x.
    step, args = _llama(layers=1, batch=batch, ffn=4096)
    graph, plan, compiled = _hidden_split(step, args, tmp_path)
    over = _written_over(tmp_path, f"bf16[{batch},128,4096]")
    if batch == 128:
        assert (True, False) in over and not any(joined for _, joined in over)
    else:
        assert (False, True) in over and (True, True) not in over
    report = verify(step, plan, *args, target="v5p:2x2x1", compiled=compiled)
    xla = report.xla_memory_bytes
    assert report.predicted_memory_bytes == pytest.approx(xla, rel=0.1)
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    if batch == 128:
        together = v5p.with_lowering(fuses_matmul_epilogues=False)
        assert CostModel(graph, together).estimate(plan).memory_bytes > 1.15 * xla
    else:
        lone = v5p.with_lowering(all_reduce_combine_bytes=0.0)
        assert CostModel(graph, lone).estimate(plan).memory_bytes < 0.85 * xla
