"""Run a training step under a plan: a jax Mesh, NamedShardings, sharding constraints.

XLA's SPMD partitioner does the work; this module only turns the plan's plain data into
`jax.jit(in_shardings=..., out_shardings=...)` and refuses, before anything runs, a plan
that cannot apply here (each refusal names the problem and the fix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._capture import capture
from .._errors import ApplyError, PlanError
from .._plan import Plan, Spec
from ._distributed import Feed
from ._interpret import eval_graph
from ._pipelined import apply_pipeline
from ._shared import (
    check_divisible,
    check_paths,
    leaf_dtype,
    leaf_shape,
    per_structure,
    validate_plan,
)


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


def _sharding(mesh: Mesh, spec: Spec) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*spec))


class Prepared:
    """The jitted step and its shardings for one argument structure (no data touched).

    `graph`, when the caller already captured `fn` on these arguments, saves a capture."""

    def __init__(
        self, fn: Callable, plan: Plan, mesh: Mesh, args: tuple, graph: Any = None
    ) -> None:
        self.feed = None
        if jax.process_count() > 1:  # each process feeds its share of the batch
            self.feed = Feed(fn, mesh, args, graph)
            args = self.feed.global_args  # the program is traced at the global shapes
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(args)
        paths = [jax.tree_util.keystr(p) for p, _ in flat]
        check_paths(plan, paths)
        for path, (_, leaf) in zip(paths, flat, strict=True):
            check_divisible(f"input {path}", leaf_shape(leaf), plan.specs[path], plan.mesh)
        self.in_shardings = [_sharding(mesh, plan.specs[p]) for p in paths]
        if graph is None and (plan.provenance.fingerprint or plan.constraints):
            graph = capture(fn, *args)
            if plan.provenance.fingerprint and plan.provenance.fingerprint != graph.fingerprint:
                raise PlanError(
                    f"the plan was made for another program (fingerprint "
                    f"{plan.provenance.fingerprint[:12]}…, this step's is "
                    f"{graph.fingerprint[:12]}…): same input paths, different computation "
                    "or shapes. Make a new plan for this step."
                )
        body = fn if not plan.constraints else _constrained(graph, plan, mesh)
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
            jax.ShapeDtypeStruct(leaf_shape(x), leaf_dtype(x), sharding=s)
            for x, s in zip(leaves, self.in_shardings, strict=True)
        ]

    def __call__(self, args: tuple) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        if self.feed is not None:
            return self.jitted(*self.feed.place(leaves, self.in_shardings))
        return self.jitted(*jax.device_put(leaves, self.in_shardings))


def _constrained(graph: Any, plan: Plan, mesh: Mesh) -> Callable:
    """The captured program re-run op by op, fixing the plan's internal tensors."""

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

    return run


def apply(fn: Callable, plan: Plan, *, devices: Sequence[Any] | None = None) -> Callable:
    """A callable that runs `fn` with the plan's shardings on `devices` (default: all).

    The result computes what `fn` computes (up to float reassociation). Arguments may be
    numpy or jax arrays; they are placed with the plan's shardings. The step is traced
    and compiled once per argument structure.
    """
    if plan.pipelined:  # stages on sub-meshes, fed microbatch by microbatch
        return apply_pipeline(fn, plan, devices)
    validate_plan(plan)
    mesh = make_mesh(plan, devices)
    prepare = per_structure(lambda args: Prepared(fn, plan, mesh, args))

    def run(*args: Any) -> Any:
        return prepare(*args)(args)

    run.mesh = mesh  # type: ignore[attr-defined]
    run.prepare = prepare  # type: ignore[attr-defined]
    return run
