"""A matmul's seconds by its shape (`_cost/_gemm.py`): tile quantization under a roofline,
at the preset's large-GEMM rate. Each test pins one mechanism on a captured product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel, GemmShape, gemm_shape, matmul_seconds, tile_efficiency
from automap._errors import ClusterError


def _dot(m: int, k: int, n: int, batch: int = 0):
    """The captured graph of one bf16 product and its dot_general op."""
    lead = (batch,) if batch else ()
    x = jax.ShapeDtypeStruct((*lead, m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((*lead, k, n), jnp.bfloat16)
    graph = capture(lambda a, b: jnp.matmul(a, b), x, w)
    (op,) = [o for o in graph.ops if o.primitive == "dot_general"]
    return graph, op


def test_gemm_shape_reads_batch_m_n_k():
    graph, op = _dot(96, 256, 320, batch=3)
    assert gemm_shape(op, graph) == GemmShape(batch=3, m=96, n=320, k=256)


def test_whole_tiles_waste_nothing_and_a_partial_tile_runs_whole():
    assert tile_efficiency(GemmShape(1, 4096, 2304, 6144), 64) == 1.0
    # An attention head of 96 as the contraction runs as 128: 3/4 of the work is useful.
    assert tile_efficiency(GemmShape(64, 2048, 2048, 96), 64) == pytest.approx(0.75)
    # Each of M, N, K rounds on its own.
    assert tile_efficiency(GemmShape(1, 65, 64, 64), 64) == pytest.approx(65 / 128)
    assert tile_efficiency(GemmShape(1, 65, 64, 64), 1) == 1.0


def test_large_product_runs_at_the_large_gemm_rate():
    graph, op = _dot(4096, 4096, 4096)
    seconds = matmul_seconds(op, graph, flop_rate=200e12, byte_rate=1e12, tile=64)
    assert seconds == pytest.approx(op.flops / 200e12)


def test_odd_dimension_is_slower_than_the_aligned_one_of_more_work():
    g1, odd = _dot(4096, 4096 + 1, 4096)  # one element past a tile on K
    g2, whole = _dot(4096, 4096 + 64, 4096)
    t_odd = matmul_seconds(odd, g1, 200e12, 1e12, 64)
    t_whole = matmul_seconds(whole, g2, 200e12, 1e12, 64)
    assert t_odd == pytest.approx(t_whole)
    assert odd.flops < whole.flops


def test_skinny_product_is_bound_by_streaming_its_operands():
    # 8 rows against a 8192 x 8192 weight: 2 FLOP per weight element read, far under the
    # machine's balance, so its time is its bytes over the HBM rate.
    graph, op = _dot(8, 8192, 8192)
    byte_rate = 1e12
    seconds = matmul_seconds(op, graph, flop_rate=1e18, byte_rate=byte_rate, tile=1)
    assert seconds == pytest.approx((op.bytes_read + op.bytes_written) / byte_rate)
    assert seconds > op.flops / 1e18


def test_the_cost_model_prices_matmuls_by_shape():
    """The compute the estimate charges (and the ILP reads, `Tables.compute_coef`) is the
    shape's: a contraction of 4000 costs what one of 4032 (63 whole tiles) does."""
    a100 = Cluster.preset("a100", devices=1)

    def step_seconds(k: int) -> float:
        x = jax.ShapeDtypeStruct((16, 2048, k), jnp.bfloat16)
        y = jax.ShapeDtypeStruct((16, k, 2048), jnp.bfloat16)
        graph = capture(lambda a, b: jnp.matmul(a, b), x, y)
        model = CostModel(graph, a100)
        return model.evaluate({}, {}).compute_s

    assert step_seconds(4000) == pytest.approx(step_seconds(4032), rel=1e-6)
    assert step_seconds(8064) == pytest.approx(2 * step_seconds(4032), rel=1e-6)


def test_a_cluster_file_gives_the_tile_and_refuses_a_bad_one():
    assert Cluster.preset("a100").matmul_tile == 64
    # A TPU's MXU: 128 x 128, Trillium's 256 x 256.
    tiles = {n: Cluster.preset(n).matmul_tile for n in ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e")}
    assert tiles == {"tpu-v4": 128, "tpu-v5e": 128, "tpu-v5p": 128, "tpu-v6e": 256}
    assert Cluster.from_dict({"preset": "cpu", "matmul_tile": 32}).matmul_tile == 32
    with pytest.raises(ClusterError, match="matmul_tile must be an integer"):
        Cluster.from_dict({"preset": "cpu", "matmul_tile": 0})
