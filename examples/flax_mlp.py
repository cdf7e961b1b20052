"""Plan your own Flax model: a training step Auto-MAP has never seen.

    automap plan --fn examples.flax_mlp:make_step --cluster a100 --devices 8

or from Python: `python -m examples.flax_mlp` plans it, applies the plan on the local
devices and checks one step against the unsharded step.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class Classifier(nn.Module):
    """A small two-block MLP classifier with layer norm."""

    hidden: int = 256
    classes: int = 16

    @nn.compact
    def __call__(self, x):
        for width in (self.hidden, self.hidden):
            x = nn.LayerNorm()(nn.gelu(nn.Dense(width)(x)))
        return nn.Dense(self.classes)(x)


def make_step(batch: int = 64, features: int = 128, seed: int = 0):
    """Return (train_step, (params, opt_state, batch)) with real random arrays."""
    model = Classifier()
    optimizer = optax.adamw(1e-3)
    key_init, key_x, key_y = jax.random.split(jax.random.key(seed), 3)
    params = model.init(key_init, jnp.zeros((1, features)))["params"]
    opt_state = optimizer.init(params)
    data = {
        "x": jax.random.normal(key_x, (batch, features)),
        "y": jax.random.randint(key_y, (batch,), 0, model.classes),
    }

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step, (params, opt_state, data)


def main() -> None:
    import automap as am

    step_fn, args = make_step()
    plan = am.plan(step_fn, *args, cluster=am.Cluster.preset("cpu", devices=8), searcher="expert")
    print(f"plan {plan.name}: mesh {dict(plan.mesh)}, predicted {plan.predicted.step_time_s:.2e} s")
    loss, _, _ = am.apply(step_fn, plan)(*args)
    print(
        f"loss on the mesh: {float(loss):.4f}; unsharded: {float(jax.jit(step_fn)(*args)[0]):.4f}"
    )


if __name__ == "__main__":
    main()
