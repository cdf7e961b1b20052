"""A small classifier MLP: the model the fast tests plan, apply and check numerically."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._train import DTYPES, ModelParts, check_config, cross_entropy


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    """Sizes are multiples of 8 so every split of the 8 CPU test devices divides them."""

    layers: int = 4
    """Hidden Dense + ReLU layers (`layer_0` ... `layer_{layers-1}`), then a `head` Dense."""
    hidden: int = 256
    """Width of every hidden layer."""
    features: int = 64
    """Input features per example."""
    classes: int = 16
    """Output classes (softmax cross-entropy)."""
    batch: int = 32
    """Global batch size."""
    dtype: str = "float32"
    """Compute dtype; parameters stay float32."""
    learning_rate: float = 1e-3
    """Adam step size."""

    def resolved(self) -> MlpConfig:
        check_config("mlp", self)
        return self


class Mlp(nn.Module):
    cfg: MlpConfig

    @nn.compact
    def __call__(self, x):  # x: [B, features]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        for i in range(cfg.layers):
            x = nn.Dense(cfg.hidden, dtype=dtype, param_dtype=jnp.float32, name=f"layer_{i}")(x)
            x = nn.relu(x)  # [B, hidden]
        return nn.Dense(cfg.classes, dtype=dtype, param_dtype=jnp.float32, name="head")(x)


def build_mlp(cfg: MlpConfig) -> ModelParts:
    model = Mlp(cfg)

    def init_params(key):
        return model.init(key, jnp.zeros((1, cfg.features), jnp.float32))

    def make_batch(key):
        kx, ky = jax.random.split(key)
        return {
            "x": jax.random.normal(kx, (cfg.batch, cfg.features), jnp.float32),
            "y": jax.random.randint(ky, (cfg.batch,), 0, cfg.classes, jnp.int32),
        }

    def loss_fn(params, batch):
        return cross_entropy(model.apply(params, batch["x"]), batch["y"])

    return ModelParts(init_params, make_batch, loss_fn)
