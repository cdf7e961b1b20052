"""Which residuals XLA stores for the backward (`_cost/_residuals.py`, `stored_residuals`), held
against the compiled program's buffer assignment (`memory_analysis()`).

A GELU MLP is the case that matters: the jaxpr's linearization keeps six [N, F] tensors of
GELU's chain (x^3, the tanh's argument, 1 + tanh, 0.5 x...), XLA stores three (the
matmul output, the tanh, the second matmul's operand) and makes the rest again inside the
backward's fusions. Pricing the jaxpr's set over-predicted transformers 1.2-1.6x
(benchmarks/bench_memory.py)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from automap import Lowering
from automap._capture import capture, find_residuals
from automap._cost import step_buffers, stored_residuals
from automap._zoo import fused_softmax

N, D = 256, 64


def gelu_mlp(width: int):
    def loss(w1, w2, x):
        return jnp.sum((jax.nn.gelu(x @ w1) @ w2) ** 2)

    def step(w1, w2, x):
        return jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x)

    f32 = jnp.float32
    args = (
        jax.ShapeDtypeStruct((D, width), f32),
        jax.ShapeDtypeStruct((width, D), f32),
        jax.ShapeDtypeStruct((N, D), f32),
    )
    return step, args


@functools.cache
def measured(width: int):
    step, args = gelu_mlp(width)
    temp = jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes
    graph = capture(step, *args)
    saved = find_residuals(graph).saved
    stored = stored_residuals(graph, saved, Lowering.cpu())  # compiled here, on the CPU
    nbytes = lambda ts: sum(graph.tensors[t].nbytes for t in ts)  # noqa: E731
    return graph, temp, nbytes(saved), nbytes(stored), stored


@pytest.mark.parametrize("width", [256, 1024])
def test_xla_stores_the_tanh_and_the_matmul_outputs_of_gelu_not_its_chain(width):
    graph, temp, saved, stored, ts = measured(width)
    act = N * width * 4
    prims = sorted(graph.ops[graph.tensors[t].producer].primitive for t in ts)
    # The expensive tanh and the matmul outputs stay; the cheap chain is made again.
    assert "tanh" in prims and not {"add", "sub", "integer_pow"} & set(prims)
    assert stored == pytest.approx(3 * act, rel=0.2)
    # XLA's temporaries at its peak (the stored residuals plus the backward's own work)
    # cannot hold the jaxpr's residuals, and do hold the stored ones.
    assert saved > temp >= stored
    assert stored >= 0.7 * temp


def test_a_gpu_softmax_backward_reads_the_scores_it_remakes_its_probabilities_from():
    # Megatron's fused softmax in bfloat16 keeps 16-bit probabilities for its backward,
    # which converts them back to float32. XLA's GPU pipeline drops that round trip
    # (excess precision) and makes the float32 softmax again from the scores inside the
    # backward's kernel (a Triton row fusion, reductions and exp included): it keeps the
    # scores, and the 16-bit probabilities the value matmul reads. Without the GPU's rules
    # (`Lowering.cpu()`) only the probabilities are kept.
    b16 = jnp.bfloat16
    s = 16

    def loss(q, k, v):
        scores = jnp.einsum("bqd,bkd->bqk", q, k)
        probs = fused_softmax(scores, 0.125, jnp.tril(jnp.ones((s, s), bool))[None])
        return jnp.sum(jnp.einsum("bqk,bkd->bqd", probs, v).astype(jnp.float32) ** 2)

    args = [jax.ShapeDtypeStruct((4, s, 32), b16)] * 3
    graph = capture(jax.grad(loss, argnums=(0, 1, 2)), *args)
    saved = find_residuals(graph).saved
    made = lambda ts: {graph.ops[graph.tensors[t].producer].primitive for t in ts}  # noqa: E731
    square = lambda ts: [t for t in ts if graph.tensors[t].shape == (4, s, s)]  # noqa: E731
    gpu = square(stored_residuals(graph, saved, Lowering.gpu()))
    jaxpr = square(stored_residuals(graph, saved, Lowering.cpu()))
    assert made(jaxpr) == {"convert_element_type"}  # the 16-bit probabilities
    assert made(gpu) == {"convert_element_type", "dot_general"}  # and the scores
    assert all(graph.tensors[t].dtype == "bfloat16" for t in gpu)


def test_a_recomputed_layers_gelu_is_made_again_in_its_backward_on_a_gpu():
    # The first forward makes GELU's tanh in the kernel feeding the second matmul and XLA's
    # GPU pipeline keeps it there for the backward. A layer's recompute runs only what its
    # backward reads, no such kernel: XLA fuses the tanh into the backward's readers (one
    # kernel makes the GELU for the weight gradient and the input gradient) and stores the
    # matmul output alone (read on compile-only A100s: tests/test_verify_gpu.py holds
    # three remat plans' buffer assignment, 1.10-1.16x it when the tanh was priced kept).
    step, args = gelu_mlp(256)
    graph = capture(step, *args)
    saved = find_residuals(graph).saved
    made = lambda ts: sorted(graph.ops[graph.tensors[t].producer].primitive for t in ts)  # noqa: E731
    once = made(stored_residuals(graph, saved, Lowering.gpu()))
    again = made(stored_residuals(graph, saved, Lowering.gpu(), recomputed=True))
    assert "tanh" in once and "tanh" not in again
    assert again == [p for p in once if p != "tanh"]  # the matmul outputs stay
    # The CPU's lowering makes nothing again by fusion rules: the same set either way.
    cpu = Lowering.cpu()
    assert stored_residuals(graph, saved, cpu, recomputed=True) == stored_residuals(
        graph, saved, cpu
    )


def _norm_block():
    """A mixed-precision pre-norm residual block: bf16 stream, its layer norm in float32
    (as Flax's LayerNorm with dtype bf16 and float32 scale and bias runs it)."""
    b16, f32 = jnp.bfloat16, jnp.float32

    def norm(x, scale, bias):
        x = x.astype(f32)
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return ((x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias).astype(b16)

    def loss(w, scale, bias, x):
        h = x + norm(x, scale, bias) @ w.astype(b16)  # the stream's sum, bf16
        return jnp.sum(norm(h, scale, bias).astype(f32) ** 2)

    args = (
        jax.ShapeDtypeStruct((D, D), f32),
        jax.ShapeDtypeStruct((D,), f32),
        jax.ShapeDtypeStruct((D,), f32),
        jax.ShapeDtypeStruct((4, N, D), b16),
    )
    return capture(jax.grad(loss, argnums=(0, 1, 2)), *args)


def test_a_gpu_keeps_a_bf16_streams_sums_and_its_norms_scale_operands_in_float32():
    # XLA's GPU pipeline runs a bf16 add in float32 on an A100 and, where a norm converts
    # the sum back to float32, drops the round trip: the kernel writes the float32 sum;
    # the norm's scale gradient, a column reduction, reads an operand written in float32
    # by a kernel of its own (read on compile-only A100s: tests/test_seqpar.py). Hopper
    # adds in bf16; without `float32_norm_buffers` neither is priced.
    graph = _norm_block()
    res, consumers = find_residuals(graph), graph.consumers()
    sums = [
        t.id
        for t in graph.tensors
        if t.producer is not None
        and t.producer <= res.boundary
        and graph.ops[t.producer].primitive == "add"
        and t.dtype == "bfloat16"
    ]
    assert len(sums) == 1
    off = dataclasses.replace(Lowering.gpu(), float32_norm_buffers=False)

    def widths(lowering):
        buf = step_buffers(graph, res, consumers, False, lowering)
        return {int(t): float(w) for t, w in zip(buf.tensor, buf.width, strict=True)}, buf

    (gpu, buf), (hopper, _), (_, plain_buf) = map(widths, (Lowering.gpu(), Lowering.hopper(), off))
    assert gpu[sums[0]] == 2.0 and hopper[sums[0]] == 1.0
    operands = set(buf.tensor.tolist()) - set(plain_buf.tensor.tolist())
    assert operands and all(graph.tensors[t].dtype == "float32" for t in operands)
    for t in operands:  # each from its maker to its column reduction
        reduce = [graph.ops[c] for c in consumers[t] if graph.ops[c].primitive == "reduce_sum"]
        assert reduce and graph.tensors[reduce[0].outputs[0]].shape == (D,)
    assert np.all(buf.birth <= buf.death)
