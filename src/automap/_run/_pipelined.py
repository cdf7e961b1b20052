"""Run a pipeline plan: per-stage jitted programs on sub-meshes, fed microbatch by microbatch.

One controller (this process) dispatches the work in the plan's schedule's `global_order`
(`_pipeline.plan_schedule`): the pre segments, then every (stage, phase, microbatch)
unit, then the post segments. With interleaved 1F1B a plan's stages are virtual stages,
several on one device group (`Plan.virtual_stages`): each runs its own programs on the
same sub-mesh, and a value crossing to a stage on the same devices stays where it is. JAX dispatch is asynchronous, so units on different stages'
devices overlap as the schedule intends; a value crossing stages is a `jax.device_put`
onto the receiving stage's mesh (the point-to-point send), keeping the sender's layout
when the receiver's mesh has it.
Under `jax.distributed` every process runs this same order over global arrays (`Hosts`,
`_executors.py`): a stage's programs run on the processes that hold its devices, the batch
shares are gathered first, and a value crossing processes is sent by `_distributed.send`,
one collective-permute from each sending device to its partner (`device_put` cannot cross
processes off TPU).

Where the work goes, for the cost model:
- Inside a stage, each segment is an SPMD program over that stage's mesh. Its collectives
  are those XLA inserts for the plan's specs, per microbatch, with one exception: the
  data-parallel reduction of an accumulated tensor (a weight's gradient, the loss sum),
  summed in place microbatch by microbatch and reduced once per step per stage
  (`_accumulate.py`).
- A step output the plan pins inside the step to another layout (ZeRO's new parameters,
  updated on shards) leaves the program that makes it in its output spec: ZeRO-1/2's
  one all-gather of the parameters per step, after the update.
- Per-step work (pre: weight casts; post: the loss division, the optimizer update) runs
  once on the full batch's shapes, on the stage the partition gives it.
- A microbatch's residuals (forward values its backward reads) are dropped on each stage
  after that stage's last segment that reads them, so a stage holds those of the
  microbatches in flight, and a stage's output dies on it once the next stage has it.

`run.compile(*args)` walks the same step on abstract values instead (`Dry`,
`_executors.py`): every segment is compiled for the shardings the live step would hand it,
nothing runs. That is what `am.verify` reads the collectives of.
"""

from __future__ import annotations

import collections
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
from .._groups import (
    build_groups,
    lookups,
    sequence_as_recorded,
    unzero_spec,
    zero_mismatch,
)
from .._pipeline import Phase, Unit, partition, plan_schedule, split_backward
from .._plan import Plan
from .._remat import plan_recompute
from ._accumulate import Accumulation, axes_entry, without_axes
from ._distributed import Feed, check_stages, gather
from ._executors import LIVE, Dry, Hosts, Live, SegmentProgram
from ._fsdp import Layerwise, eval_layerwise, plan_layerwise, within
from ._handed import handed_shardings
from ._interpret import eval_ops
from ._recompute import eval_recomputing, plan_layout
from ._segments import (
    Segment,
    batch_dim,
    check_same_program,
    generate_in_readers,
    micro_args,
    micro_consts,
    readers,
    recompute_segments,
    remake_segments,
    segments,
)
from ._shared import (
    check_device_count,
    check_divisible,
    check_micro_divisible,
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
    call executed: the plan's schedule's `global_order(groups, microbatches)`, its stages
    the plan's (virtual stages, with interleaved chunks).
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
    # `hbm`: each TPU program compiled within that HBM a chip (`Dry`), as if it filled it
    run.compile = lambda *args, hbm=None: prepare(*args).compile(args, hbm)  # type: ignore[attr-defined]
    run.memory = lambda *args, live=False, hbm=None: prepare(*args).memory(args, live, hbm)  # type: ignore[attr-defined]
    run.trace = ()  # type: ignore[attr-defined]
    return run


def stage_meshes(plan: Plan, devices: Sequence[Any] | None = None) -> list[Mesh]:
    """Each stage's sub-mesh over its devices, row-major like `_apply.make_mesh`."""
    devices = list(jax.devices() if devices is None else devices)
    plan_schedule(plan)  # a registered name able to run the plan's chunks, or one line
    if plan.microbatches < 1:
        raise PlanError(f"a plan needs at least one microbatch, not {plan.microbatches}.")
    check_device_count(plan, len(devices))
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


class _Pipeline(Accumulation):
    """The segments of one argument structure, jitted once, and how to run a step."""

    def __init__(self, fn: Callable, plan: Plan, meshes: list[Mesh], args: tuple) -> None:

        self.plan, self.meshes, m = plan, meshes, plan.microbatches
        self.feed, self.ops = None, LIVE
        if jax.process_count() > 1:  # each process feeds its share of the batch
            check_stages(meshes)
            self.feed, self.ops = Feed(fn, meshes, args), Hosts(meshes)
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
        self.plan = plan = sequence_as_recorded(full, groups, plan)
        bounds = [(s.op_start, s.op_stop) for s in plan.stages]
        part = partition(full, groups, bounds, m)
        if plan_schedule(plan).splits_backward:  # ZB-H1: each backward as B and W programs
            part = split_backward(full, part)
        micro = full if m == 1 else capture(fn, *micro_args(full, groups, part, abstract, m))
        if micro is not full:
            check_same_program(full, micro, groups, m)
        self.graph, self.part, self.groups = full, part, groups
        self.layout = plan_layout(full, groups, plan)  # what each recompute is tied to
        self.pre, self.micro, self.post = segments(full, part)
        if plan.remat:  # each B segment recomputes its stage's layers from their inputs
            self.micro = recompute_segments(full, self.micro, plan_recompute(full, groups, plan))
        # Each B makes the cheap residuals again from those its F keeps (`_remat/_remake.py`);
        # not where W programs read F's residuals too (a split backward).
        if not plan_schedule(plan).splits_backward:
            self.micro = remake_segments(full, part, self.micro)
        self.pre, self.micro = generate_in_readers(full, part, self.pre, self.micro, self.post)
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
        self.partial = self.partial_ops() if m > 1 else {}
        self.deferred = {t: i for i in self.partial for t in full.ops[i].outputs}
        consts = micro_consts(full, micro)
        self.layerwise: dict[Mesh, Layerwise] = {}
        bodies = {
            id(seg): self._compile(seg, micro if seg.kind.per_microbatch else full, consts)
            for seg in (*self.pre, *self.micro, *self.post)
            if seg.ops
        }
        self.donate = self._post_donations()
        stage_of = {id(seg): seg.stage for seg in (*self.pre, *self.micro, *self.post)}
        self.jitted = {
            k: self.jit(body, stage_of[k], self.donate.get(k, ())) for k, body in bodies.items()
        }
        self.sums, self.adding, self.reducers = self.running_sums(bodies)
        self.trace: list[tuple[int, str, int]] = []
        self.dry_runs: dict[tuple, Dry] = {}

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
                    check_micro_divisible(
                        f"input {leaf.path}",
                        micro.tensors[leaf.tensor].shape,
                        self.spec[leaf.tensor],
                        mesh,
                    )

    def _compile(self, seg: Segment, graph, consts) -> Callable:
        mesh, stage_mesh = self.meshes[seg.stage], dict(self.plan.stages[seg.stage].mesh)
        wanted = self.wanted()
        shardings = {}
        again = seg.recompute.ops if seg.recompute is not None else ()
        for i in (*seg.ops, *sorted(again)):
            for t in graph.ops[i].outputs:
                if t in wanted:
                    what = f"internal tensor {t} (on pipeline stage {seg.stage})"
                    check_micro_divisible(what, graph.tensors[t].shape, wanted[t], stage_mesh)
                    spec = wanted[t]
                    if t in self.deferred:  # its partial sums: a leading per-device axis
                        axes = self.partial[self.deferred[t]]
                        spec = (axes_entry(axes), *without_axes(spec, axes))
                    shardings[t] = NamedSharding(mesh, PartitionSpec(*spec))
        use = consts if seg.kind.per_microbatch else None
        bind = (
            {
                **self._lookups(graph, (*seg.ops, *sorted(again)), mesh),
                **{i: self.partial_sum(graph, i, mesh) for i in seg.ops if i in self.partial},
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
        if seg.kind is Phase.FWD:  # a mask another program reads leaves in the plan's layout
            pinned = {*shardings, *leave, *self.part.accumulated, *self.deferred}
            leave |= handed_shardings(graph, seg.outputs, self.layout, mesh, stage_mesh, pinned)

        # ZeRO-3: F and B gather each layer's parameters as it runs, as one program does.
        lw = self._layerwise(seg, mesh)

        def body(*values: Any) -> tuple[Any, ...]:
            env = dict(zip(seg.inputs, values, strict=True))
            if seg.recompute is not None:
                rc, out = seg.recompute, seg.outputs
                outs = eval_recomputing(
                    graph, rc, seg.ops, env, out, constrain, use, bind, lw, self.layout
                )
            elif lw is not None:
                outs = eval_layerwise(
                    graph, lw, env, seg.outputs, constrain, bind, seg.ops, use
                )  # fmt: skip
            else:
                outs = eval_ops(graph, seg.ops, env, seg.outputs, constrain, use, bind)
            return tuple(
                jax.lax.with_sharding_constraint(x, leave[t]) if t in leave else x
                for t, x in zip(seg.outputs, outs, strict=True)
            )

        return body

    def _layerwise(self, seg: Segment, mesh: Mesh) -> Layerwise | None:
        """ZeRO-3 over a data axis of 2 or more: F's and B's (and W's) gathers layer by
        layer (`_fsdp.py`), restricted to the segment's ops; None otherwise. The gradients
        stay as they are: summed whole over the microbatches, reduced once per step."""
        if self.plan.zero_stage < 3 or mesh.shape.get(DATA, 1) < 2:
            return None
        if not seg.kind.per_microbatch:
            return None
        if mesh not in self.layerwise:  # one per stage mesh: its layers are the step's
            self.layerwise[mesh] = plan_layerwise(self.graph, self.groups, self.plan, mesh)
        return within(
            self.layerwise[mesh], (*seg.ops, *(seg.recompute.ops if seg.recompute else ()))
        )

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

    def compile(self, args: tuple, hbm: float | None = None) -> tuple[SegmentProgram, ...]:
        """Every program one step on `args` runs, compiled as the step would compile it
        (same jitted segments, same input shardings), without running anything."""
        return tuple(self._dry(args, hbm).programs.values())

    def memory(
        self, args: tuple, live: bool = False, hbm: float | None = None
    ) -> tuple[float, ...]:
        """Per stage, the peak bytes per device of one step on `args`: at each program
        the stage runs, XLA's buffer assignment of that program (arguments + outputs +
        temporaries - aliased; `live`: XLA's TPU live peak of it, `peak_memory_in_bytes`)
        plus every other value the runtime holds on the stage's devices then (the
        residuals of microbatches in flight, the gradient sums, the parameters and
        optimizer state the program does not read); the largest.
        With virtual stages (interleaved), a stage's devices hold every chunk they run: each
        stage gets its devices' peak over the programs of all their chunks."""
        dry = self._dry(args, hbm)
        peak, groups = dry.live if live else dry.peak, len(self.meshes) // self.plan.virtual_stages
        return tuple(max(peak[p % groups :: groups]) for p in range(len(peak)))

    def _dry(self, args: tuple, hbm: float | None = None) -> Dry:
        """The step walked on abstract values: once per argument structure (its programs
        and peaks are those of any arguments of these shapes)."""
        leaves = jax.tree.leaves(args) if self.feed is None else self.feed.global_leaves
        abstract = tuple(jax.ShapeDtypeStruct(leaf_shape(x), leaf_dtype(x)) for x in leaves)
        key = (*((x.shape, x.dtype) for x in abstract), hbm)
        if key not in self.dry_runs:
            dry = Dry(self.meshes, hbm)
            self._step(abstract, dry)
            self.dry_runs[key] = dry
        return self.dry_runs[key]

    def _step(self, args: tuple, ops: Live) -> tuple[dict[int, Any], list]:
        """One step in the schedule's order: (every tensor of the step by id, the trace).
        `ops` moves and combines the values: real arrays (`LIVE`) or abstract (`Dry`)."""
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
        schedule = plan_schedule(self.plan)
        order = schedule.global_order(len(self.meshes) // schedule.chunks, m)
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
        self._finish_microbatches(step, placed, acc, pieces, ops)
        run_steps(self.post, free=True)
        return step, trace

    def _finish_microbatches(
        self, step: dict, placed: dict, acc: dict[int, Any], pieces: dict, ops: Live
    ) -> None:
        """After the last microbatch: the accumulated sums become step values on their
        stage, and each batched output's microbatch pieces are joined on its stage."""
        graph, part = self.graph, self.part
        for t, v in acc.items():
            step[t], placed[(t, part.op_stage[graph.tensors[t].producer])] = v, v
        for t, vs in pieces.items():
            s = part.op_stage[graph.tensors[t].producer]
            d = batch_dim(self.groups, t)
            step[t] = ops.concat([self._send(v, s, ops) for v in vs], d, s)

    def _run(self, seg: Segment, values: list[Any], ops: Live, adding: bool = False) -> list[Any]:
        """Run a segment (`adding`: its variant that takes the running sums after `values`)."""
        if not seg.ops:
            return []
        jitted = self.adding[id(seg)] if adding else self.jitted[id(seg)]
        outs = ops.call(seg, jitted, values, adding)
        return [self._send(v, seg.stage, ops) for v in outs]

    def _place(self, t: int, value: Any, s: int, ops: Live) -> Any:
        """An input leaf goes to a stage with its spec; any other value is sent."""
        if t in self.spec:
            return ops.put(value, NamedSharding(self.meshes[s], PartitionSpec(*self.spec[t])))
        return self._send(value, s, ops)

    def _send(self, value: Any, s: int, ops: Live) -> Any:
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
