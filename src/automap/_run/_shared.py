"""What the one-stage and the pipelined runtimes share: the checks that refuse a plan
before anything runs (each naming the problem and the fix), the shape and dtype of an
argument leaf (array, scalar or ShapeDtypeStruct), and the per-structure cache of
prepared programs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.layout import Format

from .._errors import ApplyError, PlanError
from .._plan import Plan, Spec


def validate_plan(plan: Plan) -> None:
    """Refusals that need no arguments: unknown or repeated axis names.

    A pipeline plan's specs name the axes of its stages' meshes (never "pipe"): each
    stage runs every tensor it computes on its own sub-mesh."""
    meshes = [dict(plan.mesh)]
    if plan.pipelined:
        meshes = [dict(stage.mesh) for stage in plan.stages]
    where = [("input", p, s) for p, s in plan.specs.items()]
    where += [("output", p, s) for p, s in plan.out_specs.items()]
    where += [("internal tensor", str(t), s) for t, s in plan.constraints.items()]
    for what, path, spec in where:
        used = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        for mesh in meshes:
            unknown = sorted(set(used) - set(mesh))
            if unknown:
                kind = "a pipeline stage's mesh" if len(meshes) > 1 else "the plan's mesh"
                raise PlanError(
                    f"the spec {spec} of {what} {path} names mesh axes {unknown} that "
                    f"{kind} {mesh} does not have. Fix the spec or the mesh."
                )
        if len(used) != len(set(used)):
            raise PlanError(
                f"the spec {spec} of {what} {path} uses one mesh axis twice; an axis can "
                "split only one dimension of a tensor."
            )


def check_device_count(plan: Plan, have: int) -> None:
    """One line where the plan needs more devices than are visible."""
    need = plan.devices
    if need > have:
        present = "1 is" if have == 1 else f"{have} are"
        raise ApplyError(
            f"the plan needs {need} devices (mesh {dict(plan.mesh)}) but only {present} "
            f"present. Run it where {need} devices are visible, or make a plan for {have} "
            f"device{'' if have == 1 else 's'} (`automap plan --devices {have}`)."
        )


def mesh_axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_divisible(what: str, shape: tuple[int, ...], spec: Spec, mesh: Mapping[str, int]):
    if len(spec) > len(shape):
        raise ApplyError(
            f"{what} has {len(shape)} dimensions {tuple(shape)} but its spec {spec} has "
            f"{len(spec)} entries; the plan was made for another program."
        )
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=False)):
        axes = mesh_axes(entry)
        parts = math.prod(mesh[a] for a in axes)
        if size % parts:
            raise ApplyError(
                f"{what}: dimension {dim} of size {size} is not divisible by {parts}, the "
                f"size of mesh axes {axes} that split it. Choose a mesh whose axis sizes "
                "divide it, or leave that dimension unsplit."
            )


def _first(items: list[str], n: int = 3) -> str:
    """The first `n` items and how many more: a big model's paths fill kilobytes."""
    if not items:
        return "none"
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def check_paths(plan: Plan, paths: list[str]) -> None:
    missing = [p for p in plan.specs if p not in set(paths)]
    unexpected = [p for p in paths if p not in plan.specs]
    if missing or unexpected:
        raise PlanError(
            "the arguments do not match the plan: the plan was made for another program. "
            f"Inputs the plan has but the call lacks: {_first(missing)}; inputs of the "
            f"call the plan lacks: {_first(unexpected)}. Make the plan for this step "
            "(`am.plan(step_fn, *args)`)."
        )


def other_program(plan: Plan, graph: Any) -> str:
    """Why a plan's fingerprint differs from this step's, as plainly as the plan allows:
    the batch size when that is what changed, else the input shapes or the computation."""
    made, now = plan.provenance.batch, graph.batch_rows
    if made is not None and now is not None and made != now:
        return (
            f"the plan was made for another program: batch size {made}, this call's batch "
            f"is {now}. Make a plan for batch {now} (`am.plan(step_fn, *args)`) or call with "
            f"batches of {made}."
        )
    return (
        f"the plan was made for another program (fingerprint "
        f"{plan.provenance.fingerprint[:12]}…, this step's is {graph.fingerprint[:12]}…): "
        "same input paths, different computation or shapes. Make a new plan for this step."
    )


def leaf_shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def leaf_dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else jax.numpy.result_type(x)


def structure_key(args: tuple) -> Any:
    # dtype objects, not their names: this runs on every call, and naming a dtype costs
    # more than the rest of the key (9.6 of 19 ms a step over bert-large's 1,200 leaves
    # on an H200's host, `benchmarks/bench_h200_kernels.py`).
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((leaf_shape(x), leaf_dtype(x)) for x in leaves)


def placed(leaves: list[Any], shardings: list[Any], donated: Sequence[int] = ()) -> list[Any]:
    """The leaves with the plan's shardings (or `Format`s: shardings with a layout in
    memory): moved by one `jax.device_put` of those not already laid out so (numpy
    arrays, scalars, arrays sharded or laid otherwise). A training loop feeds back the
    step's own outputs, already placed: `device_put` of those moves nothing but still
    costs ~60 us a leaf of host time before the step is dispatched, 70-78 ms a step for
    gpt-1.3b's and bert-large's parameters and Adam moments on an H200
    (`benchmarks/bench_h200_kernels.py`), while the GPU waited. A `donated` array laid
    out anew on its own devices is given up to its copy, as the step would take it: a
    chip that holds the state once need not hold it twice to lay it out again."""
    moving = [
        i
        for i, (x, s) in enumerate(zip(leaves, shardings, strict=True))
        if not (isinstance(x, jax.Array) and _laid(x, s))
    ]
    if not moving:
        return list(leaves)
    out = list(leaves)
    given = [i in donated and _relaid(leaves[i], shardings[i]) for i in moving]
    moved = jax.device_put(
        [leaves[i] for i in moving], [shardings[i] for i in moving], donate=given
    )
    for i, x in zip(moving, moved, strict=True):
        out[i] = x
    return out


def _relaid(x: Any, where: Any) -> bool:
    """Whether moving `x` to `where` only lays it out anew (a `Format` of its sharding)."""
    return isinstance(x, jax.Array) and isinstance(where, Format) and x.sharding == where.sharding


def _laid(x: jax.Array, where: Any) -> bool:
    """Whether `x` is already where `where` (a sharding, or a `Format`: a sharding and a
    layout in memory) puts it."""
    if isinstance(where, Format):
        return x.format == where
    return x.sharding == where


def per_structure(make: Callable[[tuple], Any]) -> Callable[..., Any]:
    """`prepare(*args)`: `make(args)` once per argument structure (tree, shapes, dtypes;
    arrays or ShapeDtypeStructs), cached: checking and tracing happen once per structure."""
    cache: dict[Any, Any] = {}

    def prepare(*args: Any) -> Any:
        key = structure_key(args)
        if key not in cache:
            cache[key] = make(args)
        return cache[key]

    return prepare


def check_micro_divisible(what: str, shape, spec, mesh) -> None:
    """`check_divisible` of a pipeline's per-microbatch tensor, at its microbatch's shape."""
    try:
        check_divisible(what, tuple(shape), spec, mesh)
    except ApplyError as e:
        raise ApplyError(
            f"{e} (On a pipeline stage a per-microbatch tensor has the microbatch's batch "
            "size: fewer microbatches or a smaller data axis may fit.)"
        ) from None
