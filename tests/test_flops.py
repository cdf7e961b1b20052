"""FLOP and byte rules: exact counts for matmuls and convolutions, conventions for the rest."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from automap._capture import ELEMENTWISE, RULES, capture, is_known, op_cost, while_trip_count

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def _xla_flops(fn, *args):
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]


def test_dot_general_batched_is_2bmnk():
    b, m, k, n = 3, 4, 5, 6
    fn = lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y)  # noqa: E731
    args = (S((b, m, k), F32), S((b, k, n), F32))
    (op,) = capture(fn, *args).ops
    assert op.primitive == "dot_general"
    assert op.flops == 2 * b * m * n * k == _xla_flops(fn, *args)
    assert op.bytes_read == 4 * (b * m * k + b * k * n)
    assert op.bytes_written == 4 * b * m * n


def test_dot_general_several_contracting_and_free_dims():
    # x[a, k1, m, k2] · y[k2, n1, k1, n2]: contract k1 and k2, no batch.
    fn = lambda x, y: lax.dot_general(x, y, (((1, 3), (2, 0)), ((), ())))  # noqa: E731
    args = (S((2, 3, 4, 5), F32), S((5, 6, 3, 7), F32))
    (op,) = capture(fn, *args).ops
    assert op.flops == 2 * (2 * 4) * (6 * 7) * (3 * 5)


@pytest.mark.parametrize(
    ("lhs", "rhs", "kwargs", "expected"),
    [
        # plain: 2 × out(2·7·7·8) × kernel(3·3) × C_in 3
        ((2, 9, 9, 3), (3, 3, 3, 8), {}, 2 * (2 * 7 * 7 * 8) * 9 * 3),
        # two feature groups: each output sees C_in / 2 = 2 channels
        ((2, 9, 9, 4), (3, 3, 2, 6), {"feature_group_count": 2}, 2 * (2 * 7 * 7 * 6) * 9 * 2),
        # two batch groups (a grouped conv's weight gradient): output batch 4 / 2
        ((4, 5, 5, 2), (3, 3, 2, 4), {"batch_group_count": 2}, 2 * (2 * 3 * 3 * 4) * 9 * 2),
    ],
)
def test_conv_is_exact_and_matches_xla(lhs, rhs, kwargs, expected):
    def fn(x, k):
        dn = ("NHWC", "HWIO", "NHWC")
        return lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=dn, **kwargs)

    args = (S(lhs, F32), S(rhs, F32))
    (op,) = capture(fn, *args).ops
    assert op.primitive == "conv_general_dilated"
    assert op.flops == expected == _xla_flops(fn, *args)


def test_conv_strided_nchw():
    def fn(x, k):  # stride 2, "SAME": output 2×8×4×4
        return lax.conv_general_dilated(x, k, (2, 2), "SAME")

    (op,) = capture(fn, S((2, 3, 8, 8), F32), S((8, 3, 3, 3), F32)).ops
    assert op.flops == 2 * (2 * 8 * 4 * 4) * (3 * 3 * 3)


def test_elementwise_reduction_and_movement_conventions():
    x = S((4, 8), F32)
    assert op_cost("exp", [x], [x], {})[0] == 32
    assert op_cost("add", [x, x], [x], {}) == (32, 256, 128)
    assert op_cost("reduce_sum", [x], [S((4,), F32)], {"axes": (1,)})[0] == 32
    assert op_cost("transpose", [x], [S((8, 4), F32)], {})[:1] == (0,)
    assert op_cost("transpose", [x], [S((8, 4), F32)], {})[1:] == (128, 128)
    # A reshape is a bitcast of the same buffer in XLA: free.
    assert op_cost("reshape", [x], [S((32,), F32)], {}) == (0, 0, 0)
    # A bf16 tensor moves half the bytes.
    assert op_cost("convert_element_type", [x], [S((4, 8), jnp.bfloat16)], {}) == (0, 128, 64)


def test_reduce_window_counts_window_elements():
    fn = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")  # noqa: E731
    (op,) = capture(fn, S((2, 8, 8, 3), F32)).ops
    assert op.primitive == "reduce_window_max"
    assert op.flops == (2 * 4 * 4 * 3) * 4


def test_known_and_unknown_rules():
    assert is_known("dot_general") and is_known("tanh") and is_known("scatter-add")
    assert {"exp", "log", "tanh", "logistic", "erf", "rsqrt"} <= ELEMENTWISE
    assert not is_known("definitely_not_a_primitive")
    x = S((4, 8), F32)
    flops, read, written = op_cost("definitely_not_a_primitive", [x], [x], {})
    assert (flops, read, written) == (320, 128, 128)
    assert all(callable(rule) for rule in RULES.values())


def _while_eqn(fn, *args):
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "while"]
    return eqn


def test_while_trip_count_static_counter():
    def counted(x):
        return lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 3, c[1] * 2.0), (0, x))[1]

    assert while_trip_count(_while_eqn(counted, S((3,), F32))) == 4  # 0, 3, 6, 9


def test_while_trip_count_unknown_for_data_dependent_loop():
    def data_dependent(x):
        return lax.while_loop(lambda v: v.sum() < 10.0, lambda v: v + 1.0, x)

    assert while_trip_count(_while_eqn(data_dependent, S((3,), F32))) is None


def test_fori_loop_with_traced_bound_is_unknown():
    def fori(n, x):
        return lax.fori_loop(0, n, lambda i, v: v * 2.0, x)

    assert while_trip_count(_while_eqn(fori, S((), jnp.int32), S((3,), F32))) is None
