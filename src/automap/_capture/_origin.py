"""Where a step comes from: a zoo model with overrides, or a user's `module:function`.

A plan records its origin in its provenance, so `automap apply plan.json` can rebuild
the same step (and, for a model too big to run here, a reduced variant of it).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._errors import AutomapError
from .._zoo import get_model

Origin = dict[str, Any]


def load_zoo(
    name: str, overrides: Mapping[str, Any], *, abstract: bool, seed: int = 0
) -> tuple[Callable, tuple, Origin]:

    spec = get_model(name, **dict(overrides))
    args = spec.abstract_args() if abstract else spec.concrete_args(seed)
    return spec.step_fn, args, {"model": name, "overrides": dict(overrides)}


def load_fn(target: str) -> tuple[Callable, tuple, Origin]:
    """Import `package.module:function` and call it; it must return `(step_fn, args)`."""
    if ":" not in target:
        raise AutomapError(
            f"--fn takes package.module:function, got {target!r} "
            "(the function returns (step_fn, args))."
        )
    module_name, func_name = target.split(":", 1)
    # Let a user point at a module in the working directory without installing it.
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise AutomapError(
            f"cannot import {module_name!r} ({e}); run from the directory that holds it "
            "or install its package."
        ) from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise AutomapError(f"{module_name} has no function {func_name!r}.")
    result = factory()
    # A dict or a single array as `args` would be iterated into keys or rows: refuse it.
    if not (
        isinstance(result, tuple)
        and len(result) == 2
        and callable(result[0])
        and isinstance(result[1], (tuple, list))
    ):
        got = (
            f" (args is a {type(result[1]).__name__})"
            if isinstance(result, tuple) and len(result) == 2
            else ""
        )
        raise AutomapError(
            f"{target} must return (step_fn, args) where args is a tuple of the step's "
            f"positional arguments{got}: e.g. return step, (params, batch)."
        )
    step_fn, args = result
    return step_fn, tuple(args), {"fn": target}


def rebuild(provenance: Any, *, abstract: bool, overrides: Mapping[str, Any] | None = None):
    """(step_fn, args, origin) for the program a plan was made for."""
    if provenance.model:
        merged = {**dict(provenance.overrides), **dict(overrides or {})}
        return load_zoo(provenance.model, merged, abstract=abstract)
    if provenance.fn:
        step_fn, args, origin = load_fn(provenance.fn)
        return step_fn, (args if abstract else _concrete(args)), origin
    raise AutomapError(
        "this plan does not say which program it was made for (no model and no --fn in its "
        "provenance): apply it from Python with am.apply(step_fn, plan)."
    )


def _concrete(args: tuple) -> tuple:
    """Random arrays for any ShapeDtypeStruct leaves, so a --fn step can run a check."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)

    def fill(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            if jnp.issubdtype(x.dtype, jnp.floating):
                return jnp.asarray(rng.normal(size=x.shape) * 0.02, dtype=x.dtype)
            return jnp.zeros(x.shape, x.dtype)
        return x

    return jax.tree_util.tree_map(fill, args)
