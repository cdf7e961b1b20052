"""Convolutional networks for ImageNet: VGG (conv-heavy, with a huge FC tail) and ResNet.

VGG is the model of "one weird trick" (Krizhevsky 2014): convolutions are cheap in weights
and heavy in compute (data parallel suits them), the FC layers the opposite (model
parallel suits them). Images are NHWC, kernels HWIO (Flax's layout).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from .._errors import ModelError
from ._train import DTYPES, ModelParts, check_config, cross_entropy

_F32 = jnp.float32

#: Convolutions per stage for VGG configurations A, B, D, E (11, 13, 16, 19 weight layers).
_VGG_STAGES = {11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}
#: Bottleneck blocks per stage for ResNet-50/101/152.
_RESNET_STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


@dataclasses.dataclass(frozen=True)
class VggConfig:
    """VGG (Simonyan & Zisserman 2014): 3×3 convolutions, 2×2 max pools, three FC layers."""

    depth: int = 19
    """Weight layers: 11, 13, 16 or 19 (configurations A, B, D, E). Named `depth`, not
    `layers`: only these four values exist, where a transformer's `layers` can be any."""
    hidden: int = 64
    """Channels of the first stage; the stages have 1, 2, 4, 8, 8 times this."""
    ff: int = 4096
    """Width of the two hidden FC layers."""
    image: int = 224
    """Image height and width; a multiple of 32 (five 2× poolings)."""
    classes: int = 1000
    """Output classes."""
    batch: int = 32
    """Global batch size in images."""
    dtype: str = "bfloat16"
    """Compute dtype; parameters and Adam moments stay float32."""
    learning_rate: float = 1e-4
    """Adam step size."""

    def resolved(self) -> VggConfig:
        check_config("vgg", self)
        if self.depth not in _VGG_STAGES:
            raise ModelError(f"vgg: depth={self.depth}; choose one of {sorted(_VGG_STAGES)}")
        if self.image % 32:
            raise ModelError(f"vgg: image={self.image} must be a multiple of 32")
        return self


class Vgg(nn.Module):
    cfg: VggConfig

    @nn.compact
    def __call__(self, images):  # images: float32[B, H, W, 3]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        x, index = images.astype(dtype), 0
        for stage, convs in enumerate(_VGG_STAGES[cfg.depth]):
            width = cfg.hidden * min(2**stage, 8)
            for _ in range(convs):
                conv = nn.Conv(
                    width, (3, 3), padding="SAME", dtype=dtype, param_dtype=_F32,
                    name=f"layer_{index}",
                )  # fmt: skip
                x = nn.relu(conv(x))
                index += 1
            x = nn.max_pool(x, (2, 2), strides=(2, 2))  # halves H and W
        x = x.reshape(x.shape[0], -1)  # [B, (image/32)² × 8·hidden]
        for width in (cfg.ff, cfg.ff):
            x = nn.relu(nn.Dense(width, dtype=dtype, param_dtype=_F32, name=f"layer_{index}")(x))
            index += 1
        return nn.Dense(cfg.classes, dtype=dtype, param_dtype=_F32, name=f"layer_{index}")(x)


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """ResNet v1.5 (torchvision's: the stride sits on the 3×3 convolution) with bottlenecks."""

    depth: int = 50
    """Weight layers: 50, 101 or 152 (named `depth`: only these values exist)."""
    hidden: int = 64
    """Width of the stem and of the first stage's bottleneck; stages double it."""
    image: int = 224
    """Image height and width; a multiple of 32 (the network downsamples 32×)."""
    classes: int = 1000
    """Output classes."""
    batch: int = 64
    """Global batch size in images."""
    dtype: str = "bfloat16"
    """Compute dtype; parameters and Adam moments stay float32."""
    learning_rate: float = 1e-4
    """Adam step size."""

    def resolved(self) -> ResNetConfig:
        check_config("resnet", self)
        if self.depth not in _RESNET_STAGES:
            raise ModelError(f"resnet: depth={self.depth}; choose one of {sorted(_RESNET_STAGES)}")
        if self.image % 32:
            raise ModelError(f"resnet: image={self.image} must be a multiple of 32")
        return self


class BatchNorm(nn.Module):
    """Train-mode batch normalisation: statistics of this batch, no running averages.

    The running mean and variance only serve evaluation; carrying them would add a fourth
    piece of state to a step that must be step(params, opt_state, batch). Their update is a
    few elementwise ops per channel, so leaving it out changes neither the program's
    partitioning nor its cost in any measurable way.
    """

    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):  # x: [B, H, W, C]
        channels = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (channels,), _F32)
        bias = self.param("bias", nn.initializers.zeros, (channels,), _F32)
        x32 = x.astype(_F32)  # statistics in float32: bf16 variance of large maps is poor
        mean = jnp.mean(x32, axis=(0, 1, 2))
        var = jnp.mean(jnp.square(x32 - mean), axis=(0, 1, 2))
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias
        return y.astype(self.dtype)


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (strided), 1×1 expand ×4, with a projection shortcut when shapes change."""

    width: int
    stride: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        conv = lambda f, k, s, name: nn.Conv(  # noqa: E731
            f, (k, k), (s, s), padding="SAME", use_bias=False,
            dtype=self.dtype, param_dtype=_F32, name=name,
        )  # fmt: skip
        y = nn.relu(BatchNorm(self.dtype, name="bn_1")(conv(self.width, 1, 1, "conv_1")(x)))
        y = nn.relu(
            BatchNorm(self.dtype, name="bn_2")(conv(self.width, 3, self.stride, "conv_2")(y))
        )
        y = BatchNorm(self.dtype, name="bn_3")(conv(4 * self.width, 1, 1, "conv_3")(y))
        if self.stride != 1 or x.shape[-1] != 4 * self.width:
            x = conv(4 * self.width, 1, self.stride, "shortcut")(x)
            x = BatchNorm(self.dtype, name="shortcut_bn")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    cfg: ResNetConfig

    @nn.compact
    def __call__(self, images):  # images: float32[B, H, W, 3]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        x = nn.Conv(
            cfg.hidden, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
            dtype=dtype, param_dtype=_F32, name="stem",
        )(images.astype(dtype))  # fmt: skip
        x = nn.relu(BatchNorm(dtype, name="stem_bn")(x))  # [B, H/2, W/2, hidden]
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=[(1, 1), (1, 1)])  # [B, H/4, ...]
        index = 0
        for stage, blocks in enumerate(_RESNET_STAGES[cfg.depth]):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                width = cfg.hidden * 2**stage
                x = Bottleneck(width, stride, dtype, name=f"layer_{index}")(x)
                index += 1
        x = jnp.mean(x.astype(_F32), axis=(1, 2)).astype(dtype)  # global average pool [B, C]
        return nn.Dense(cfg.classes, dtype=dtype, param_dtype=_F32, name="head")(x)


def _build(model: nn.Module, cfg: VggConfig | ResNetConfig) -> ModelParts:
    def init_params(key):
        return model.init(key, jnp.zeros((1, cfg.image, cfg.image, 3), _F32))

    def make_batch(key):
        ki, kl = jax.random.split(key)
        shape = (cfg.batch, cfg.image, cfg.image, 3)
        return {
            "images": jax.random.normal(ki, shape, _F32),
            "labels": jax.random.randint(kl, (cfg.batch,), 0, cfg.classes, jnp.int32),
        }

    def loss_fn(params, batch):
        return cross_entropy(model.apply(params, batch["images"]), batch["labels"])

    return ModelParts(init_params, make_batch, loss_fn)


def build_vgg(cfg: VggConfig) -> ModelParts:
    return _build(Vgg(cfg), cfg)


def build_resnet(cfg: ResNetConfig) -> ModelParts:
    return _build(ResNet(cfg), cfg)
