"""The interpreter re-runs a captured program and computes exactly what the step computes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from automap._capture import capture
from automap._run import eval_graph, run_graph
from automap._zoo import get_model


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(32)(x))
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


def _flax_adam_problem():
    model, tx = _Mlp(), optax.adam(1e-2)
    x = jax.random.normal(jax.random.key(1), (16, 8))
    params = model.init(jax.random.key(0), x)
    batch = {"x": x, "y": jnp.arange(16) % 4}

    def step(params, opt_state, batch):
        def loss(p):
            logits = model.apply(p, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, tx.init(params), batch)


def _assert_same(got, want, atol=0.0):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


@pytest.mark.slow  # compiled twice and run
def test_jitted_interpreter_equals_jitted_step_on_flax_adam():
    step, args = _flax_adam_problem()
    graph = capture(step, *args)
    flat = jax.tree.leaves(args)
    got = jax.jit(lambda leaves: eval_graph(graph, leaves))(flat)
    want = jax.tree.leaves(jax.jit(step)(*args))
    _assert_same(got, want, atol=1e-6)
    # Twice: the optimizer state the interpreter returns feeds the next step.
    again = jax.jit(lambda *a: run_graph(graph, *a))(*graph.out_tree.unflatten(got)[:2], args[2])
    _assert_same(again, jax.jit(step)(*jax.jit(step)(*args)[:2], args[2]), atol=1e-6)


def test_eager_interpreter_matches_too():
    # Eager runs dispatch op by op: a small program keeps this quick.
    def step(w, x):
        return jax.value_and_grad(lambda v: jnp.tanh(x @ v).sum() * 2.0)(w)

    w, x = jnp.ones((4, 3)) * 0.1, jnp.arange(8.0).reshape(2, 4)
    graph = capture(step, w, x)
    _assert_same(run_graph(graph, w, x), step(w, x), atol=1e-6)


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


def test_loops_conditionals_and_custom_rules():
    def loss(w, x):
        def body(c, xi):
            return jnp.tanh(c @ w + xi), (c * c).sum()

        c, ys = lax.scan(body, x[0], x, length=x.shape[0])
        c = jax.checkpoint(lambda v: jax.nn.relu(v) * 3.0)(_clip_grad(c))
        c = lax.fori_loop(0, 3, lambda i, v: v * 0.5 + i, c)
        return lax.cond(ys.sum() > 0, lambda v: v.sum(), lambda v: -v.sum(), c)

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        # Not differentiable, so after the gradient: a counted while loop.
        grad = lax.while_loop(lambda v: v[0] < 4, lambda v: (v[0] + 1, v[1] * 1.1), (0, grad))[1]
        return value, grad

    w = jax.random.normal(jax.random.key(0), (6, 6)) * 0.3
    x = jax.random.normal(jax.random.key(1), (5, 6))
    graph = capture(step, w, x)
    assert {"scan", "while", "cond"} <= {op.primitive for op in graph.ops}
    got = jax.jit(lambda *a: run_graph(graph, *a))(w, x)
    _assert_same(got, jax.jit(step)(w, x), atol=1e-6)


def test_constrain_sees_every_op_output_and_can_shard_them():
    step, args = _flax_adam_problem()
    graph = capture(step, *args)
    seen = []
    jax.eval_shape(
        lambda *a: run_graph(graph, *a, constrain=lambda t, v: seen.append(t) or v), *args
    )
    assert seen == [t for op in graph.ops for t in op.outputs]

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    # Shard every [16, 32] activation (the hidden layer) over both axes.
    hidden = {t.id for t in graph.tensors if t.shape == (16, 32)}
    assert hidden

    def constrain(tid, value):
        if tid in hidden:
            spec = PartitionSpec("data", "model")
            return lax.with_sharding_constraint(value, NamedSharding(mesh, spec))
        return value

    flat = jax.tree.leaves(args)
    got = jax.jit(lambda leaves: eval_graph(graph, leaves, constrain))(flat)
    _assert_same(got, jax.tree.leaves(jax.jit(step)(*args)), atol=1e-5)


def test_bad_arguments_are_refused():
    step, args = _flax_adam_problem()
    graph = capture(step, *args)
    with pytest.raises(ValueError, match="input leaves"):
        eval_graph(graph, jax.tree.leaves(args)[:-1])


@pytest.mark.slow  # zoo steps interpreted and run
def test_zoo_step_reduced_variant_runs_through_the_interpreter():
    spec = get_model("bert-large", layers=1, hidden=32, heads=2, batch=2, seq=8)
    args = spec.concrete_args()
    graph = capture(spec.step_fn, *args)
    got = jax.jit(lambda *a: run_graph(graph, *a))(*args)
    _assert_same(got, jax.jit(spec.step_fn)(*args), atol=1e-5)


def test_outputs_that_are_inputs_or_literals():
    def step(params, batch):
        return params, 3.0, params["w"] * batch

    args = ({"w": jnp.ones(3), "unused": None}, jnp.arange(3.0))
    graph = capture(step, *args)
    out = run_graph(graph, *args)
    assert isinstance(out[1], jax.Array) and float(out[1]) == 3.0
    want = step(*args)
    _assert_same((out[0], out[2]), (want[0], want[2]))
    _assert_same(jax.jit(lambda *a: run_graph(graph, *a))(*args), jax.jit(step)(*args))
