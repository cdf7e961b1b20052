"""What XLA's TPU holds in memory for a step, read in its buffer assignment on compile-only
v5p chips (`automap._verify._tpu`) and held against the cost model's TPU lowering."""

import jax
import pytest

import automap as am
from automap._capture import find_residuals
from automap._cost import CostModel, stored_residuals
from automap._lowering import Lowering
from automap._verify import verify
from automap._zoo import get_model

# Every test here loads libtpu: `-m tpu_compile` selects them (tests/test_verify_tpu.py).
pytestmark = pytest.mark.tpu_compile


def _llama(layers: int, batch: int):
    """A bfloat16 Llama (hidden 512, SwiGLU 1536, 8 heads in 2 key/value groups, seq 128):
    (step, args), the step jitted with its state donated."""
    spec = get_model(
        "llama", layers=layers, hidden=512, heads=8, kv_heads=2, ffn=1536, seq=128,
        vocab=4096, batch=batch, dtype="bfloat16",
    )  # fmt: skip
    return jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()


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
