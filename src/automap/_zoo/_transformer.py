"""Transformer blocks shared by the zoo, and the BERT encoder and GPT decoder built from them.

Layers are a plain Python loop of modules named `layer_0`, `layer_1`, ... (not nn.scan):
each layer's parameters get their own numbered path, so the planners can tell layers apart
(per-layer overrides, pipeline cuts) and a jaxpr shows every layer's ops.

Query, key, value and output projections are separate 2-D Dense kernels [hidden, hidden]
and the heads are a reshape of their output: this is the layout Megatron tensor parallel
splits (columns of Q/K/V and of the first MLP matrix, rows of the output matrices).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from .._errors import ModelError
from ._train import DTYPES, ModelParts, check_config, cross_entropy, resolve_ff

_F32 = jnp.float32


def dense(features: int, dtype, name: str, use_bias: bool = True) -> nn.Dense:
    """A Dense layer with float32 parameters and computation in `dtype` (mixed precision)."""
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=_F32, name=name)


def layer_norm(dtype, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=1e-5, dtype=dtype, param_dtype=_F32, name=name)


def causal_mask(q_len: int, k_len: int) -> jax.Array:
    """bool[q_len, k_len], True where a query may see a key. Built from iota inside the
    trace: a precomputed numpy mask would be a seq × seq constant baked into the program."""
    rows = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
    cols = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
    return rows >= cols


def rotary(x: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding (GPT-NeoX layout: rotate the two halves of each head).

    x: [B, S, heads, head_dim] -> same shape; `theta` is the base of the angles (10,000 in
    GPT-NeoX and Llama 2, 500,000 in Llama 3). Angles come from iota, not a constant table.
    """
    seq, head_dim = x.shape[1], x.shape[3]
    half = head_dim // 2
    pos = lax.broadcasted_iota(_F32, (seq, half), 0)
    idx = lax.broadcasted_iota(_F32, (seq, half), 1)
    angle = pos * jnp.exp(idx * (-2.0 * math.log(theta) / head_dim))  # [S, half]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half].astype(_F32), x[..., half:].astype(_F32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@jax.custom_vjp
def fused_softmax(scores: jax.Array, scale: float, mask: jax.Array) -> jax.Array:
    """softmax(where(mask, scores * scale, -1e9)) as Megatron-LM's fused kernel computes it:
    reads the scores in the compute dtype, works in float32, writes probabilities in the
    compute dtype, and its backward reads those 16-bit probabilities (not float32 ones)."""
    return _fused_softmax(scores, scale, mask)[0]


def _fused_softmax(scores, scale, mask):
    x = jnp.where(mask, scores.astype(_F32) * scale, -1e9)
    probs = jax.nn.softmax(x, axis=-1).astype(scores.dtype)
    return probs, (probs, scale)


def _fused_softmax_bwd(saved, grad):
    probs, scale = saved
    p, g = probs.astype(_F32), grad.astype(_F32)
    dx = p * (g - jnp.sum(g * p, axis=-1, keepdims=True)) * scale
    return dx.astype(probs.dtype), None, None


fused_softmax.defvjp(_fused_softmax, _fused_softmax_bwd)


class Attention(nn.Module):
    """Multi-head attention; `kv` given = cross-attention, `bias` = additive [1|B, h, S, T]."""

    heads: int
    dtype: str
    causal: bool = False
    use_rotary: bool = False
    use_bias: bool = True
    softmax: str = "float32"  # or "fused": `fused_softmax` (causal, no bias)

    @nn.compact
    def __call__(self, x, kv=None, bias=None):
        dtype = DTYPES[self.dtype]
        kv = x if kv is None else kv
        (b, s, hidden), t = x.shape, kv.shape[1]
        head_dim = hidden // self.heads
        proj = functools.partial(dense, hidden, dtype, use_bias=self.use_bias)
        q = proj(name="query")(x).reshape(b, s, self.heads, head_dim)  # [B, S, h, d]
        k = proj(name="key")(kv).reshape(b, t, self.heads, head_dim)  # [B, T, h, d]
        v = proj(name="value")(kv).reshape(b, t, self.heads, head_dim)  # [B, T, h, d]
        if self.use_rotary:
            q, k = rotary(q), rotary(k)
        if self.softmax == "fused":
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # [B, h, S, T]
            probs = fused_softmax(scores, 1 / math.sqrt(head_dim), causal_mask(s, t)[None, None])
        else:
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)  # [B, h, S, T]
            # Softmax in float32: bf16 logits lose the small differences attention needs.
            scores = scores.astype(_F32)
            if bias is not None:
                scores = scores + bias
            if self.causal:
                scores = jnp.where(causal_mask(s, t)[None, None], scores, -1e9)
            probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, hidden)  # [B, S, H]
        return proj(name="out")(out)


class Mlp(nn.Module):
    """Position-wise feed-forward: wi [H, ff], activation, wo [ff, H]."""

    ff: int
    dtype: str
    activation: str = "gelu"
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        dtype = DTYPES[self.dtype]
        h = dense(self.ff, dtype, "wi", self.use_bias)(x)  # [B, S, ff]
        # tanh-approximate GELU (GPT-2's; BERT's erf form costs the same and plans the same).
        h = nn.gelu(h, approximate=True) if self.activation == "gelu" else nn.relu(h)
        return dense(x.shape[-1], dtype, "wo", self.use_bias)(h)


def token_batch(key, batch: int, seq: int, vocab: int) -> dict[str, jax.Array]:
    """Random tokens and next-token targets, int32[batch, seq] each."""
    kt, ky = jax.random.split(key)
    return {
        "tokens": jax.random.randint(kt, (batch, seq), 0, vocab, jnp.int32),
        "targets": jax.random.randint(ky, (batch, seq), 0, vocab, jnp.int32),
    }


# ----------------------------------------------------------------------------- BERT


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT encoder pre-trained with masked-LM loss (no NSP head: the brief asks for MLM)."""

    layers: int = 24
    """Encoder layers."""
    hidden: int = 1024
    """Model width."""
    heads: int = 16
    """Attention heads; must divide hidden."""
    ff: int | None = None
    """Feed-forward width; None means 4 × hidden."""
    vocab: int = 30522
    """Vocabulary size (rows of the token embedding, tied to the MLM output)."""
    seq: int = 512
    """Sequence length; also the rows of the learned position table (BERT's max length)."""
    batch: int = 64
    """Global batch size in sequences."""
    dtype: str = "bfloat16"
    """Compute dtype; parameters and Adam moments stay float32."""
    learning_rate: float = 1e-4
    """Adam step size."""

    def resolved(self) -> BertConfig:
        check_config("bert", self)
        return dataclasses.replace(self, ff=resolve_ff(self.ff, self.hidden))


class Bert(nn.Module):
    cfg: BertConfig

    @nn.compact
    def __call__(self, tokens):  # tokens: int32[B, S]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=dtype, param_dtype=_F32, name="token_embed")
        init = nn.initializers.normal(0.02)
        pos = self.param("position_embed", init, (cfg.seq, cfg.hidden), _F32)
        # Segment embeddings are left out: single-segment MLM never reads them.
        x = embed(tokens) + pos.astype(dtype)[None, : tokens.shape[1]]  # [B, S, H]
        x = layer_norm(dtype, "embed_norm")(x)
        for i in range(cfg.layers):
            x = BertLayer(cfg, name=f"layer_{i}")(x)
        h = nn.gelu(dense(cfg.hidden, dtype, "mlm_dense")(x), approximate=True)
        h = layer_norm(dtype, "mlm_norm")(h)
        bias = self.param("mlm_bias", nn.initializers.zeros, (cfg.vocab,), _F32)
        return embed.attend(h) + bias.astype(dtype)  # [B, S, vocab]


class BertLayer(nn.Module):
    """Post-LN encoder layer, as in the original BERT."""

    cfg: BertConfig

    @nn.compact
    def __call__(self, x):
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        x = layer_norm(dtype, "attention_norm")(
            x + Attention(cfg.heads, cfg.dtype, name="attention")(x)
        )
        return layer_norm(dtype, "mlp_norm")(x + Mlp(cfg.ff, cfg.dtype, name="mlp")(x))


def build_bert(cfg: BertConfig) -> ModelParts:
    model = Bert(cfg)

    def init_params(key):
        return model.init(key, jnp.zeros((1, cfg.seq), jnp.int32))

    def make_batch(key):
        kt, kw = jax.random.split(key)
        batch = token_batch(kt, cfg.batch, cfg.seq, cfg.vocab)
        # MLM: the loss counts the ~15% of positions that were masked.
        batch["weights"] = jax.random.bernoulli(kw, 0.15, (cfg.batch, cfg.seq)).astype(_F32)
        return batch

    def loss_fn(params, batch):
        logits = model.apply(params, batch["tokens"])
        return cross_entropy(logits, batch["targets"], batch["weights"])

    return ModelParts(init_params, make_batch, loss_fn)


# ----------------------------------------------------------------------------- GPT


@dataclasses.dataclass(frozen=True)
class GptConfig:
    """Pre-LN decoder-only transformer with a causal LM loss and a tied output embedding."""

    layers: int = 48
    """Decoder layers."""
    hidden: int = 1600
    """Model width."""
    heads: int = 25
    """Attention heads; must divide hidden (GPT-2 XL really has 25 heads of 64)."""
    ff: int | None = None
    """Feed-forward width; None means 4 × hidden."""
    vocab: int = 50304
    """Vocabulary: GPT-2's 50,257 BPE tokens padded to 50,304 = 128 × 393 (as Megatron and
    nanoGPT do) so a tensor-parallel axis up to 128 can split it; 50,257 is prime."""
    seq: int = 1024
    """Sequence length (and rows of the learned position table, if positions="learned")."""
    positions: str = "learned"
    """"learned" (GPT-2: a [seq, hidden] table) or "rotary" (GPT-NeoX: no parameters)."""
    batch: int = 32
    """Global batch size in sequences."""
    dtype: str = "bfloat16"
    """Compute dtype; parameters and Adam moments stay float32."""
    learning_rate: float = 1e-4
    """Adam step size."""
    clip_norm: float | None = None
    """Clip the gradients to this global L2 norm before Adam, as Megatron-LM does
    (`--clip-grad`, 1.0 there); None: no clipping (`_train.clipped_adam`)."""
    softmax: str = "float32"
    """"float32" (the scores cast to float32, softmax and its saved output in float32) or
    "fused" (Megatron-LM's fused scale-mask-softmax: float32 inside one function, its
    input, output and saved probabilities in the compute dtype)."""

    def resolved(self) -> GptConfig:
        check_config("gpt", self)
        if self.positions not in ("learned", "rotary"):
            raise ModelError(f"gpt: positions={self.positions!r}; use 'learned' or 'rotary'")
        if self.positions == "rotary" and (self.hidden // self.heads) % 2:
            raise ModelError("gpt: rotary positions need an even head size (hidden / heads)")
        if self.softmax not in ("float32", "fused"):
            raise ModelError(f"gpt: softmax={self.softmax!r}; use 'float32' or 'fused'")
        return dataclasses.replace(self, ff=resolve_ff(self.ff, self.hidden))


class GptLayer(nn.Module):
    """Pre-LN decoder layer (GPT-2)."""

    cfg: GptConfig

    @nn.compact
    def __call__(self, x):
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        attn = Attention(
            cfg.heads,
            cfg.dtype,
            causal=True,
            use_rotary=cfg.positions == "rotary",
            softmax=cfg.softmax,
            name="attention",
        )
        x = x + attn(layer_norm(dtype, "attention_norm")(x))
        return x + Mlp(cfg.ff, cfg.dtype, name="mlp")(layer_norm(dtype, "mlp_norm")(x))


class Gpt(nn.Module):
    cfg: GptConfig

    @nn.compact
    def __call__(self, tokens):  # tokens: int32[B, S]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=dtype, param_dtype=_F32, name="token_embed")
        x = embed(tokens)  # [B, S, H]
        if cfg.positions == "learned":
            init = nn.initializers.normal(0.02)
            pos = self.param("position_embed", init, (cfg.seq, cfg.hidden), _F32)
            x = x + pos.astype(dtype)[None, : tokens.shape[1]]
        for i in range(cfg.layers):
            x = GptLayer(cfg, name=f"layer_{i}")(x)
        x = layer_norm(dtype, "final_norm")(x)
        return embed.attend(x)  # [B, S, vocab]


def build_gpt(cfg: GptConfig) -> ModelParts:
    return causal_lm_parts(Gpt(cfg), cfg.batch, cfg.seq, cfg.vocab)


def causal_lm_parts(model: nn.Module, batch: int, seq: int, vocab: int) -> ModelParts:
    """A causal language model's parts: tokens in, next-token cross-entropy out (the zoo's
    GPT and Llama)."""

    def init_params(key):
        return model.init(key, jnp.zeros((1, seq), jnp.int32))

    def make_batch(key):
        return token_batch(key, batch, seq, vocab)

    def loss_fn(params, batch):
        return cross_entropy(model.apply(params, batch["tokens"]), batch["targets"])

    return ModelParts(init_params, make_batch, loss_fn)
