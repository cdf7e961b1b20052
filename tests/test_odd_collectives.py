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
