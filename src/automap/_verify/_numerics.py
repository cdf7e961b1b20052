"""Are a sharded step's outputs the unsharded step's, up to float reassociation?

Sharding changes the order of additions (a sum split over devices, then all-reduced), so
outputs differ in the last bits, and how far depends on the program: bf16 compute has
~1e-2 of noise where float32 has ~1e-7, and Adam amplifies it where a gradient is near
zero: its update m / (sqrt(v) + eps) is about +-lr whatever the gradient's size, so a
zero-initialized bias whose gradient is 1e-9 of rounding (the key bias of attention, whose
true gradient is 0) moves by +-lr either way. A fixed tolerance either cries wolf on those
or hides real mistakes elsewhere.

So the check measures the noise instead of guessing it. `reordered` runs the unsharded
step once more with its inputs split over a few devices: the same mathematics summed in
another order. Per output leaf, the tolerance is NOISE_FACTOR x that run's largest error
(plus a small floor relative to the leaf's scale). Parameters (an output leaf with the
input leaf of the same path, past the argument index) may instead move by up to FLIP x
their largest update when the optimizer is seen to amplify noise (the reordered run moved
some parameter leaf beyond its floor): an update's sign may flip, its size may not grow. A
plain SGD never earns that allowance: its update is lr x gradient, and reordering noise
stays at the floor. Real mistakes stay far outside: a missing all-reduce leaves gradients
and Adam's moments off by the mesh-axis size, and the loss off outright; a parameter
moved by more than two updates fails.

Without a reordered run (one device, or a program that will not split) the fixed
tolerance of earlier versions is used: RTOL, and ATOL plus ATOL_SCALE of the leaf's scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

RTOL = 2e-4
ATOL = 2e-5
ATOL_SCALE = 5e-3  # of the leaf's largest magnitude (no reordered run to measure noise)

#: With a reordered run: a floor of the leaf's largest magnitude (float32's rounding of a
#: long sum, far below any real mistake), times how much noisier the plan's order may be
#: than the reordered run's (measured: up to 3x in bf16), and how many updates a flipped
#: parameter may move (+lr to -lr).
SCALE_FLOOR = 1e-4
NOISE_FACTOR = 8.0
FLIP = 2.0


def compare_outputs(
    got: Any, want: Any, *, noise: Any = None, before: Any = None
) -> tuple[bool, float, str]:
    """(all close, largest absolute error, the first leaf out of tolerance or else the
    leaf of the largest error).

    `noise`: the unsharded step run in another order (`reordered`), whose distance from
    `want` sets each leaf's tolerance; `before`: the step's arguments, so that updated
    parameters can be told from other outputs (see the module doc)."""
    import jax

    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    if got_tree != want_tree:
        return False, float("inf"), "output structure differs"
    paths = [jax.tree_util.keystr(path) for path, _ in got_leaves]
    noisy = _leaves_like(noise, want_tree)
    inputs = _by_path(before) if noisy is not None else {}
    leaves = []
    for (path, g), w, n in zip(got_leaves, want_leaves, noisy or [None] * len(paths), strict=True):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g64.shape != w64.shape:
            return False, float("inf"), f"{jax.tree_util.keystr(path)}: shape differs"
        prior = inputs.get(_key(path, w)) if noisy is not None else None
        leaves.append((g64, w64, None if n is None else np.asarray(n, np.float64), prior))
    # The optimizer amplifies noise when reordering alone moves a parameter past its floor.
    amplifies = any(
        prior is not None and w.size and np.any(np.abs(n - w) > _floor(w))
        for _, w, n, prior in leaves
    )
    ok, worst, worst_path, failed = True, 0.0, "", ""
    for path, (g, w, n, prior) in zip(paths, leaves, strict=True):
        if not w.size:
            continue
        err = np.abs(g - w)
        if n is None:
            tol = ATOL + ATOL_SCALE * np.max(np.abs(w)) + RTOL * np.abs(w)
        else:
            if amplifies and prior is not None:
                # Reordering flips updates (that is its noise here), never enlarges them.
                tol = _floor(w) + FLIP * np.max(np.abs(w - prior))
            else:
                tol = _floor(w) + NOISE_FACTOR * np.max(np.abs(n - w))
        leaf_ok = bool(np.all(err <= tol))
        if not leaf_ok and not failed:
            failed = path
        ok &= leaf_ok
        if float(err.max()) > worst:
            worst, worst_path = float(err.max()), path
    return ok, worst, failed or worst_path


def reordered(fn: Any, args: Sequence[Any], devices: Sequence[Any]) -> Any:
    """`fn(*args)` with every input split on its first dimension the devices divide:
    the unsharded mathematics, summed in another order. None with fewer than two devices,
    or when the program will not run split (then the fixed tolerance applies)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(devices) < 2:
        return None
    mesh = Mesh(np.array(list(devices)), ("reorder",))

    def split(x: Any) -> NamedSharding:
        dims = [d for d, size in enumerate(np.shape(x)) if size % len(devices) == 0]
        spec = [None] * (dims[0] + 1) if dims else []
        if dims:
            spec[dims[0]] = "reorder"
        return NamedSharding(mesh, PartitionSpec(*spec))

    try:
        placed = jax.device_put(tuple(args), jax.tree_util.tree_map(split, tuple(args)))
        return jax.device_get(jax.jit(fn)(*placed))
    except Exception:  # any failure only means no noise measurement: the fixed tolerance
        return None


def _floor(w: np.ndarray) -> np.ndarray:
    return RTOL * np.abs(w) + SCALE_FLOOR * float(np.max(np.abs(w)))


def _leaves_like(noise: Any, tree: Any) -> list | None:
    import jax

    if noise is None:
        return None
    leaves, noise_tree = jax.tree_util.tree_flatten(noise)
    return leaves if noise_tree == tree else None


def _key(path: tuple, value: Any) -> tuple:
    """A leaf's path past its first entry (the output's or argument's index), with its
    shape and dtype: `[1]['params']['w']` out of `(loss, params, opt)` pairs with
    `[0]['params']['w']` of `(params, opt, batch)`."""
    import jax

    return jax.tree_util.keystr(path[1:]), np.shape(value), str(getattr(value, "dtype", None))


def _by_path(before: Any) -> dict[tuple, np.ndarray]:
    """Float input leaves by `_key`; a key two inputs share pairs with neither."""
    import jax

    if before is None:
        return {}
    out: dict[tuple, Any] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(before)[0]:
        if not jax.numpy.issubdtype(getattr(x, "dtype", None), jax.numpy.floating) or not path:
            continue
        key = _key(path, x)
        out[key] = None if key in out else np.asarray(x, np.float64)
    return {k: v for k, v in out.items() if v is not None}
