"""Run a training step under a plan: a jax Mesh, NamedShardings, sharding constraints.

XLA's SPMD partitioner does the work; this module only turns the plan's plain data into
`jax.jit(in_shardings=..., out_shardings=...)` and refuses, before anything runs, a plan
that cannot apply here (each refusal names the problem and the fix).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._errors import ApplyError, PlanError
from ._plan import Plan, Spec


def make_mesh(plan: Plan, devices: Sequence[Any] | None = None) -> Mesh:
    """The plan's mesh over the first prod(sizes) devices, row-major (last axis fastest),
    the order `Cluster.axis_links` assumes when it puts an axis inside a node."""
    devices = list(jax.devices() if devices is None else devices)
    need = plan.devices
    if need > len(devices):
        raise ApplyError(
            f"the plan needs {need} devices (mesh {dict(plan.mesh)}) but only "
            f"{len(devices)} are present. Run it where {need} devices are visible, or make "
            f"a plan for {len(devices)} devices (`automap plan --devices {len(devices)}`)."
        )
    if not plan.mesh:  # no axes: one device, everything replicated
        return Mesh(np.array(devices[:1]), ("_",))
    grid = np.array(devices[:need], dtype=object).reshape(tuple(plan.mesh.values()))
    return Mesh(grid, tuple(plan.mesh))


def check_plan(plan: Plan) -> None:
    """Refusals that need no arguments: unknown or repeated axis names.

    A pipeline plan's specs name the axes of its stages' meshes (never "pipe"): each
    stage runs every tensor it computes on its own sub-mesh."""
    meshes = [dict(plan.mesh)]
    if len(plan.stages) > 1:
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


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_divisible(what: str, shape: tuple[int, ...], spec: Spec, mesh: Mapping[str, int]):
    if len(spec) > len(shape):
        raise ApplyError(
            f"{what} has {len(shape)} dimensions {tuple(shape)} but its spec {spec} has "
            f"{len(spec)} entries; the plan was made for another program."
        )
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=False)):
        axes = _axes(entry)
        parts = math.prod(mesh[a] for a in axes)
        if size % parts:
            raise ApplyError(
                f"{what}: dimension {dim} of size {size} is not divisible by {parts}, the "
                f"size of mesh axes {axes} that split it. Choose a mesh whose axis sizes "
                "divide it, or leave that dimension unsplit."
            )


def _sharding(mesh: Mesh, spec: Spec) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*spec))


def _check_paths(plan: Plan, paths: list[str]) -> None:
    missing = [p for p in plan.specs if p not in set(paths)]
    unexpected = [p for p in paths if p not in plan.specs]
    if missing or unexpected:
        raise PlanError(
            "the arguments do not match the plan: the plan was made for another program. "
            f"Inputs the plan has but the call lacks: {missing or 'none'}; inputs of the "
            f"call the plan lacks: {unexpected or 'none'}. Make the plan for this step "
            "(`am.plan(step_fn, *args)`)."
        )


class Prepared:
    """The jitted step and its shardings for one argument structure (no data touched).

    `graph`, when the caller already captured `fn` on these arguments, saves a capture."""

    def __init__(
        self, fn: Callable, plan: Plan, mesh: Mesh, args: tuple, graph: Any = None
    ) -> None:
        self.feed = None
        if jax.process_count() > 1:  # each process feeds its share of the batch
            from ._distributed import Feed

            self.feed = Feed(fn, mesh, args, graph)
            args = self.feed.global_args  # the program is traced at the global shapes
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(args)
        paths = [jax.tree_util.keystr(p) for p, _ in flat]
        _check_paths(plan, paths)
        for path, (_, leaf) in zip(paths, flat, strict=True):
            check_divisible(f"input {path}", _shape(leaf), plan.specs[path], plan.mesh)
        self.in_shardings = [_sharding(mesh, plan.specs[p]) for p in paths]
        if graph is None and (plan.provenance.fingerprint or plan.constraints or plan.remat):
            from ._capture import capture  # lazily: capture is only needed for these

            graph = capture(fn, *args)
            if plan.provenance.fingerprint and plan.provenance.fingerprint != graph.fingerprint:
                raise PlanError(
                    f"the plan was made for another program (fingerprint "
                    f"{plan.provenance.fingerprint[:12]}…, this step's is "
                    f"{graph.fingerprint[:12]}…): same input paths, different computation "
                    "or shapes. Make a new plan for this step."
                )
        reinterpret = plan.constraints or plan.remat  # remat recomputes inside the program
        body = fn if not reinterpret else _constrained(graph, plan, mesh)
        out_flat = jax.tree_util.tree_flatten_with_path(jax.eval_shape(fn, *args))[0]
        out_paths = {jax.tree_util.keystr(p): leaf for p, leaf in out_flat}
        strange = sorted(set(plan.out_specs) - set(out_paths))
        if strange:
            raise PlanError(
                f"the plan has output specs for {strange}, which the step does not return "
                f"(its outputs: {sorted(out_paths)}); the plan was made for another program."
            )
        for path, spec in plan.out_specs.items():
            check_divisible(f"output {path}", out_paths[path].shape, spec, plan.mesh)
        out_shardings = {p: _sharding(mesh, s) for p, s in plan.out_specs.items()}

        def step(*flat_args: Any) -> Any:
            out = body(*jax.tree_util.tree_unflatten(self.treedef, flat_args))
            # An output spec acts like out_shardings; outputs without one are left to XLA.
            return jax.tree_util.tree_map_with_path(
                lambda p, x: (
                    jax.lax.with_sharding_constraint(x, out_shardings[jax.tree_util.keystr(p)])
                    if jax.tree_util.keystr(p) in out_shardings
                    else x
                ),
                out,
            )

        self.jitted = jax.jit(step, in_shardings=tuple(self.in_shardings))

    def abstract_args(self, args: tuple) -> list[jax.ShapeDtypeStruct]:
        """Flat abstract arguments carrying the plan's shardings (for lower/compile)."""
        leaves = jax.tree_util.tree_leaves(args)
        if self.feed is not None:  # the process-local batch shares stand for global arrays
            leaves = self.feed.global_leaves
        return [
            jax.ShapeDtypeStruct(_shape(x), _dtype(x), sharding=s)
            for x, s in zip(leaves, self.in_shardings, strict=True)
        ]

    def __call__(self, args: tuple) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        if self.feed is not None:
            return self.jitted(*self.feed.place(leaves, self.in_shardings))
        return self.jitted(*jax.device_put(leaves, self.in_shardings))


def _constrained(graph: Any, plan: Plan, mesh: Mesh) -> Callable:
    """The captured program re-run op by op, fixing the plan's internal tensors."""
    from ._interpret import eval_graph

    for tid, spec in plan.constraints.items():
        if not 0 <= tid < len(graph.tensors):
            raise PlanError(
                f"the plan constrains tensor {tid}, but the program has only "
                f"{len(graph.tensors)} tensors: the plan was made for another program."
            )
        check_divisible(f"internal tensor {tid}", graph.tensors[tid].shape, spec, plan.mesh)
    shardings = {tid: _sharding(mesh, spec) for tid, spec in plan.constraints.items()}

    def constrain(tid: int, value: Any) -> Any:
        s = shardings.get(tid)
        return value if s is None else jax.lax.with_sharding_constraint(value, s)

    def run(*args: Any) -> Any:
        outs = eval_graph(graph, jax.tree_util.tree_leaves(args), constrain=constrain)
        return jax.tree_util.tree_unflatten(graph.out_tree, list(outs))

    return run if not plan.remat else _recomputing(graph, constrain)


def _recomputing(graph: Any, constrain: Callable) -> Callable:
    """The captured program re-run with each layer's forward recomputed in the backward
    (`_remat`: Megatron's full recomputation), fixing the plan's internal tensors too."""
    from ._linkage import build_groups
    from ._remat import eval_recomputing, recompute_plan

    rc = recompute_plan(graph, build_groups(graph))
    wanted = [leaf.tensor for leaf in graph.outputs]

    def run(*args: Any) -> Any:
        env = {
            leaf.tensor: x
            for leaf, x in zip(graph.inputs, jax.tree_util.tree_leaves(args), strict=True)
        }
        outs = eval_recomputing(graph, rc, range(len(graph.ops)), env, wanted, constrain)
        return jax.tree_util.tree_unflatten(graph.out_tree, list(outs))

    return run


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else jax.numpy.result_type(x)


def _structure_key(args: tuple) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((_shape(x), str(_dtype(x))) for x in leaves)


def per_structure(make: Callable[[tuple], Any]) -> Callable[..., Any]:
    """`prepare(*args)`: `make(args)` once per argument structure (tree, shapes, dtypes;
    arrays or ShapeDtypeStructs), cached: checking and tracing happen once per structure."""
    cache: dict[Any, Any] = {}

    def prepare(*args: Any) -> Any:
        key = _structure_key(args)
        if key not in cache:
            cache[key] = make(args)
        return cache[key]

    return prepare


def apply(fn: Callable, plan: Plan, *, devices: Sequence[Any] | None = None) -> Callable:
    """A callable that runs `fn` with the plan's shardings on `devices` (default: all).

    The result computes what `fn` computes (up to float reassociation). Arguments may be
    numpy or jax arrays; they are placed with the plan's shardings. The step is traced
    and compiled once per argument structure.
    """
    if len(plan.stages) > 1:  # stages on sub-meshes, fed microbatch by microbatch
        from ._pipeline._runtime import apply_pipeline

        return apply_pipeline(fn, plan, devices)
    check_plan(plan)
    mesh = make_mesh(plan, devices)
    prepare = per_structure(lambda args: Prepared(fn, plan, mesh, args))

    def run(*args: Any) -> Any:
        return prepare(*args)(args)

    run.mesh = mesh  # type: ignore[attr-defined]
    run.prepare = prepare  # type: ignore[attr-defined]
    return run
