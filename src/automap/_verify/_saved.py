"""`automap apply plan.json --check`: run a saved plan here and compare with one device.

A plan for a model too big to run here (or for more devices than this machine has) is
checked on a reduced variant of the same model: the same sharding pattern, parameter by
parameter (layer numbers ignored), on a mesh shrunk to the local devices.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._capture import capture, rebuild
from .._errors import PlanError
from .._plan import Plan, Spec
from .._run import apply
from .._zoo import get_model
from ._numerics import compare_outputs, reordered

# A model with more parameters than this is checked on a reduced variant: its full-size
# step would not fit in this machine's memory, or would take minutes on the CPU.
MAX_CHECK_PARAMS = 20_000_000
REDUCED = {
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "ff": 128,
    "batch": 8,
    "seq": 32,
    "image": 32,
    "vocab": 512,
    "experts": 4,
    "dtype": "float32",
}


def check_saved_plan(
    plan: Plan, *, run_only: bool = False, devices: Sequence[Any] | None = None
) -> dict[str, Any]:
    """Run `plan` on `devices` (default: JAX's default devices) and, unless `run_only`,
    compare its outputs with the unsharded step's."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    local = len(devices)
    step_fn, args, origin = rebuild(plan.provenance, abstract=True)
    _check_made_for(plan, args, origin)
    reduced_reason = reduce_reason(plan, args, local)
    overrides: dict[str, Any] = {}
    if reduced_reason:
        if not plan.provenance.model:
            return {
                "equal": False,
                "checked": False,
                "reason": f"{reduced_reason}; a --fn step cannot be reduced automatically: "
                "check it from Python with am.verify on smaller arguments.",
            }

        config = get_model(plan.provenance.model, **dict(plan.provenance.overrides)).config
        overrides = {k: v for k, v in REDUCED.items() if k in config}
    step_fn, args, origin = rebuild(plan.provenance, abstract=False, overrides=overrides)
    run_plan = _transfer(plan, step_fn, args, local) if reduced_reason else plan
    sharded = apply(step_fn, run_plan, devices=devices)(*args)
    result: dict[str, Any] = {
        "model": origin.get("model") or origin.get("fn"),
        "platform": devices[0].platform,
        "reduced": bool(reduced_reason),
        "reason": reduced_reason or "",
        "overrides": overrides,
        "mesh": dict(run_plan.mesh),
        "checked": not run_only,
    }
    if run_only:
        result["equal"] = True
        return result
    reference = jax.jit(step_fn)(*args)
    noise = reordered(step_fn, args, jax.devices()[: max(run_plan.devices, 2)])
    graph = capture(step_fn, *args)  # the roles and compute dtypes the comparison reads
    verdict = compare_outputs(sharded, reference, graph=graph, before=args, noise=noise)
    result.update(equal=verdict.equal, max_abs_err=verdict.max_abs_err, worst_output=verdict.leaf)
    return result


def _check_made_for(plan: Plan, args: tuple, origin: Mapping[str, Any]) -> None:
    """Refuse a plan whose inputs are not the step's its provenance rebuilds (a hand-edited
    provenance naming another model, say). A reduced check carries a plan over by path
    pattern, so it would otherwise run a replicated variant of that other model and call
    the plan DIFFERENT, or equal, having checked none of it."""
    import jax

    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]}
    if set(plan.specs) == paths:
        return
    made = origin.get("model") or origin.get("fn")
    overrides = dict(origin.get("overrides") or {})
    lacking = sorted(set(plan.specs) - paths) or sorted(paths - set(plan.specs))
    raise PlanError(
        f"the plan's inputs are not those of {made}{f' {overrides}' if overrides else ''}, "
        f"the step its provenance names ({len(plan.specs)} input paths in the plan, "
        f"{len(paths)} in the step; {lacking[0]} is in one only), so nothing here can check "
        "it: set provenance.model and provenance.overrides to the model the plan was made "
        "for, or re-create the plan with `automap plan`."
    )


def reduce_reason(plan: Plan, args: tuple, local: int) -> str:
    """Why `plan` is checked on a reduced variant here (too big, too many devices), or ""."""
    import jax

    leaves = jax.tree_util.tree_leaves(args)
    params = sum(math.prod(x.shape) for x in leaves)
    if params > MAX_CHECK_PARAMS:
        return f"the model is too big for a numeric check here ({params / 1e6:.0f}M numbers)"
    if plan.devices > local:
        return f"the plan needs {plan.devices} devices, this machine has {local}"
    return ""


def _pattern(path: str) -> str:
    """A parameter's path with layer numbers erased: layer_3 and layer_0 share a pattern."""
    return re.sub(r"\d+", "#", path)


def _shrink(mesh: Mapping[str, int], local: int) -> dict[str, int]:
    sizes = dict(mesh)
    while math.prod(sizes.values()) > local:
        axis = max(sizes, key=lambda a: sizes[a])
        sizes[axis] //= 2
    return sizes


def _fit(spec: Spec, shape: tuple[int, ...], mesh: Mapping[str, int]) -> Spec:
    """Keep each axis of `spec` only where it still divides the (reduced) dimension."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=False):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in axes if a in mesh and mesh[a] > 1)
        size = math.prod(mesh[a] for a in kept)
        if not kept or dim % size:
            out.append(None)
        else:
            out.append(kept[0] if len(kept) == 1 else kept)
    return tuple(out)


def _transfer(plan: Plan, step_fn: Any, args: tuple, local: int) -> Plan:
    """The plan's sharding pattern on another (reduced) program of the same model."""
    import jax

    mesh = _shrink(plan.mesh, local)
    by_pattern = {_pattern(p): s for p, s in plan.specs.items()}
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        key = jax.tree_util.keystr(path)
        spec = by_pattern.get(_pattern(key), ())
        specs[key] = _fit(spec, tuple(np.shape(leaf)), mesh)
    # The new params and optimizer state keep the pattern the plan gave them.
    out_by_pattern = {_pattern(p): s for p, s in plan.out_specs.items()}
    out_specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(jax.eval_shape(step_fn, *args))[0]:
        key = jax.tree_util.keystr(path)
        if _pattern(key) in out_by_pattern:
            out_specs[key] = _fit(out_by_pattern[_pattern(key)], tuple(leaf.shape), mesh)
    provenance = dataclasses.replace(plan.provenance, fingerprint="")
    return dataclasses.replace(
        plan,
        mesh=mesh,
        specs=specs,
        out_specs=out_specs,
        constraints={},
        provenance=provenance,
    )
