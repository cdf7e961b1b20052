"""Collectives of unusual but common steps, held against the CPU compile (issue 28):
each program is small, and each test failed before its fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import automap as am

CPU8 = am.Cluster.preset("cpu", devices=8)
D, H, B = 64, 256, 32


def _mlp_loss(params, x, y):
    h = x
    for name in sorted(params):
        h = h + jnp.tanh(h @ params[name]["w1"]) @ params[name]["w2"]
    return jnp.mean((h - y) ** 2)


def _clipped_step_with_metrics():
    """optax.chain(clip_by_global_norm, adamw), returning metrics beside the state."""
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    keys = jax.random.split(jax.random.key(0), 6)
    params = {
        f"l{i}": {
            "w1": 0.05 * jax.random.normal(keys[2 * i], (D, H)),
            "w2": 0.05 * jax.random.normal(keys[2 * i + 1], (H, D)),
        }
        for i in range(2)
    }

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return optax.apply_updates(params, updates), state, metrics

    x, y = jax.random.normal(keys[4], (B, D)), jax.random.normal(keys[5], (B, D))
    return step, (params, opt.init(params), x, y)


@pytest.mark.parametrize("expert", ["zero1", "zero2"])
def test_a_clipped_step_reduce_scatters_each_gradient_where_it_is_made(expert):
    """The clip's scale, a scalar every gradient reads, carried each gradient's wanted
    ZeRO dim to every other: a transposed weight gradient was pinned on its other dim and
    XLA inserted an all-to-all per weight (32 KiB over data), unpriced."""
    step, args = _clipped_step_with_metrics()
    plan = am.expert_plans(step, *args, cluster=CPU8)[expert]
    report = am.verify(step, plan, *args)
    assert report.collectives_match, report.summary()
    assert not any(k.startswith("all-to-all") for k in report.xla_comm_bytes)


def _deep_residual_step(layers: int = 12, width: int = 32):
    """A residual stack of square weights: both dims of each weight are the residual
    width, one linkage group."""
    keys = jax.random.split(jax.random.key(1), layers + 2)
    params = {
        f"layer_{i:02d}": {"w": 0.02 * jax.random.normal(keys[i], (width, width))}
        for i in range(layers)
    }
    opt = optax.sgd(1e-2)

    def loss(params, x, y):
        h = x
        for name in sorted(params):
            h = h + jax.nn.relu(h @ params[name]["w"])
        return jnp.mean((h - y) ** 2)

    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return value, optax.apply_updates(params, updates), state

    x = jax.random.normal(keys[-2], (16, width))
    y = jax.random.normal(keys[-1], (16, width))
    return step, (params, opt.init(params), x, y)


def test_a_square_weight_gradient_is_pinned_on_the_dim_its_transpose_splits():
    """A square weight's two dims share a group, so the group could not tell which dim of
    the gradient (made transposed) ZeRO splits: the first was taken, and XLA all-to-alled
    every weight's gradient (100 KiB over data on a 200-layer model), unpriced."""
    step, args = _deep_residual_step()
    plan = am.expert_plans(step, *args, cluster=CPU8)["zero1"]
    report = am.verify(step, plan, *args)
    assert report.collectives_match, report.summary()
    assert not any(k.startswith("all-to-all") for k in report.xla_comm_bytes)


def _adamw_step_with_metrics():
    """AdamW, returning the loss, the gradients' norm and the parameters' norm beside the
    new state: the metrics dict flattens by key, `grad_norm` first."""
    opt = optax.adamw(1e-3)
    _, (params, _, x, y) = _clipped_step_with_metrics()

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
        }
        return optax.apply_updates(params, updates), state, metrics

    return step, (params, opt.init(params), x, y)


def test_zero3_gathers_what_xla_gathers_in_a_step_returning_metrics():
    """The loss was the first scalar output, `grad_norm` (made after the backward), so the
    whole backward counted as forward: its gathers went unrun and were priced (+125% over
    XLA's all-gathers). The parameters' norm and AdamW's weight decay, read past the
    forward, were gathered again (+14%): they read the shards now, as the update does."""
    step, args = _adamw_step_with_metrics()
    plan = am.expert_plans(step, *args, cluster=CPU8)["zero3"]
    report = am.verify(step, plan, *args)
    assert report.collectives_match, report.summary()
    assert report.numerics_ok
    gathered = report.xla_comm_bytes["all-gather@data"]
    assert report.predicted_comm_bytes["all-gather@data"] == pytest.approx(gathered, rel=0.01)
