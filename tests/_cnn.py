"""A small convolutional step with VGG's head (conv, flatten, dense layers): the shape the
batch seams and the "one weird trick" expert are about. Shared by several test modules."""

import jax
import jax.numpy as jnp

from automap._capture import capture
from automap._groups import build_groups


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def cnn_loss(params, images, labels):
    """A convolution, a flatten and two dense layers: the shape of VGG's head."""
    h = jax.lax.conv_general_dilated(
        images, params["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jax.nn.relu(h).reshape(h.shape[0], -1)
    logits = jnp.tanh(h @ params["w1"]) @ params["w2"]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1).mean()


CNN_ARGS = (
    {"conv": sds(3, 3, 3, 8), "w1": sds(8 * 8 * 8, 64), "w2": sds(64, 16)},
    sds(16, 8, 8, 3),
    sds(16, dtype=jnp.int32),
)


def cnn(seams=True):
    """The captured gradient step and its groups."""
    graph = capture(jax.grad(cnn_loss), *CNN_ARGS, roles={0: "param", 1: "batch", 2: "batch"})
    return graph, build_groups(graph, seams=seams)
