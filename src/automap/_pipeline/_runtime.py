"""Run a pipeline plan: per-stage jitted programs on sub-meshes, fed microbatch by microbatch.

One controller (this process) dispatches the work in `_schedule.global_order`: the pre
segments, then every (stage, "F"/"B", microbatch) unit, then the post segments. JAX
dispatch is asynchronous, so units on different stages' devices overlap as the schedule
intends; a value crossing stages is a `jax.device_put` onto the receiving stage's mesh
(the point-to-point send), keeping the sender's layout when the receiver's mesh has it.

Where the work goes, for the cost model:
- Inside a stage, each segment is an SPMD program over that stage's mesh. Its collectives
  are those XLA inserts for the plan's specs, *per microbatch*: a data-parallel gradient
  of a weight is all-reduced inside every "B" segment (the batch-free gradient leaves the
  segment reduced), m times per step, not once after accumulation.
- Accumulated tensors (gradients, the loss sum) are added up on their stage as the "B"
  (or "F") units finish, in the schedule's order (GPipe adds the last microbatch first):
  one buffer per tensor, no extra copy per microbatch.
- Per-step work (pre: weight casts; post: the loss division, the optimizer update) runs
  once on the full batch's shapes, on the stage the partition gives it.
- A microbatch's residuals (forward values its backward reads) are dropped after the last
  segment that reads them, so a stage holds those of the microbatches in flight.

`run.compile(*args)` walks the same step on abstract values instead (`_Dry`): every
segment is compiled for the shardings the live step would hand it, nothing runs. That is
what `am.verify` reads the collectives of.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._apply import _check_paths, _dtype, _shape, check_divisible, check_plan, per_structure
from .._errors import ApplyError, PlanError
from .._graph import TensorKind
from .._interpret import eval_ops
from .._plan import Plan
from .._remat import eval_recomputing, recompute_plan
from ._partition import Phase, partition
from ._schedule import SCHEDULES, global_order
from ._segments import (
    Segment,
    batch_dim,
    check_same_program,
    micro_args,
    micro_consts,
    readers,
    recompute_segments,
    segments,
)


def apply_pipeline(fn: Callable, plan: Plan, devices: Sequence[Any] | None = None) -> Callable:
    """A callable running `fn` under the pipeline plan `plan`; same convention as `apply`.

    The result's `trace` attribute is the (stage, "F"/"B", microbatch) sequence the last
    call executed: `global_order(stages, microbatches, schedule)`.
    """
    check_plan(plan)
    meshes = stage_meshes(plan, devices)
    prepare = per_structure(lambda args: _Pipeline(fn, plan, meshes, args))

    def run(*args: Any) -> Any:
        pipe = prepare(*args)
        out = pipe(args)
        run.trace = tuple(pipe.trace)  # type: ignore[attr-defined]
        return out

    run.meshes = meshes  # type: ignore[attr-defined]
    run.prepare = prepare  # type: ignore[attr-defined]
    run.compile = lambda *args: prepare(*args).compile(args)  # type: ignore[attr-defined]
    run.trace = ()  # type: ignore[attr-defined]
    return run


def stage_meshes(plan: Plan, devices: Sequence[Any] | None = None) -> list[Mesh]:
    """Each stage's sub-mesh over its devices, row-major like `_apply.make_mesh`."""
    devices = list(jax.devices() if devices is None else devices)
    if plan.schedule not in SCHEDULES:
        raise PlanError(
            f"unknown pipeline schedule {plan.schedule!r}; use one of {', '.join(SCHEDULES)}."
        )
    if plan.microbatches < 1:
        raise PlanError(f"a plan needs at least one microbatch, not {plan.microbatches}.")
    if plan.devices > len(devices):
        raise ApplyError(
            f"the plan needs {plan.devices} devices (mesh {dict(plan.mesh)}) but only "
            f"{len(devices)} are present. Run it where {plan.devices} devices are visible, "
            f"or make a plan for {len(devices)} devices."
        )
    meshes = []
    for s, stage in enumerate(plan.stages):
        need = math.prod(stage.mesh.values()) if stage.mesh else 1
        if len(stage.devices) != need:
            raise PlanError(
                f"pipeline stage {s} has {len(stage.devices)} devices but its mesh "
                f"{dict(stage.mesh)} needs {need}. Fix the plan's stages."
            )
        bad = [i for i in stage.devices if not 0 <= i < len(devices)]
        if bad:
            raise ApplyError(
                f"pipeline stage {s} names devices {bad}, but only {len(devices)} are "
                f"present (indices 0 to {len(devices) - 1}). Make a plan for these devices."
            )
        grid = np.array([devices[i] for i in stage.devices], dtype=object)
        if not stage.mesh:
            meshes.append(Mesh(grid[:1], ("_",)))
        else:
            meshes.append(Mesh(grid.reshape(tuple(stage.mesh.values())), tuple(stage.mesh)))
    return meshes


class _Pipeline:
    """The segments of one argument structure, jitted once, and how to run a step."""

    def __init__(self, fn: Callable, plan: Plan, meshes: list[Mesh], args: tuple) -> None:
        from .._capture import capture
        from .._linkage import build_groups

        self.plan, self.meshes, m = plan, meshes, plan.microbatches
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(_shape(x), _dtype(x)), args
        )
        full = capture(fn, *abstract)
        if plan.provenance.fingerprint and plan.provenance.fingerprint != full.fingerprint:
            raise PlanError(
                f"the plan was made for another program (fingerprint "
                f"{plan.provenance.fingerprint[:12]}…, this step's is "
                f"{full.fingerprint[:12]}…): same input paths, different computation or "
                "shapes. Make a new plan for this step."
            )
        _check_paths(plan, [leaf.path for leaf in full.inputs])
        groups = build_groups(full)
        bounds = [(s.op_start, s.op_stop) for s in plan.stages]
        part = partition(full, groups, bounds, m)
        micro = full if m == 1 else capture(fn, *micro_args(full, groups, part, abstract, m))
        if micro is not full:
            check_same_program(full, micro, groups, m)
        self.graph, self.part, self.groups = full, part, groups
        self.pre, self.micro, self.post = segments(full, part)
        if plan.remat:  # each B segment recomputes its stage's layers from their inputs
            self.micro = recompute_segments(full, self.micro, recompute_plan(full, groups))
        self.readers = readers(self.micro)
        self.per_mb = {
            t
            for seg in self.micro
            for i in seg.ops
            for t in full.ops[i].outputs
            if part.op_phase[i] in (Phase.FWD, Phase.BWD)
        }
        self.spec = {leaf.tensor: plan.specs[leaf.path] for leaf in full.inputs}
        self._check_inputs(micro)
        consts = micro_consts(full, micro)
        self.jitted = {
            id(seg): self._compile(seg, micro if seg.kind in "FB" else full, consts)
            for seg in (*self.pre, *self.micro, *self.post)
            if seg.ops
        }
        self.trace: list[tuple[int, str, int]] = []

    def _check_inputs(self, micro) -> None:
        """Every spec must divide its tensor on each stage mesh, at the microbatch's shapes
        where the tensor lives per microbatch."""
        readers_of: dict[int, set[int]] = {}
        for seg in (*self.pre, *self.micro, *self.post):
            for t in seg.inputs:
                readers_of.setdefault(t, set()).add(seg.stage)
        for leaf in self.graph.inputs:
            for s in sorted(readers_of.get(leaf.tensor, ())):
                mesh = dict(self.plan.stages[s].mesh)
                shape = self.graph.tensors[leaf.tensor].shape
                check_divisible(f"input {leaf.path}", shape, self.spec[leaf.tensor], mesh)
                if leaf.tensor in self.part.batched:
                    _micro_divisible(
                        f"input {leaf.path}",
                        micro.tensors[leaf.tensor].shape,
                        self.spec[leaf.tensor],
                        mesh,
                    )

    def _compile(self, seg: Segment, graph, consts) -> Callable:
        mesh, stage_mesh = self.meshes[seg.stage], dict(self.plan.stages[seg.stage].mesh)
        wanted = dict(self.plan.constraints)
        for leaf in self.graph.outputs:  # an output spec acts as a constraint where it is made
            if leaf.path in self.plan.out_specs and leaf.tensor not in self.part.batched:
                wanted.setdefault(leaf.tensor, self.plan.out_specs[leaf.path])
        shardings = {}
        again = seg.recompute.ops if seg.recompute is not None else ()
        for i in (*seg.ops, *sorted(again)):
            for t in graph.ops[i].outputs:
                if t in wanted:
                    what = f"internal tensor {t} (on pipeline stage {seg.stage})"
                    _micro_divisible(what, graph.tensors[t].shape, wanted[t], stage_mesh)
                    shardings[t] = NamedSharding(mesh, PartitionSpec(*wanted[t]))
        use = consts if seg.kind in "FB" else None

        def constrain(tid: int, value: Any) -> Any:
            s = shardings.get(tid)
            return value if s is None else jax.lax.with_sharding_constraint(value, s)

        def body(*values: Any) -> tuple[Any, ...]:
            env = dict(zip(seg.inputs, values, strict=True))
            if seg.recompute is not None:
                rc = seg.recompute
                return tuple(eval_recomputing(graph, rc, seg.ops, env, seg.outputs, constrain, use))
            return tuple(eval_ops(graph, seg.ops, env, seg.outputs, constrain, use))

        return jax.jit(body)

    # ---- one step ------------------------------------------------------------------------

    def __call__(self, args: tuple) -> Any:
        graph = self.graph
        step, self.trace = self._step(args, _LIVE)
        flat = [
            jnp.asarray(graph.const_values[t] if t not in step else step[t])
            if graph.tensors[t].kind is not TensorKind.INTERMEDIATE
            else step[t]
            for t in (leaf.tensor for leaf in graph.outputs)
        ]
        return jax.tree_util.tree_unflatten(graph.out_tree, flat)

    def compile(self, args: tuple) -> tuple[SegmentProgram, ...]:
        """Every program one step on `args` runs, compiled as the step would compile it
        (same jitted segments, same input shardings), without running anything."""
        dry = _Dry(self.meshes)
        abstract = [jax.ShapeDtypeStruct(_shape(x), _dtype(x)) for x in jax.tree.leaves(args)]
        self._step(tuple(abstract), dry)
        return tuple(dry.programs.values())

    def _step(self, args: tuple, ops: _Live) -> tuple[dict[int, Any], list]:
        """One step in the schedule's order: (every tensor of the step by id, the trace).
        `ops` moves and combines the values: real arrays (`_LIVE`) or abstract (`_Dry`)."""
        graph, part, m = self.graph, self.part, self.plan.microbatches
        leaves = jax.tree_util.tree_leaves(args)
        step: dict[int, Any] = {
            leaf.tensor: x for leaf, x in zip(graph.inputs, leaves, strict=True)
        }
        placed: dict[tuple[int, int], Any] = {}  # a per-step value's copy on a stage

        def on_stage(t: int, s: int) -> Any:
            if (t, s) not in placed:
                placed[(t, s)] = self._place(t, step[t], s, ops)
            return placed[(t, s)]

        def run_steps(segs: list[Segment]) -> None:
            for seg in segs:
                outs = self._run(seg, [on_stage(t, seg.stage) for t in seg.inputs], ops)
                for t, v in zip(seg.outputs, outs, strict=True):
                    step[t], placed[(t, seg.stage)] = v, v

        run_steps(self.pre)
        made: list[dict[int, Any]] = [{} for _ in range(m)]  # per-microbatch values
        copies: list[dict[tuple[int, int], Any]] = [{} for _ in range(m)]
        left = [dict(self.readers) for _ in range(m)]
        acc: dict[int, Any] = {}
        pieces: dict[int, list[Any]] = {}  # batched step outputs made per microbatch
        accumulated = set(part.accumulated)
        outputs = {leaf.tensor for leaf in graph.outputs}

        def mb_value(t: int, i: int, s: int) -> Any:
            if (t, s) in copies[i]:
                return copies[i][(t, s)]
            if t in self.per_mb:
                v = self._send(made[i][t], s, ops)
            elif t in part.batched:  # a per-step value: this microbatch's slice of it
                d = batch_dim(self.groups, t)
                v = self._place(t, ops.slice(step[t], d, i, m), s, ops)
            else:
                return on_stage(t, s)
            copies[i][(t, s)] = v
            return v

        trace = []
        by_unit = {(seg.stage, seg.kind): seg for seg in self.micro}
        for s, kind, i in global_order(len(self.meshes), m, self.plan.schedule):
            seg = by_unit[(s, kind)]
            outs = self._run(seg, [mb_value(t, i, s) for t in seg.inputs], ops)
            for t, v in zip(seg.outputs, outs, strict=True):
                if t in self.readers:
                    made[i][t], copies[i][(t, s)] = v, v
                if t in accumulated:
                    acc[t] = v if t not in acc else ops.add(acc[t], v, s)
                elif t in outputs and t in part.batched:
                    pieces.setdefault(t, [None] * m)[i] = v
            for t in seg.inputs:  # drop what no later unit of this microbatch reads
                left[i][t] -= 1
                if not left[i][t]:
                    made[i].pop(t, None)
                    for key in [k for k in copies[i] if k[0] == t]:
                        del copies[i][key]
            trace.append((s, kind, i))
        for t, v in acc.items():
            step[t], placed[(t, part.op_stage[graph.tensors[t].producer])] = v, v
        for t, vs in pieces.items():
            s = part.op_stage[graph.tensors[t].producer]
            d = batch_dim(self.groups, t)
            step[t] = ops.concat([self._send(v, s, ops) for v in vs], d, s)
        run_steps(self.post)
        return step, trace

    def _run(self, seg: Segment, values: list[Any], ops: _Live) -> list[Any]:
        if not seg.ops:
            return []
        outs = ops.call(seg, self.jitted[id(seg)], values)
        return [self._send(v, seg.stage, ops) for v in outs]

    def _place(self, t: int, value: Any, s: int, ops: _Live) -> Any:
        """An input leaf goes to a stage with its spec; any other value is sent."""
        if t in self.spec:
            return ops.put(value, NamedSharding(self.meshes[s], PartitionSpec(*self.spec[t])))
        return self._send(value, s, ops)

    def _send(self, value: Any, s: int, ops: _Live) -> Any:
        """`value` on stage s's mesh: as it is when already there, else copied there with
        the sender's layout (replicated when the receiver's mesh cannot hold it)."""
        mesh = self.meshes[s]
        sharding = getattr(value, "sharding", None)
        if sharding is not None and sharding.device_set == set(mesh.devices.flat):
            return value
        spec = PartitionSpec()
        if isinstance(sharding, NamedSharding) and _fits(sharding.spec, value.shape, mesh):
            spec = sharding.spec
        return ops.put(value, NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentProgram:
    """One XLA program of a pipeline step, as `run.compile` found it."""

    stage: int
    kind: str  # "pre", "F", "B", "post"; "add"/"concat": the runtime combining microbatches
    runs: int  # times one step runs it (m for F and B, 1 for pre and post)
    # The stage mesh it is compiled on: its device ids are this mesh's devices in
    # row-major order, which is how `_hlo.axis_of` reads replica groups.
    mesh: dict[str, int]
    compiled: Any  # jax.stages.Compiled: `.as_text()` is the partitioned HLO


class _Live:
    """What a step does with its values: run, move and combine real arrays."""

    def call(self, seg: Segment, jitted: Callable, values: list[Any]) -> list[Any]:
        return list(jitted(*values))

    def put(self, value: Any, sharding: NamedSharding) -> Any:
        return jax.device_put(value, sharding)

    def slice(self, x: Any, dim: int, i: int, m: int) -> Any:
        return _slice(x, dim, i, m)

    def add(self, a: Any, b: Any, stage: int) -> Any:
        return a + b

    def concat(self, xs: list[Any], dim: int, stage: int) -> Any:
        return jnp.concatenate(xs, axis=dim)


_LIVE = _Live()


class _Dry(_Live):
    """The same moves on ShapeDtypeStructs carrying shardings: each program is compiled
    for the shardings the live step would give its inputs (a jitted segment is compiled
    once per input signature, as jit's cache does), counted per run, and not run."""

    def __init__(self, meshes: list[Mesh]) -> None:
        self._meshes = meshes
        self._found: dict[Any, tuple[int, str, Any]] = {}
        self._runs: dict[Any, int] = {}

    @property
    def programs(self) -> dict[Any, SegmentProgram]:
        return {
            key: SegmentProgram(
                stage, kind, self._runs[key], dict(self._meshes[stage].shape), compiled
            )
            for key, (stage, kind, compiled) in self._found.items()
        }

    def _compile(self, key: Any, stage: int, kind: str, jitted: Callable, values) -> list[Any]:
        key = (key, tuple((v.shape, v.dtype, v.sharding) for v in values))
        if key not in self._found:
            self._found[key] = (stage, kind, jitted.lower(*values).compile())
        self._runs[key] = self._runs.get(key, 0) + 1
        outs = self._found[key][2].out_info
        return [jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding) for o in outs]

    def call(self, seg: Segment, jitted: Callable, values: list[Any]) -> list[Any]:
        return self._compile(id(seg), seg.stage, seg.kind, jitted, values)

    def put(self, value: Any, sharding: NamedSharding) -> Any:
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    def slice(self, x: Any, dim: int, i: int, m: int) -> Any:
        shape = list(x.shape)
        shape[dim] //= m
        if getattr(x, "sharding", None) is None:  # the caller's leaf: placed right after
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
        # A per-step value made on a stage: the slice's layout is XLA's choice. (Batched
        # values are made per microbatch, so no step reaches this today.)
        compiled = jax.jit(_slice, static_argnums=(1, 2, 3)).lower(x, dim, i, m).compile()
        out = compiled.out_info
        return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=out.sharding)

    def add(self, a: Any, b: Any, stage: int) -> Any:
        if a.sharding == b.sharding:
            return a  # elementwise on one layout: no program that moves anything
        return self._compile("add", stage, "add", jax.jit(jnp.add), [a, b])[0]

    def concat(self, xs: list[Any], dim: int, stage: int) -> Any:
        join = jax.jit(lambda *xs: jnp.concatenate(xs, axis=dim))
        return self._compile(("concat", dim), stage, "concat", join, xs)[0]


def _fits(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> bool:
    for size, entry in zip(shape, spec, strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if any(a not in mesh.shape for a in axes):
            return False
        if size % math.prod(mesh.shape[a] for a in axes):
            return False
    return True


def _slice(x: Any, dim: int, i: int, m: int) -> Any:
    """Microbatch i of m: a contiguous block of the batch dimension."""
    n = x.shape[dim] // m
    index = [slice(None)] * len(x.shape)
    index[dim] = slice(i * n, (i + 1) * n)
    return x[tuple(index)]


def _micro_divisible(what: str, shape, spec, mesh) -> None:
    try:
        check_divisible(what, tuple(shape), spec, mesh)
    except ApplyError as e:
        raise ApplyError(
            f"{e} (On a pipeline stage a per-microbatch tensor has the microbatch's batch "
            "size: fewer microbatches or a smaller data axis may fit.)"
        ) from None
