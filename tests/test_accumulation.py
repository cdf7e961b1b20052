"""Gradient accumulation written in the step: the batch reshaped into microbatches and a
scan or vmap over them (optax.MultiSteps-free, flax-style accumulation). The batch goes on
with the examples of one microbatch, so data parallelism splits those (issue 28: the
reshape's block rule read the microbatch count, 4, as the batch and capped data at 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import automap as am
from automap._groups import build_groups

CPU8 = am.Cluster.preset("cpu", devices=8)
MICRO, BATCH, D, H = 4, 32, 64, 256


def _accumulating(scan: bool):
    opt = optax.adam(1e-3)
    params = {"w1": jnp.full((D, H), 0.01), "w2": jnp.full((H, D), 0.01)}
    x = jax.random.normal(jax.random.key(0), (BATCH, D))
    y = jax.random.normal(jax.random.key(1), (BATCH, D))

    def loss(p, xb, yb):
        return jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"] - yb) ** 2)

    def step(params, state, x, y):
        xs, ys = x.reshape(MICRO, -1, D), y.reshape(MICRO, -1, D)
        if scan:

            def body(acc, mb):
                out = jax.value_and_grad(loss)(params, *mb)
                return jax.tree.map(jnp.add, acc, out), None

            zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (value, grads), _ = jax.lax.scan(body, zero, (xs, ys))
        else:
            value, grads = jax.vmap(jax.value_and_grad(loss), (None, 0, 0))(params, xs, ys)
            value, grads = value.sum(), jax.tree.map(lambda g: g.sum(0), grads)
        grads = jax.tree.map(lambda g: g / MICRO, grads)
        updates, state = opt.update(grads, state, params)
        return value / MICRO, optax.apply_updates(params, updates), state

    return step, (params, opt.init(params), x, y)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "vmap"])
def test_the_batch_is_the_microbatch_examples_not_their_count(scan):
    step, args = _accumulating(scan)
    groups = build_groups(am.capture(step, *args))
    assert groups.batch_size == BATCH // MICRO
    assert len(groups.microbatch_splits) == 2  # x and y


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "vmap"])
def test_data_8_is_planned_and_priced_as_compiled(scan):
    step, args = _accumulating(scan)
    plan = am.expert_plans(step, *args, cluster=CPU8)["data_parallel"]
    assert plan.mesh == {"data": 8}
    report = am.verify(step, plan, *args)
    assert report.numerics_ok and report.collectives_match, report.mismatches
    # Before: the microbatch count was the batch, data=8 split nothing and the scan's
    # FLOPs were priced whole (2.8x XLA's count for the scan, 7.5x for the step's compute).
    assert report.predicted_flops_as_xla == pytest.approx(report.xla_flops, rel=0.15)


def test_a_batch_and_sequence_merge_keeps_the_batch():
    """[B, S, F] -> [B*S, F] is not a microbatch split: the batch stays B."""

    def step(w, x):
        return jnp.sum(jnp.tanh(x.reshape(-1, x.shape[-1]) @ w))

    graph = am.capture(step, jnp.ones((16, 16)), jnp.ones((8, 4, 16)))
    groups = build_groups(graph)
    assert groups.batch_size == 8 and groups.microbatch_splits == ()
