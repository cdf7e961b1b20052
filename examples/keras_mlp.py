"""Plan a Keras 3 model running on JAX, with Keras's stateless training API.

    KERAS_BACKEND=jax automap plan --fn examples.keras_mlp:make_step --cluster a100 --devices 8

The step is the one the Keras guide writes for a custom JAX training loop: it takes the
trainable, non-trainable and optimizer variables as arrays and returns their new values.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras


def make_step(batch: int = 64, features: int = 128, classes: int = 16, seed: int = 0):
    """Return (train_step, (trainable, non_trainable, optimizer_variables, batch))."""
    if keras.backend.backend() != "jax":
        raise RuntimeError("set KERAS_BACKEND=jax before importing keras to plan a Keras model")
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(256, activation="gelu"),
            keras.layers.Dense(256, activation="gelu"),
            keras.layers.Dense(classes),
        ]
    )
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(trainable_variables, non_trainable_variables, optimizer_variables, batch):
        def compute_loss(trainable):
            logits, non_trainable = model.stateless_call(
                trainable, non_trainable_variables, batch["x"], training=True
            )
            return loss_fn(batch["y"], logits), non_trainable

        (loss, non_trainable), grads = jax.value_and_grad(compute_loss, has_aux=True)(
            trainable_variables
        )
        trainable, optimizer_vars = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        return loss, trainable, non_trainable, optimizer_vars

    key_x, key_y = jax.random.split(jax.random.key(seed))
    data = {
        "x": jax.random.normal(key_x, (batch, features)),
        "y": jax.random.randint(key_y, (batch,), 0, classes),
    }
    args = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
        data,
    )
    return train_step, args
