"""Are a sharded step's outputs the unsharded step's, up to float reassociation?

Sharding changes the order of additions (a sum split over devices, then all-reduced), so
outputs differ in the last bits. Adam then amplifies that noise where a gradient is near
zero: its update m / (sqrt(v) + eps) is about +-lr whatever the gradient's size, so a
gradient of 1e-9 that flips sign moves a parameter by 2 x lr. The tolerance is therefore
relative to each output's scale (ATOL_SCALE of its largest magnitude), not absolute. A
real mistake is far outside it: a missing all-reduce leaves gradients (and Adam's moments)
off by the mesh-axis size, and the loss off outright.
"""

from __future__ import annotations

from typing import Any

import numpy as np

RTOL = 2e-4
ATOL = 2e-5
ATOL_SCALE = 5e-3  # of the leaf's largest magnitude


def compare_outputs(got: Any, want: Any) -> tuple[bool, float, str]:
    """(all close, largest absolute error, path of the worst leaf)."""
    import jax

    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    if got_tree != want_tree:
        return False, float("inf"), "output structure differs"
    ok, worst, worst_path = True, 0.0, ""
    for (path, g), w in zip(got_leaves, want_leaves, strict=True):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g64.shape != w64.shape:
            return False, float("inf"), f"{jax.tree_util.keystr(path)}: shape differs"
        if not g64.size:
            continue
        err = float(np.max(np.abs(g64 - w64)))
        scale = float(np.max(np.abs(w64)))
        ok &= bool(np.allclose(g64, w64, rtol=RTOL, atol=ATOL + ATOL_SCALE * scale))
        if err > worst:
            worst, worst_path = err, jax.tree_util.keystr(path)
    return ok, worst, worst_path
