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


def auto_formats(shardings: Sequence[Any], donated: Sequence[int]) -> list[Any]:
    """The jit's input shardings with each donated leaf's layout left to XLA."""
    return [Format(Layout.AUTO, s) if i in donated else s for i, s in enumerate(shardings)]


def input_formats(compiled: Any) -> list[Format]:
    """The layout and sharding of each flat argument of a compiled step."""
    return list(compiled.input_formats[0])


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


def compile_laid(
    step: Callable,
    jit_options: dict[str, Any],
    abstract: Sequence[jax.ShapeDtypeStruct],
    donated: Sequence[int],
    options: dict[str, Any] | None = None,
) -> Any:
    """`step` compiled for `abstract` with its donated leaves laid out as XLA chooses, and
    each laid out as its output comes back (`jit_options`: jax.jit's other arguments;
    `options`: XLA's debug options for this compile)."""
    shardings = [x.sharding for x in abstract]
    compiled = _compile(
        step, jit_options, auto_formats(shardings, donated), None, abstract, options
    )
    ins, outs = input_formats(compiled), jax.tree_util.tree_leaves(compiled.output_formats)
    out_avals = jax.tree_util.tree_leaves(compiled.out_info)
    pairs = aliases(abstract, out_avals, donated)
    if all(ins[i].layout == outs[o].layout for i, o in pairs.items()):
        return compiled
    laid, pinned = list(ins), [Format(Layout.AUTO)] * len(outs)
    for i, o in pairs.items():  # each pair laid as the update leaves it, sharded as planned
        laid[i] = Format(outs[o].layout, ins[i].sharding)
        pinned[o] = outs[o]
    tree = jax.tree_util.tree_structure(compiled.output_formats)
    pinned_tree = jax.tree_util.tree_unflatten(tree, pinned)
    return _compile(step, jit_options, laid, pinned_tree, abstract, options)


def _compile(
    step: Callable,
    jit_options: dict[str, Any],
    in_formats: Sequence[Any],
    out_formats: Any,
    abstract: Sequence[jax.ShapeDtypeStruct],
    options: dict[str, Any] | None,
) -> Any:
    """One compile of `step`: `out_formats` None lays every output as XLA chooses."""
    out = Format(Layout.AUTO) if out_formats is None else out_formats
    jitted = jax.jit(step, in_shardings=tuple(in_formats), out_shardings=out, **jit_options)
    lowered = jitted.lower(*abstract)
    return lowered.compile(options) if options else lowered.compile()
