"""Run a pipeline plan: per-stage jitted programs on sub-meshes, fed microbatch by microbatch.

One controller (this process) dispatches the work in the plan's schedule's `global_order`
(`_pipeline.pipeline_schedule`): the pre segments, then every (stage, phase, microbatch)
unit, then the post segments. JAX dispatch is asynchronous, so units on different stages'
devices overlap as the schedule intends; a value crossing stages is a `jax.device_put`
onto the receiving stage's mesh (the point-to-point send), keeping the sender's layout
when the receiver's mesh has it.
Under `jax.distributed` every process runs this same order over global arrays (`_Hosts`):
a stage's programs run on the processes that hold its devices, the batch shares are
gathered first, and a value crossing processes is sent by `_distributed.send`, one
collective-permute from each sending device to its partner (`device_put` cannot cross
processes off TPU).

Where the work goes, for the cost model:
- Inside a stage, each segment is an SPMD program over that stage's mesh. Its collectives
  are those XLA inserts for the plan's specs, per microbatch, with one exception: the
  data-parallel reduction of an accumulated tensor (a weight's gradient, the loss sum).
  With more than one microbatch, the op that sums such a tensor over the batch (a
  contraction or reduce_sum over it) runs under `jax.shard_map` with the batch's mesh
  axes manual (the others stay XLA's), so the segment returns each device's partial sum
  on a leading axis split over those axes: [d, *shape], no collective.
- Accumulated tensors are added up on their stage in the schedule's order (GPipe adds the
  last microbatch first), in place: the first "B" (or "F") unit makes the running sums,
  every later one takes them as donated inputs and returns them with its own added, so
  XLA writes into the same buffers (Megatron-LM's main_grad). One buffer per tensor (per
  device: its own partial sum, the size of the reduced tensor), never a second copy.
  After the stage's last unit, one "reduce" program per stage sums the leading axis: one
  all-reduce over the data axes per step (XLA combines the stage's tensors), as
  Megatron-LM reduces gradients once per step, not once per microbatch. With ZeRO the
  plan pins the gradients to the ZeRO layout: the sums stay whole per device in F and
  B, and the reduce program reduce-scatters them into that layout (DeepSpeed's ZeRO).
- A step output the plan pins inside the step to another layout (ZeRO's new parameters,
  updated on shards) leaves the program that makes it in its output spec: ZeRO-1/2's
  one all-gather of the parameters per step, after the update.
- Per-step work (pre: weight casts; post: the loss division, the optimizer update) runs
  once on the full batch's shapes, on the stage the partition gives it.
- A microbatch's residuals (forward values its backward reads) are dropped on each stage
  after that stage's last segment that reads them, so a stage holds those of the
  microbatches in flight, and a stage's output dies on it once the next stage has it.

`run.compile(*args)` walks the same step on abstract values instead (`_Dry`): every
segment is compiled for the shardings the live step would hand it, nothing runs. That is
what `am.verify` reads the collectives of.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._axes import DATA
from .._capture import capture
from .._errors import ApplyError, PlanError
from .._graph import TensorKind
from .._groups import build_groups, lookups, unzero_spec, zero_mismatch
from .._pipeline import (
    SUMS,
    Phase,
    Unit,
    partition,
    pipeline_schedule,
    recompute_plan,
)
from .._plan import Plan
from ._distributed import Feed, check_stages, gather, move
from ._interpret import eval_ops
from ._recompute import eval_recomputing
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
from ._shared import (
    check_divisible,
    check_paths,
    leaf_dtype,
    leaf_shape,
    other_program,
    per_structure,
    validate_plan,
)


def apply_pipeline(fn: Callable, plan: Plan, devices: Sequence[Any] | None = None) -> Callable:
    """A callable running `fn` under the pipeline plan `plan`; same convention as `apply`.

    The result's `trace` attribute is the (stage, phase, microbatch) sequence the last
    call executed: the plan's schedule's `global_order(stages, microbatches)`.
    """
    validate_plan(plan)
    meshes = stage_meshes(plan, devices)
    prepare = per_structure(lambda args: _Pipeline(fn, plan, meshes, args))

    def run(*args: Any) -> Any:
        pipe = prepare(*args)
        out = pipe(args)
        run.trace = tuple(pipe.trace)  # type: ignore[attr-defined]
        return out

    run.meshes = meshes  # type: ignore[attr-defined]
    # Under jax.distributed an output lies on its stage's devices only: this brings
    # outputs whole to every process (every process calls it).
    run.gather = lambda tree: gather(tree, meshes)  # type: ignore[attr-defined]
    run.prepare = prepare  # type: ignore[attr-defined]
    run.compile = lambda *args: prepare(*args).compile(args)  # type: ignore[attr-defined]
    run.memory = lambda *args: prepare(*args).memory(args)  # type: ignore[attr-defined]
    run.trace = ()  # type: ignore[attr-defined]
    return run


def stage_meshes(plan: Plan, devices: Sequence[Any] | None = None) -> list[Mesh]:
    """Each stage's sub-mesh over its devices, row-major like `_apply.make_mesh`."""
    devices = list(jax.devices() if devices is None else devices)
    pipeline_schedule(plan.schedule)  # a registered name, or one line listing them
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

        self.plan, self.meshes, m = plan, meshes, plan.microbatches
        self.feed, self.ops = None, _LIVE
        if jax.process_count() > 1:  # each process feeds its share of the batch
            check_stages(meshes)
            self.feed, self.ops = Feed(fn, meshes, args), _Hosts(meshes)
            args = self.feed.global_args  # the segments run at the global batch's shapes
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(leaf_shape(x), leaf_dtype(x)), args
        )
        full = capture(fn, *abstract)
        check_paths(plan, [leaf.path for leaf in full.inputs])
        if plan.provenance.fingerprint and plan.provenance.fingerprint != full.fingerprint:
            raise PlanError(other_program(plan, full))
        groups = build_groups(full)
        why = zero_mismatch(full, groups, plan)
        if why:
            raise PlanError(why)
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
        self.read_on: dict[int, list[int]] = {}  # tensor -> stages whose segments read it
        for t, s in self.readers:
            self.read_on.setdefault(t, []).append(s)
        self.input_stages: dict[int, list[int]] = {}
        for seg in (*self.pre, *self.micro, *self.post):
            for t in seg.inputs:
                if full.tensors[t].kind is TensorKind.INPUT:
                    stages = self.input_stages.setdefault(t, [])
                    if seg.stage not in stages:
                        stages.append(seg.stage)
        self.per_mb = {
            t
            for seg in self.micro
            for i in seg.ops
            for t in full.ops[i].outputs
            if part.op_phase[i].per_microbatch
        }
        self.spec = {leaf.tensor: plan.specs[leaf.path] for leaf in full.inputs}
        # Per-step outputs and the layout they leave in (the plan's output specs).
        self.out_spec = {
            leaf.tensor: tuple(plan.out_specs[leaf.path])
            for leaf in full.outputs
            if leaf.path in plan.out_specs and leaf.tensor not in part.batched
        }
        self._check_inputs(micro)
        self.partial = self._partial_ops() if m > 1 else {}
        self.deferred = {t: i for i in self.partial for t in full.ops[i].outputs}
        consts = micro_consts(full, micro)
        bodies = {
            id(seg): self._compile(seg, micro if seg.kind.per_microbatch else full, consts)
            for seg in (*self.pre, *self.micro, *self.post)
            if seg.ops
        }
        self.donate = self._post_donations()
        self.jitted = {
            k: jax.jit(body, donate_argnums=self.donate.get(k, ())) for k, body in bodies.items()
        }
        # A segment that makes accumulated tensors runs every microbatch after the first
        # as `adding`: it takes the running sums, donated, and returns them with its own
        # added, so a stage holds one copy of its gradients (Megatron's main_grad).
        self.sums = {
            id(seg): ts
            for seg in self.micro
            if seg.ops and m > 1 and (ts := tuple(t for t in seg.outputs if t in part.accumulated))
        }
        self.adding = {
            id(seg): jax.jit(
                _adding(bodies[id(seg)], seg.outputs, self.sums[id(seg)]),
                donate_argnums=tuple(range(len(seg.inputs), len(seg.inputs) + len(ts))),
            )
            for seg in self.micro
            if (ts := self.sums.get(id(seg)))
        }
        self.reducers = {
            s: (ts, self._reducer(ts, s))
            for s in range(len(meshes))
            if (ts := tuple(t for t in sorted(self.deferred) if self._stage_of(t) == s))
        }
        self.trace: list[tuple[int, str, int]] = []
        self.dry_runs: dict[tuple, _Dry] = {}

    def _post_donations(self) -> dict[int, tuple[int, ...]]:
        """Per post segment, the positions of the inputs it donates: the step inputs the
        step donates (the old parameters and optimizer state, `InputLeaf.donated`), each
        in the last post segment of its stage that reads it. The update then runs in
        place, as `apply` runs a donating step; without donation the old state lives
        beside the new one until the step returns. The cost model prices either
        (`_cost/_outputs.py`)."""
        graph = self.graph
        donated = {leaf.tensor for leaf in graph.inputs if leaf.donated}
        donated -= {leaf.tensor for leaf in graph.outputs}
        out: dict[int, tuple[int, ...]] = {}
        claimed: set[tuple[int, int]] = set()
        for seg in reversed(self.post):
            mine = [(k, t) for k, t in enumerate(seg.inputs) if (t, seg.stage) not in claimed]
            claimed.update((t, seg.stage) for t in seg.inputs)
            if positions := tuple(k for k, t in mine if t in donated):
                out[id(seg)] = positions
        return out

    def _stage_of(self, t: int) -> int:
        return self.part.op_stage[self.graph.tensors[t].producer]

    def _batch_axes(self) -> dict[int, tuple[str, ...]]:
        """The mesh axes each batch group is split on, read from the plan's specs of the
        batched inputs and its constraints on batched tensors."""
        found: dict[int, tuple[str, ...]] = {}
        sources = [(leaf.tensor, self.spec[leaf.tensor]) for leaf in self.graph.inputs]
        sources += list(self.plan.constraints.items())
        for t, spec in sources:
            if t not in self.part.batched or t >= len(self.graph.tensors):
                continue
            d = batch_dim(self.groups, t)
            entry = spec[d] if d is not None and d < len(spec) else None
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if axes:
                found.setdefault(self.groups.tensor_groups[t][d], axes)
        return found

    def _partial_ops(self) -> dict[int, tuple[str, ...]]:
        """Per-microbatch ops that sum an accumulated tensor over a split batch: op index
        -> the mesh axes of that split (what their "reduce" program reduces over). An op
        whose batched inputs are split on different axes, or whose result the plan splits
        on them, is left to XLA."""
        graph, part = self.graph, self.part
        axes_of = self._batch_axes()
        accumulated = set(part.accumulated)
        out: dict[int, tuple[str, ...]] = {}
        for op in graph.ops:
            if part.op_phase[op.index] not in (Phase.FWD, Phase.BWD):
                continue
            if op.primitive not in SUMS or not accumulated.intersection(op.outputs):
                continue
            mesh = self.meshes[part.op_stage[op.index]].shape
            found = {
                axes_of.get(self.groups.tensor_groups[u][batch_dim(self.groups, u)], ())
                for u in op.inputs
                if u in part.batched
            }
            if len(found) != 1 or not (axes := found.pop()) or any(a not in mesh for a in axes):
                continue
            # A result the plan splits over those very axes (ZeRO's gradients) is summed
            # whole per device here and reduce-scattered into that layout by the stage's
            # "reduce" program, once per step.
            out[op.index] = axes
        return out

    def _reducer(self, tensors: tuple[int, ...], s: int) -> Callable:
        """Stage s's once-per-step program: each deferred tensor's partial sums ([d, ...],
        the leading axis split over the batch's axes) summed into the tensor, with the
        layout the plan asks of it where it asks one."""
        mesh = self.meshes[s]
        wanted = self._wanted()
        specs = [self._scattered(t, wanted.get(t), mesh) for t in tensors]
        shardings = [
            None if spec is None else NamedSharding(mesh, PartitionSpec(*spec)) for spec in specs
        ]

        def reduce(*partials: Any) -> tuple[Any, ...]:
            sums = [_total(p) for p in partials]
            return tuple(
                x if sh is None else jax.lax.with_sharding_constraint(x, sh)
                for x, sh in zip(sums, shardings, strict=True)
            )

        return jax.jit(reduce)

    def _scattered(self, t: int, spec: tuple | None, mesh: Mesh) -> tuple | None:
        """The layout a ZeRO plan's reduce program leaves a gradient in. The plan pins the
        float32 gradients to the ZeRO layout but leaves a 16-bit one free (one program
        would sum it after its cast to float32): here it is summed in its own dtype
        anyway (`_total`), so it is reduce-scattered too, with the data axis on its dim
        linked to one the update's ops that read it take it on."""
        data, graph = DATA, self.graph
        if self.plan.zero_stage < 1 or mesh.shape.get(data, 1) == 1 or not graph.tensors[t].ndim:
            return spec
        spec = tuple(spec) if spec is not None else (None,) * graph.tensors[t].ndim
        if any(data in _axes_of(e) for e in spec):
            return spec
        wanted = self._wanted()
        linked = {
            g
            for c in graph.consumers()[t]
            for u in graph.ops[c].outputs
            for e, g in zip(wanted.get(u, ()), self.groups.tensor_groups[u], strict=False)
            if data in _axes_of(e)
        }
        for d, (e, g) in enumerate(zip(spec, self.groups.tensor_groups[t], strict=True)):
            size = mesh.shape[data] * math.prod(mesh.shape[a] for a in _axes_of(e))
            if g in linked and graph.tensors[t].shape[d] % size == 0:
                return (*spec[:d], _entry((*_axes_of(e), data)), *spec[d + 1 :])
        return spec

    def _wanted(self) -> dict[int, tuple]:
        """Specs the plan fixes inside the step: its constraints, and an output spec acts
        as a constraint where the output is made."""
        wanted = dict(self.plan.constraints)
        for leaf in self.graph.outputs:
            if leaf.path in self.plan.out_specs and leaf.tensor not in self.part.batched:
                wanted.setdefault(leaf.tensor, self.plan.out_specs[leaf.path])
        return wanted

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
        wanted = self._wanted()
        shardings = {}
        again = seg.recompute.ops if seg.recompute is not None else ()
        for i in (*seg.ops, *sorted(again)):
            for t in graph.ops[i].outputs:
                if t in wanted:
                    what = f"internal tensor {t} (on pipeline stage {seg.stage})"
                    _micro_divisible(what, graph.tensors[t].shape, wanted[t], stage_mesh)
                    spec = wanted[t]
                    if t in self.deferred:  # its partial sums: a leading per-device axis
                        axes = self.partial[self.deferred[t]]
                        spec = (_entry(axes), *_without(spec, axes))
                    shardings[t] = NamedSharding(mesh, PartitionSpec(*spec))
        use = consts if seg.kind.per_microbatch else None
        bind = (
            {
                **self._lookups(graph, (*seg.ops, *sorted(again)), mesh),
                **{i: self._partial_sum(graph, i, mesh) for i in seg.ops if i in self.partial},
            }
            if seg.kind.per_microbatch
            else None
        )

        def constrain(tid: int, value: Any) -> Any:
            s = shardings.get(tid)
            return value if s is None else jax.lax.with_sharding_constraint(value, s)

        # A step output pinned inside the step to another layout than the plan's output
        # spec (ZeRO's new parameters: updated on shards) leaves in its output spec: the
        # parameters' all-gather after the update, in the program that updates them.
        leave = {
            t: NamedSharding(mesh, PartitionSpec(*self.out_spec[t]))
            for t in seg.outputs
            if t in self.out_spec and self.out_spec[t] != wanted.get(t)
        }

        def body(*values: Any) -> tuple[Any, ...]:
            env = dict(zip(seg.inputs, values, strict=True))
            if seg.recompute is not None:
                rc = seg.recompute
                outs = eval_recomputing(graph, rc, seg.ops, env, seg.outputs, constrain, use, bind)
            else:
                outs = eval_ops(graph, seg.ops, env, seg.outputs, constrain, use, bind)
            return tuple(
                jax.lax.with_sharding_constraint(x, leave[t]) if t in leave else x
                for t, x in zip(seg.outputs, outs, strict=True)
            )

        return body

    def _lookups(self, graph, ops: Sequence[int], mesh: Mesh) -> dict[int, Callable]:
        """ZeRO-3: the lookups among `ops` (gathers indexing a parameter) made to read the
        table gathered over data, as the cost model charges it (`_groups.lookups`: else
        XLA looks up in the shards and all-to-alls the rows)."""
        out: dict[int, Callable] = {}
        for i, t in lookups(graph).items():
            spec = self.spec.get(t)
            whole = None if spec is None else unzero_spec(spec, DATA)
            if self.plan.zero_stage >= 3 and i in ops and whole != spec:
                out[i] = gathered_lookup(graph.eqns[i], NamedSharding(mesh, PartitionSpec(*whole)))
        return out

    def _partial_sum(self, graph, i: int, mesh: Mesh) -> Callable:
        """Op i (a sum over the batch) computed by every device on its own examples: its
        result is [d, *shape], device k's partial sum at index k of the leading axis (split
        over the batch's axes), with no collective over them. The other axes stay XLA's."""
        eqn, op, axes = graph.eqns[i], graph.ops[i], self.partial[i]
        in_specs = []
        for u in op.inputs:
            d = batch_dim(self.groups, u) if u in self.part.batched else None
            spec = [None] * graph.tensors[u].ndim
            if d is not None:
                spec[d] = _entry(axes)
            in_specs.append(PartitionSpec(*spec))
        # A scatter-add adds its updates into its operand, batch-free as its result is (the
        # zeros of an embedding's gradient, in general any value): counted once, not d times.
        into_operand = op.primitive in ("scatter-add", "scatter_add")

        def local(*xs: Any) -> Any:
            if into_operand:
                first = jnp.all(jnp.array([jax.lax.axis_index(a) == 0 for a in axes]))
                xs = (jnp.where(first, xs[0], jnp.zeros_like(xs[0])), *xs[1:])
            return eqn.primitive.bind(*xs, **eqn.params)[None]

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=tuple(in_specs),
            out_specs=PartitionSpec(_entry(axes)),
            axis_names=set(axes),
            check_vma=False,
        )

    # ---- one step ------------------------------------------------------------------------

    def __call__(self, args: tuple) -> Any:
        graph = self.graph
        if self.feed is not None:  # every stage may need any process's rows
            args = tuple(self.feed.whole(jax.tree_util.tree_leaves(args)))
        step, self.trace = self._step(args, self.ops)
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
        return tuple(self._dry(args).programs.values())

    def memory(self, args: tuple) -> tuple[float, ...]:
        """Per stage, the peak bytes per device of one step on `args`: at each program
        the stage runs, XLA's buffer assignment of that program (arguments + outputs +
        temporaries - aliased) plus every other value the runtime holds on the stage's
        devices then (the residuals of microbatches in flight, the gradient sums, the
        parameters and optimizer state the program does not read); the largest."""
        return tuple(self._dry(args).peak)

    def _dry(self, args: tuple) -> _Dry:
        """The step walked on abstract values: once per argument structure (its programs
        and peaks are those of any arguments of these shapes)."""
        leaves = jax.tree.leaves(args) if self.feed is None else self.feed.global_leaves
        abstract = tuple(jax.ShapeDtypeStruct(leaf_shape(x), leaf_dtype(x)) for x in leaves)
        key = tuple((x.shape, x.dtype) for x in abstract)
        if key not in self.dry_runs:
            dry = _Dry(self.meshes)
            self._step(abstract, dry)
            self.dry_runs[key] = dry
        return self.dry_runs[key]

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

        def run_steps(segs: list[Segment], free: bool = False) -> None:
            # `free`: the per-step values no later segment of `segs` reads are dropped as
            # they die (after the microbatches only the post segments read them).
            later = collections.Counter(t for seg in segs for t in seg.inputs) if free else None
            if later is not None:
                drop([t for t in step if not later[t]])
            for seg in segs:
                outs = self._run(seg, [on_stage(t, seg.stage) for t in seg.inputs], ops)
                for k in self.donate.get(id(seg), ()):  # its buffer is the new value's now
                    placed.pop((seg.inputs[k], seg.stage), None)
                for t, v in zip(seg.outputs, outs, strict=True):
                    step[t], placed[(t, seg.stage)] = v, v
                if later is not None:
                    later.subtract(seg.inputs)
                    drop([t for t in seg.inputs if not later[t]])

        kept = {leaf.tensor for leaf in (*graph.inputs, *graph.outputs)}

        def drop(tensors: list[int]) -> None:
            """Forget values the step no longer needs (never its inputs or outputs)."""
            for t in tensors:
                if t not in kept and graph.tensors[t].kind is TensorKind.INTERMEDIATE:
                    step.pop(t, None)
                    for key in [k for k in placed if k[0] == t]:
                        del placed[key]

        made: list[dict[int, Any]] = [{} for _ in range(m)]  # per-microbatch values
        copies: list[dict[tuple[int, int], Any]] = [{} for _ in range(m)]
        left = [dict(self.readers) for _ in range(m)]
        acc: dict[int, Any] = {}
        pieces: dict[int, list[Any]] = {}  # batched step outputs made per microbatch

        def held() -> list[Any]:
            """Every value the step holds now (a value may sit in several places)."""
            return [
                *step.values(),
                *placed.values(),
                *(v for d in (*made, *copies) for v in d.values()),
                *acc.values(),
                *(v for vs in pieces.values() for v in vs if v is not None),
            ]

        ops.watch(held)
        # The step's parameters and optimizer state go to their stages first: in a training
        # loop they are there already (the last step's outputs), all step long.
        for leaf in graph.inputs:
            if leaf.tensor not in part.batched:
                for s in self.input_stages.get(leaf.tensor, ()):
                    on_stage(leaf.tensor, s)
        run_steps(self.pre)
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
        order = pipeline_schedule(self.plan.schedule).global_order(len(self.meshes), m)
        last = {u.stage: k for k, u in enumerate(order)}  # each stage's last unit
        for k, (s, kind, i) in enumerate(order):
            seg = by_unit[(s, kind)]
            values = [mb_value(t, i, s) for t in seg.inputs]
            sums = self.sums.get(id(seg), ())
            if sums and sums[0] in acc:  # the running sums go in, donated, and come back
                outs = self._run(seg, values + [acc.pop(t) for t in sums], ops, adding=True)
            else:
                outs = self._run(seg, values, ops)
            for t, v in zip(seg.outputs, outs, strict=True):
                if t in self.read_on:
                    made[i][t] = v
                    if (t, s) in self.readers:
                        copies[i][(t, s)] = v
                if t in accumulated:
                    acc[t] = v
                elif t in outputs and t in part.batched:
                    pieces.setdefault(t, [None] * m)[i] = v
            for t in seg.inputs:  # drop what no later unit of this stage reads
                left[i][(t, s)] -= 1
                if not left[i][(t, s)]:
                    copies[i].pop((t, s), None)
                # The value as made goes once every stage that reads it has its copy or is
                # done with it: a stage's output dies on it once sent, as Megatron-LM frees
                # a sent activation.
                if all(left[i][(t, q)] == 0 or (t, q) in copies[i] for q in self.read_on[t]):
                    made[i].pop(t, None)
            trace.append(Unit(s, kind, i))
            if last[s] == k and s in self.reducers:  # once per step: partial sums reduced
                tensors, reducer = self.reducers[s]
                sums = ops.reduce(s, reducer, [acc[t] for t in tensors])
                acc.update(zip(tensors, sums, strict=True))
        for t, v in acc.items():
            step[t], placed[(t, part.op_stage[graph.tensors[t].producer])] = v, v
        for t, vs in pieces.items():
            s = part.op_stage[graph.tensors[t].producer]
            d = batch_dim(self.groups, t)
            step[t] = ops.concat([self._send(v, s, ops) for v in vs], d, s)
        run_steps(self.post, free=True)
        return step, trace

    def _run(self, seg: Segment, values: list[Any], ops: _Live, adding: bool = False) -> list[Any]:
        """Run a segment (`adding`: its variant that takes the running sums after `values`)."""
        if not seg.ops:
            return []
        jitted = self.adding[id(seg)] if adding else self.jitted[id(seg)]
        outs = ops.call(seg, jitted, values, adding)
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
    # A segment's phase (PRE, FWD, BWD, POST); REDUCE: a stage's once-per-step reduction
    # of its partial sums; None: the runtime joining microbatches' outputs (a concat)
    kind: Phase | None
    runs: int  # times one step runs it (m for F and B, 1 for pre, reduce and post)
    # The stage mesh it is compiled on: its device ids are this mesh's devices in
    # row-major order, which is how `_hlo.axis_of` reads replica groups.
    mesh: dict[str, int]
    compiled: Any  # jax.stages.Compiled: `.as_text()` is the partitioned HLO


class _Live:
    """What a step does with its values: run, move and combine real arrays."""

    def call(
        self, seg: Segment, jitted: Callable, values: list[Any], adding: bool = False
    ) -> list[Any]:
        """Run a segment's program (`adding`: its variant adding into running sums)."""
        return list(jitted(*values))

    def reduce(self, stage: int, jitted: Callable, values: list[Any]) -> list[Any]:
        return list(jitted(*values))

    def watch(self, held: Callable[[], list[Any]]) -> None:
        """`held()` lists the values the step holds at any moment (read by `_Dry`)."""

    def put(self, value: Any, sharding: NamedSharding) -> Any:
        return jax.device_put(value, sharding)

    def slice(self, x: Any, dim: int, i: int, m: int) -> Any:
        return _slice(x, dim, i, m)

    def concat(self, xs: list[Any], dim: int, stage: int) -> Any:
        return jnp.concatenate(xs, axis=dim)


_LIVE = _Live()


class _Hosts(_Live):
    """The live step under jax.distributed: every process makes the same moves, on global
    arrays, each doing the part its devices hold (`_distributed.move`)."""

    def __init__(self, meshes: list[Mesh]) -> None:
        self._meshes = meshes

    def put(self, value: Any, sharding: NamedSharding) -> Any:
        return move(value, sharding, self._meshes)


class _Dry(_Live):
    """The same moves on ShapeDtypeStructs carrying shardings: each program is compiled
    for the shardings the live step would give its inputs (a jitted segment is compiled
    once per input signature, as jit's cache does), counted per run, and not run."""

    def __init__(self, meshes: list[Mesh]) -> None:
        self._meshes = meshes
        self._found: dict[Any, tuple[int, str, Any]] = {}
        self._runs: dict[Any, int] = {}
        self._held: Callable[[], list[Any]] = list
        self.peak = [0.0] * len(meshes)  # per stage, bytes per device (`memory`)

    def watch(self, held: Callable[[], list[Any]]) -> None:
        self._held = held

    def _note_peak(self, stage: int, compiled: Any, values: list[Any]) -> None:
        """The stage's bytes per device while `compiled` runs on `values`."""
        stats = compiled.memory_analysis()
        if stats is None:
            return
        devices = set(self._meshes[stage].devices.flat)
        args = {id(v) for v in values}
        others = {id(v): v for v in self._held() if id(v) not in args}
        kept = sum(
            _device_bytes(v)
            for v in others.values()
            if getattr(v, "sharding", None) is not None and v.sharding.device_set <= devices
        )
        own = (
            stats.argument_size_in_bytes
            + stats.output_size_in_bytes
            + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes
        )
        self.peak[stage] = max(self.peak[stage], float(kept + own))

    @property
    def programs(self) -> dict[Any, SegmentProgram]:
        return {
            key: SegmentProgram(
                stage, kind, self._runs[key], dict(self._meshes[stage].shape), compiled
            )
            for key, (stage, kind, compiled) in self._found.items()
        }

    def _compile(
        self, key: Any, stage: int, kind: Phase | None, jitted: Callable, values
    ) -> list[Any]:
        key = (key, tuple((v.shape, v.dtype, v.sharding) for v in values))
        if key not in self._found:
            self._found[key] = (stage, kind, jitted.lower(*values).compile())
        self._runs[key] = self._runs.get(key, 0) + 1
        self._note_peak(stage, self._found[key][2], values)
        outs = self._found[key][2].out_info
        return [jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding) for o in outs]

    def call(
        self, seg: Segment, jitted: Callable, values: list[Any], adding: bool = False
    ) -> list[Any]:
        return self._compile((id(seg), adding), seg.stage, seg.kind, jitted, values)

    def reduce(self, stage: int, jitted: Callable, values: list[Any]) -> list[Any]:
        return self._compile(("reduce", stage), stage, Phase.REDUCE, jitted, values)

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

    def concat(self, xs: list[Any], dim: int, stage: int) -> Any:
        join = jax.jit(lambda *xs: jnp.concatenate(xs, axis=dim))
        return self._compile(("concat", dim), stage, None, join, xs)[0]


def _adding(body: Callable, outputs: Sequence[int], sums: Sequence[int]) -> Callable:
    """`body` that also takes the running sums of its outputs `sums` (after its own
    inputs) and returns each with its own result added: XLA writes the sum into the
    donated running buffer."""
    at = [list(outputs).index(t) for t in sums]

    def run(*values: Any) -> tuple[Any, ...]:
        n = len(values) - len(at)
        outs = list(body(*values[:n]))
        for k, running in zip(at, values[n:], strict=True):
            outs[k] = running + outs[k]
        return tuple(outs)

    return run


def _fits(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> bool:
    for size, entry in zip(shape, spec, strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if any(a not in mesh.shape for a in axes):
            return False
        if size % math.prod(mesh.shape[a] for a in axes):
            return False
    return True


def gathered_lookup(eqn: Any, whole: NamedSharding) -> Callable:
    """A lookup (a gather's eqn) that reads its table in the layout `whole`: ZeRO-3's
    gather of an embedding table, where the lookup reads it."""

    def lookup(table: Any, *rest: Any) -> Any:
        return eqn.primitive.bind(
            jax.lax.with_sharding_constraint(table, whole), *rest, **eqn.params
        )

    return lookup


def _axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _device_bytes(value: Any) -> int:
    """Bytes of one device's shard of a value with a sharding."""
    shape = value.sharding.shard_shape(value.shape)
    return math.prod(shape) * value.dtype.itemsize  # a typed PRNG key has no np.dtype


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """A PartitionSpec entry for a dimension split over `axes`."""
    return axes[0] if len(axes) == 1 else axes


def _without(spec: tuple, axes: tuple[str, ...]) -> tuple:
    """`spec` with `axes` taken off every dimension (they split the partial sums' leading
    axis instead: a ZeRO gradient is whole per device until its reduce-scatter)."""
    out = []
    for e in spec:
        kept = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(out)


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


def _total(partials: Any) -> Any:
    """Partial sums ([d, ...]) summed over their leading axis in their own dtype, as
    Megatron-LM's runs reduce 16-bit gradients in 16 bits (and DeepSpeed by default):
    `jnp.sum` would sum a 16-bit float in float32, twice the bytes over the data axis,
    which `_cost/_pipelined.py` does not price."""
    return jax.lax.reduce(partials, jnp.zeros((), partials.dtype), jax.lax.add, (0,))
