"""Which argument leaves a step donates: read from the step itself, once, at capture.

A step the user jitted with `donate_argnums`/`donate_argnames` hands XLA its old state to
write the new state over; one that is not holds both at the update. Capture records it on
each input leaf (`InputLeaf.donated`), so the cost model prices the step as it runs
(`_cost/_outputs.py`) and the runtime keeps the donation (`_run`)."""

from __future__ import annotations

from typing import Any

import jax


def donates(fn: Any) -> bool:
    """Whether `fn` is a `jax.jit` function with donate_argnums/donate_argnames."""
    info = getattr(fn, "_jit_info", None)
    return bool(getattr(info, "donate_argnums", ()) or getattr(info, "donate_argnames", ()))


def donated_leaves(fn: Any, args: tuple, n: int) -> tuple[int, ...]:
    """Flat indices of the argument leaves `fn` donates (when `fn` is a jitted function
    with donation), read from its own trace so that argnums and argnames both count.
    `args`: arrays, scalars or ShapeDtypeStructs; `n`: how many leaves they have."""
    if not donates(fn):
        return ()
    abstract = jax.eval_shape(lambda *a: a, *args)  # shapes and dtypes of any leaf kind
    flags = [a.donated for a in jax.tree_util.tree_leaves(fn.trace(*abstract).args_info)]
    return tuple(i for i, d in enumerate(flags) if d) if len(flags) == n else ()
