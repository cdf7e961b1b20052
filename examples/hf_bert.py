"""Plan a Hugging Face Flax model: BERT for masked-language modelling, trained with Adam.

    automap plan --fn examples.hf_bert:make_step --cluster a100 --devices 8

The model is `transformers.FlaxBertForMaskedLM` built from a small `BertConfig` with
random weights (nothing is downloaded); its output projection is tied to the word
embedding, as the pretrained model's is. The step is the one Hugging Face's Flax MLM
example writes: the model called with `params=`, a masked cross entropy, optax's Adam.
`make_step(donate=True)` jits it with the parameters and optimizer state donated, as a
training loop runs it; `dtype="bfloat16"` computes in bf16 on float32 weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# The small shape the tests and the fidelity benchmark plan (8 devices divide every dim).
SMALL = dict(
    vocab_size=1024,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=512,
    max_position_embeddings=64,
)


def make_step(
    batch: int = 16,
    seq: int = 64,
    dtype: str = "float32",
    donate: bool = False,
    seed: int = 0,
    **config,
):
    """Return (train_step, (params, opt_state, batch)) with real random arrays."""
    from transformers import BertConfig, FlaxBertForMaskedLM

    cfg = BertConfig(**{**SMALL, **config})
    model = FlaxBertForMaskedLM(cfg, seed=seed, dtype=jnp.dtype(dtype))
    optimizer = optax.adam(1e-4)
    params = model.params
    opt_state = optimizer.init(params)
    key_ids, key_mask = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(key_ids, (batch, seq), 0, cfg.vocab_size)
    data = {
        "input_ids": tokens,
        "attention_mask": jnp.ones((batch, seq), jnp.int32),
        "labels": tokens,
        # 15% of the positions are scored, as the MLM objective masks them.
        "weights": (jax.random.uniform(key_mask, (batch, seq)) < 0.15).astype(jnp.float32),
    }

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model(
                batch["input_ids"], batch["attention_mask"], params=p, train=False
            ).logits
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["labels"]
            )
            return (loss * batch["weights"]).sum() / jnp.maximum(batch["weights"].sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    step = jax.jit(train_step, donate_argnums=(0, 1)) if donate else train_step
    return step, (params, opt_state, data)
