"""Small steps shared by the pipeline tests: zoo variants and a third-party Flax model."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap._capture import capture
from automap._groups import build_groups
from automap._verify import compare_outputs
from automap._zoo import get_model

TINY = dict(layers=2, hidden=32, heads=2, batch=8, seq=16, vocab=64, dtype="float32")
#: The four-layer GPT the schedules' recipe and command-line tests plan (one layer a chunk).
SMALL = dict(layers=4, hidden=32, heads=4, batch=8, seq=16, vocab=64, dtype="float32")


@functools.cache
def gpt4():
    """A float32 GPT of four layers (room for four chunks of whole layers), its graph and
    groups: the schedules' runtime and cost tests run it."""
    spec = get_model(
        "gpt-1.3b", layers=4, hidden=64, heads=4, batch=16, seq=32, vocab=128, dtype="float32"
    )
    graph = capture(spec.step_fn, *spec.abstract_args())
    return spec, graph, build_groups(graph)


@functools.cache
def small():
    """`SMALL`'s zoo spec and captured graph."""
    spec = get_model("gpt-1.3b", **SMALL)
    return spec, capture(spec.step_fn, *spec.abstract_args())


@functools.cache
def zoo(name: str):
    """(spec, graph, groups) of a tiny zoo variant, captured once per test session."""
    spec = get_model(name, **TINY)
    graph = capture(spec.step_fn, *spec.abstract_args())
    return spec, graph, build_groups(graph)


class ResidualMlp(nn.Module):
    """A stack of pre-norm residual MLP blocks: the shape of a transformer without
    attention, written the way a Flax user would."""

    blocks: int = 3
    width: int = 16
    classes: int = 8

    @nn.compact
    def __call__(self, x):  # x: [B, width]
        for _ in range(self.blocks):
            h = nn.LayerNorm()(x)
            h = nn.Dense(4 * self.width)(h)  # [B, 4w]
            x = x + nn.Dense(self.width)(nn.gelu(h))  # [B, w]
        return nn.Dense(self.classes)(nn.LayerNorm()(x))  # [B, classes]


TX = optax.adam(1e-2)


def flax_step(params, opt_state, batch):
    def loss_fn(p):
        logits = ResidualMlp().apply(p, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def flax_args(batch: int = 8):
    kx, ky, kp = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (batch, 16))
    params = ResidualMlp().init(kp, x)
    return params, TX.init(params), {"x": x, "y": jax.random.randint(ky, (batch,), 0, 8)}


@functools.cache
def flax_graph():
    graph = capture(flax_step, *flax_args())
    return graph, build_groups(graph)


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(4)(nn.relu(x))


def batchnorm_step_and_args():
    model, tx = BatchNormNet(), optax.sgd(0.1)
    x = jax.random.normal(jax.random.key(0), (8, 6))
    variables = model.init(jax.random.key(1), x)
    params, stats = variables["params"], variables["batch_stats"]

    def step(params, opt_state, batch_stats, batch):
        def loss_fn(p):
            out, new = model.apply(
                {"params": p, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
            )
            return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state, stats

    batch = {"x": x, "y": jnp.ones((8, 4))}
    return step, (params, tx.init(params), stats, batch)


def assert_same(got, want, lr):
    """Equal up to reassociation. An attention key bias has a zero gradient in exact
    arithmetic (softmax ignores a per-query constant): Adam turns its float noise into a
    step of about lr, so it is held to that (as in test_apply)."""
    noisy = lambda path: "['key']['bias']" in jax.tree_util.keystr(path)  # noqa: E731
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True
    )
    clean_got, clean_want = [], []
    for (path, g), w in pairs:
        if noisy(path):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=3 * lr)
        else:
            clean_got.append(g)
            clean_want.append(w)
    ok, err, where = compare_outputs(clean_got, clean_want)
    assert ok, f"max |err| {err} at leaf {where}"
