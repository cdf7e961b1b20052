"""Plan a Keras-Hub model on JAX: GPT-2 as a causal language model, trained with Adam.

    KERAS_BACKEND=jax automap plan --fn examples.keras_gpt2:make_step --cluster a100 --devices 8

`keras_hub.models.GPT2CausalLM` over a small `GPT2Backbone` with random weights (no
preset, nothing downloaded); its logits are the backbone's token embedding read in
reverse (tied weights), as the pretrained model's are. The step is Keras's stateless
JAX training loop, as in `examples.keras_mlp`. `make_step(donate=True)` jits it with
the trainable variables and the optimizer's variables donated; `dtype="bfloat16"` runs
the model under Keras's "mixed_bfloat16" policy (float32 variables, bf16 compute).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras

# The small shape the tests and the fidelity benchmark plan (8 devices divide every dim).
SMALL = dict(
    vocabulary_size=1024,
    num_layers=2,
    num_heads=4,
    hidden_dim=128,
    intermediate_dim=512,
    max_sequence_length=64,
)


def make_step(
    batch: int = 16,
    seq: int = 64,
    dtype: str = "float32",
    donate: bool = False,
    seed: int = 0,
    **config,
):
    """Return (train_step, (trainable, non_trainable, optimizer_variables, batch))."""
    if keras.backend.backend() != "jax":
        raise RuntimeError("set KERAS_BACKEND=jax before importing keras to plan a Keras model")
    import keras_hub

    keras.utils.set_random_seed(seed)
    policy = {"float32": "float32", "bfloat16": "mixed_bfloat16"}[dtype]
    backbone = keras_hub.models.GPT2Backbone(**{**SMALL, **config}, dropout=0.0, dtype=policy)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(trainable_variables, non_trainable_variables, optimizer_variables, batch):
        def compute_loss(trainable):
            inputs = {"token_ids": batch["token_ids"], "padding_mask": batch["padding_mask"]}
            logits, non_trainable = model.stateless_call(
                trainable, non_trainable_variables, inputs, training=True
            )
            return loss_fn(batch["labels"], logits), non_trainable

        (loss, non_trainable), grads = jax.value_and_grad(compute_loss, has_aux=True)(
            trainable_variables
        )
        trainable, optimizer_vars = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        return loss, trainable, non_trainable, optimizer_vars

    tokens = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, backbone.vocabulary_size)
    data = {
        "token_ids": tokens[:, :-1],
        "padding_mask": jax.numpy.ones((batch, seq), bool),
        "labels": tokens[:, 1:],
    }
    args = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
        data,
    )
    step = jax.jit(train_step, donate_argnums=(0, 2)) if donate else train_step
    return step, args
