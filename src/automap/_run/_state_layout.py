"""The layout in memory of a donating step's state: as XLA chooses it, and stable.

A parameter's gradient often comes out of its dot transposed. With the state in the
row-major layout XLA's TPU then copies the parameter and both Adam moments into the
gradient's layout to update them, and the results back: float32 temporaries the cost
model does not price (on a 2-layer Llama at data 4, 41 copies and 0.74x of XLA's buffers
priced; DESIGN.md, "Layouts of the state"). Laid out as XLA chooses (`Layout.AUTO`), the
state is updated where it lies.

A loop feeds each output back as the input it was donated for, so that pair must share
a layout, or every step moves the leaf before the step runs. XLA's choice does not
always keep it: where it does not, the step is compiled once more with each donated
leaf pinned where its update leaves it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.layout import Format, Layout


def input_formats(compiled: Any) -> list[Any]:
    """Where each flat argument of a compiled step goes: its layout and sharding, or its
    sharding alone for a typed PRNG key (its layout is its key data's, of another rank,
    which `jax.device_put` takes for no key)."""
    avals = compiled.in_avals[0]
    return [
        f.sharding if extended(a.dtype) else f
        for f, a in zip(compiled.input_formats[0], avals, strict=True)
    ]


def extended(dtype: Any) -> bool:
    """A dtype JAX lays out as data of another shape (a typed PRNG key's)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def aliases(ins: Sequence[Any], outs: Sequence[Any], donated: Sequence[int]) -> dict[int, int]:
    """Which output each donated input's buffer is given to, as JAX pairs them: each output
    in turn takes the first unpaired donated input of its shape and dtype."""
    free: dict[tuple, deque[int]] = defaultdict(deque)
    for i in donated:
        free[(tuple(ins[i].shape), ins[i].dtype)].append(i)
    pairs = {}
    for o, x in enumerate(outs):
        waiting = free.get((tuple(x.shape), x.dtype))
        if waiting:
            pairs[waiting.popleft()] = o
    return pairs


def laid_pairs(
    ins: Sequence[Any], outs: Sequence[Any], donated: Sequence[int], laid: Sequence[int]
) -> dict[int, int]:
    """The donated pairs (input: output, `aliases`) whose input is one of `laid`."""
    return {i: o for i, o in aliases(ins, outs, donated).items() if i in laid}


def laid_jit(
    step: Callable,
    jit_options: dict[str, Any],
    ins: Sequence[jax.ShapeDtypeStruct],
    out_tree: Any,
    pairs: dict[int, int],
    pinned: dict[int, Format] | None = None,
) -> Any:
    """`step` jitted (`jit_options`: donate_argnums and the rest) with the input and the
    output of each of `pairs` laid out as XLA chooses (`Layout.AUTO` on both, as JAX asks
    of a donated pair); `pinned`: each such input's format from a first compile, to lay
    the pair so both ways. `ins`: the abstract arguments, sharded as planned; `out_tree`:
    the step's outputs."""
    in_formats: list[Any] = [x.sharding for x in ins]
    out_formats: list[Any] = [None] * out_tree.num_leaves  # left to XLA
    for i, o in pairs.items():
        if pinned is None:
            in_formats[i], out_formats[o] = (
                Format(Layout.AUTO, ins[i].sharding),
                Format(Layout.AUTO),
            )
        else:
            in_formats[i], out_formats[o] = Format(pinned[i].layout, ins[i].sharding), pinned[i]
    out_shardings = jax.tree_util.tree_unflatten(out_tree, out_formats)
    return jax.jit(step, in_shardings=tuple(in_formats), out_shardings=out_shardings, **jit_options)


def unstable(compiled: Any, pairs: dict[int, int]) -> dict[int, Format]:
    """Where a compile lays some pair's input otherwise than its output: each pair's
    output format, to pin the pair to (`laid_jit`); empty where every pair agrees."""
    got_in = input_formats(compiled)
    got_out = jax.tree_util.tree_leaves(compiled.output_formats)
    if all(got_in[i].layout == got_out[o].layout for i, o in pairs.items()):
        return {}
    return {i: got_out[o] for i, o in pairs.items()}


def compiled_for(
    jitted: Any, abstract: Sequence[jax.ShapeDtypeStruct], options: dict[str, Any] | None
) -> Any:
    """`jitted` compiled for `abstract`; `options`: XLA's debug options for this compile."""
    lowered = jitted.lower(*abstract)
    return lowered.compile(options) if options else lowered.compile()
