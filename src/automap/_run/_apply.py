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

from .._axes import DATA
from .._capture import capture, donated_leaves
from .._errors import PlanError
from .._graph import Role
from .._groups import (
    Groups,
    build_groups,
    cast_shards,
    lookups,
    repeated_casts,
    sequence_as_recorded,
    unzero_spec,
    zero_mismatch,
    zero_region,
)
from .._plan import Plan, Spec
from .._remat import Recompute, plan_recompute
from ._compiler import compiler_options
from ._distributed import Feed
from ._flash import plan_flash
from ._fsdp import Layerwise, eval_layerwise, plan_layerwise
from ._interpret import eval_ops
from ._pipelined import apply_pipeline, gathered_lookup
from ._recompute import eval_recomputing, plan_layout
from ._shared import (
    check_device_count,
    check_divisible,
    check_paths,
    leaf_dtype,
    leaf_shape,
    other_program,
    per_structure,
    placed,
    validate_plan,
)
from ._state_layout import (
    compiled_for,
    extended,
    input_formats,
    laid_jit,
    laid_pairs,
    unstable,
)


def make_mesh(plan: Plan, devices: Sequence[Any] | None = None) -> Mesh:
    """The plan's mesh over the first prod(sizes) devices, row-major (last axis fastest),
    the order `Cluster.axis_links` assumes when it puts an axis inside a node."""
    devices = list(jax.devices() if devices is None else devices)
    check_device_count(plan, len(devices))
    need = plan.devices
    if not plan.mesh:  # no axes: one device, everything replicated
        return Mesh(np.array(devices[:1]), ("_",))
    grid = np.array(devices[:need], dtype=object).reshape(tuple(plan.mesh.values()))
    return Mesh(grid, tuple(plan.mesh))


def _sharding(mesh: Mesh, spec: Spec) -> NamedSharding:
    # Trailing Nones dropped, as JAX writes the shardings of a step's outputs: a loop's
    # fed-back state then compares equal to the plan's and is not placed again (`placed`).
    spec = tuple(spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return NamedSharding(mesh, PartitionSpec(*spec))


class Prepared:
    """The jitted step and its shardings for one argument structure (no data touched).

    `graph`, when the caller already captured `fn` on these arguments, saves a capture."""

    def __init__(
        self, fn: Callable, plan: Plan, mesh: Mesh, args: tuple, graph: Any = None
    ) -> None:
        self.feed = None
        if jax.process_count() > 1:  # each process feeds its share of the batch
            self.feed = Feed(fn, [mesh], args, graph)
            args = self.feed.global_args  # the program is traced at the global shapes
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(args)
        paths = [jax.tree_util.keystr(p) for p, _ in flat]
        check_paths(plan, paths)
        if graph is None and (
            plan.provenance.fingerprint
            or plan.constraints
            or plan.remat
            or plan.sequence_parallel
            or plan.attention == "flash"
            or _regathers(plan)
        ):
            graph = capture(fn, *args)
        # Before the divisibility checks: "another batch size" says more than "6 is not
        # divisible by 8". A graph the caller captured (verify's) is checked the same way.
        fingerprint = plan.provenance.fingerprint
        if graph is not None and fingerprint and fingerprint != graph.fingerprint:
            raise PlanError(other_program(plan, graph))
        checked = graph is not None and plan.assignment is not None
        groups = build_groups(graph) if graph is not None else None
        if checked:
            why = zero_mismatch(graph, groups, plan)
            if why:
                raise PlanError(why)
            plan = sequence_as_recorded(graph, groups, plan)
        # Remat recomputes inside the program; ZeRO-3 gathers again inside it.
        reinterpret = (
            plan.constraints or plan.remat or _regathers(plan) or plan.attention == "flash"
        )
        for path, (_, leaf) in zip(paths, flat, strict=True):
            check_divisible(f"input {path}", leaf_shape(leaf), plan.specs[path], plan.mesh)
        self.in_shardings = [_sharding(mesh, plan.specs[p]) for p in paths]
        body = fn if not reinterpret else _constrained(graph, groups, plan, mesh)
        shapes = jax.eval_shape(fn, *args)
        out_shardings = _out_shardings(plan, mesh, shapes)

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

        donated = donated_leaves(fn, args, len(paths))
        self._jit(step, args, donated, plan, mesh, shapes)

    def _jit(
        self,
        step: Callable,
        args: tuple,
        donated: tuple[int, ...],
        plan: Plan,
        mesh: Mesh,
        shapes: Any,
    ) -> None:
        """`self.jitted`: `step` jitted with the plan's shardings and the user's donation.
        Without ZeRO the donated state is laid out as XLA chooses (`_state_layout.py`), so
        the step runs compiled for abstract arguments (`jax.jit` takes no concrete array
        where a layout is AUTO). Under ZeRO the layout XLA chooses for a gradient decides
        which gradients it reduce-scatters and which it all-reduces whole, and the cost
        model reads that choice for row-major state (`_cost/_scatter.py`): it stays so."""
        leaves = jax.tree_util.tree_leaves(args)
        self.laid_by_xla = tuple(
            i for i in donated if plan.zero_stage == 0 and not extended(leaf_dtype(leaves[i]))
        )
        self.step = step
        self.jit_options = {"donate_argnums": donated, "compiler_options": compiler_options(mesh)}
        outs, self.out_tree = jax.tree_util.tree_flatten(shapes)
        ins = self.abstract_args(args)
        self.pairs = laid_pairs(ins, outs, donated, self.laid_by_xla)
        if self.laid_by_xla:
            self.jitted = laid_jit(step, self.jit_options, ins, self.out_tree, self.pairs)
        else:
            self.jitted = jax.jit(step, in_shardings=tuple(self.in_shardings), **self.jit_options)
        self.executable: Any = None  # compiled on the first call where XLA lays the state

    def abstract_args(self, args: tuple) -> list[jax.ShapeDtypeStruct]:
        """Flat abstract arguments carrying the plan's shardings (for lower/compile); a
        Python scalar stays weakly typed, as `jax.jit` traces it when called."""
        leaves = jax.tree_util.tree_leaves(args)
        if self.feed is not None:  # the process-local batch shares stand for global arrays
            leaves = self.feed.global_leaves
        return [
            jax.ShapeDtypeStruct(leaf_shape(x), leaf_dtype(x), sharding=s, weak_type=_weak(x))
            for x, s in zip(leaves, self.in_shardings, strict=True)
        ]

    def compile(self, args: tuple, options: dict[str, Any] | None = None) -> Any:
        """The step compiled for `args` (arrays or ShapeDtypeStructs) as it runs; `options`:
        XLA's debug options for this compile."""
        abstract = self.abstract_args(args)
        compiled = compiled_for(self.jitted, abstract, options)
        pinned = unstable(compiled, self.pairs) if self.laid_by_xla else {}
        if not pinned:
            return compiled
        # XLA gave some donated leaf back laid otherwise than it took it: a loop would
        # lay it out anew each step. Compiled again with each pair pinned as it comes back.
        jitted = laid_jit(self.step, self.jit_options, abstract, self.out_tree, self.pairs, pinned)
        return compiled_for(jitted, abstract, options)

    def __call__(self, args: tuple) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        if self.feed is not None:
            leaves = self.feed.place(leaves, self.in_shardings)
        if not self.laid_by_xla:
            return self.jitted(*placed(leaves, self.in_shardings))
        if self.executable is None:
            self.executable = self.compile(args)
        # The state a loop feeds back is laid out as compiled; the first call's moves once.
        laid = placed(leaves, input_formats(self.executable), self.laid_by_xla)
        return self.executable(*laid)


def _out_shardings(plan: Plan, mesh: Mesh, shapes: Any) -> dict[str, NamedSharding]:
    """The plan's output specs as shardings, each checked against the step's outputs."""
    out_flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    out_paths = {jax.tree_util.keystr(p): leaf for p, leaf in out_flat}
    strange = sorted(set(plan.out_specs) - set(out_paths))
    if strange:
        raise PlanError(
            f"the plan has output specs for {strange}, which the step does not return "
            f"(its outputs: {sorted(out_paths)}); the plan was made for another program."
        )
    for path, spec in plan.out_specs.items():
        check_divisible(f"output {path}", out_paths[path].shape, spec, plan.mesh)
    return {p: _sharding(mesh, s) for p, s in plan.out_specs.items()}


def _weak(x: Any) -> bool:
    # A Python number traces weakly typed; numpy's scalars and bools do not.
    return bool(getattr(x, "weak_type", type(x) in (int, float, complex)))


def _constrained(graph: Any, groups: Groups, plan: Plan, mesh: Mesh) -> Callable:
    """The captured program re-run op by op, fixing the plan's internal tensors."""

    for tid, spec in plan.constraints.items():
        if not 0 <= tid < len(graph.tensors):
            raise PlanError(
                f"the plan constrains tensor {tid}, but the program has only "
                f"{len(graph.tensors)} tensors: the plan was made for another program."
            )
        check_divisible(f"internal tensor {tid}", graph.tensors[tid].shape, spec, plan.mesh)
    shardings = {tid: _sharding(mesh, spec) for tid, spec in plan.constraints.items()}
    # ZeRO-1/2 gathering compute-dtype copies (`_groups.cast_shards`): each cast made on
    # the master's shard, then gathered; pinned whole alone, XLA's GPU compiler gathers
    # the float32 weight a matmul reads and casts it after (twice the bytes).
    update = zero_region(graph, groups)[1]
    shards = {t: _sharding(mesh, spec) for t, spec in cast_shards(graph, plan, update).items()}
    # A later cast to the same dtype (a tied table's head) reads the first's gathered copy:
    # XLA merges the two casts but gathers each (`_groups.repeated_casts`). `made` holds
    # the copies of one call of the step (one trace), cleared as each call starts.
    reuse = {t: c for t, c in repeated_casts(graph, update).items() if c in shards}
    made: dict[int, Any] = {}

    def constrain(tid: int, value: Any) -> Any:
        if tid in reuse:
            value = made[reuse[tid]]
        elif tid in shards:
            value = jax.lax.with_sharding_constraint(value, shards[tid])
        s = shardings.get(tid)
        value = value if s is None else jax.lax.with_sharding_constraint(value, s)
        if tid in shards:
            made.setdefault(tid, value)
        return value

    # Flash attention: each attention core (forward and backward) bound to the kernel.
    flash = plan_flash(graph, groups, plan, mesh) if plan.attention == "flash" else {}

    def run(*args: Any) -> Any:
        flat = jax.tree_util.tree_leaves(args)
        env = {leaf.tensor: x for leaf, x in zip(graph.inputs, flat, strict=True)}
        wanted = [leaf.tensor for leaf in graph.outputs]
        outs = eval_ops(graph, range(len(graph.ops)), env, wanted, constrain, bind=flash)
        return jax.tree_util.tree_unflatten(graph.out_tree, list(outs))

    layerwise = plan_layerwise(graph, groups, plan, mesh) if _regathers(plan) else None
    if plan.remat:
        rc = plan_recompute(graph, groups, plan)
        lookups, layout = _lookups(graph, plan, mesh), plan_layout(graph, groups, plan)
        step = _recomputing(graph, rc, constrain, {**lookups, **flash}, layerwise, layout)
    elif layerwise is not None:
        bind = {**_lookups(graph, plan, mesh), **flash}
        step = _regathering(graph, layerwise, constrain, bind)
    else:
        step = run
    if not reuse:
        return step

    def fresh(*args: Any) -> Any:
        made.clear()
        try:
            return step(*args)
        finally:
            made.clear()  # no tracer outlives its trace

    return fresh


def _lookups(graph: Any, plan: Plan, mesh: Mesh) -> dict[int, Callable]:
    """ZeRO-3: the lookups (gathers indexing a parameter) made to read the table gathered
    over data, as the cost model charges it (`_groups.lookups`: else XLA looks up in the
    shards and all-to-alls the rows)."""
    if plan.zero_stage < 3:
        return {}
    spec_of = {leaf.tensor: plan.specs[leaf.path] for leaf in graph.leaves(Role.PARAM)}
    out: dict[int, Callable] = {}
    for i, t in lookups(graph).items():
        whole = unzero_spec(spec_of[t], DATA)
        if whole != spec_of[t]:
            out[i] = gathered_lookup(graph.eqns[i], _sharding(mesh, whole))
    return out


def _regathers(plan: Plan) -> bool:
    """Whether the plan gathers its parameters layer by layer (ZeRO-3 as FSDP runs it)."""
    return plan.zero_stage >= 3 and plan.mesh.get(DATA, 1) > 1


def _regathering(graph: Any, layerwise: Layerwise, constrain: Callable, bind: dict) -> Callable:
    """The captured program re-run with ZeRO-3's gathers layer by layer (FSDP): each layer
    reads its own gathered copies, the backward gathers them again (`_fsdp.py`)."""
    wanted = [leaf.tensor for leaf in graph.outputs]

    def run(*args: Any) -> Any:
        env = {
            leaf.tensor: x
            for leaf, x in zip(graph.inputs, jax.tree_util.tree_leaves(args), strict=True)
        }
        outs = eval_layerwise(graph, layerwise, env, wanted, constrain, bind)
        return jax.tree_util.tree_unflatten(graph.out_tree, list(outs))

    return run


def _recomputing(
    graph: Any,
    rc: Recompute,
    constrain: Callable,
    bind: dict[int, Callable],
    layerwise: Layerwise | None = None,
    layout: Callable[[int], tuple] | None = None,
) -> Callable:
    """The captured program re-run with the plan's recompute units (`rc`: layers, or their
    attention cores; `_remat/`) made again in the backward, fixing the plan's internal
    tensors too; `bind` computes ops in place of their primitives (ZeRO-3's lookups);
    `layerwise`: ZeRO-3's gathers layer by layer (`_fsdp.py`); `layout`: the plan's
    layouts (`plan_layout`), to tie each recompute to a backward value laid out alike."""
    wanted = [leaf.tensor for leaf in graph.outputs]

    def run(*args: Any) -> Any:
        env = {
            leaf.tensor: x
            for leaf, x in zip(graph.inputs, jax.tree_util.tree_leaves(args), strict=True)
        }
        ops = range(len(graph.ops))
        outs = eval_recomputing(
            graph, rc, ops, env, wanted, constrain, bind=bind, layerwise=layerwise, layout=layout
        )
        return jax.tree_util.tree_unflatten(graph.out_tree, list(outs))

    return run


def _a_plan(plan: Any) -> Plan:
    """`plan` itself when it is a Plan; a one-line error naming the fix otherwise (a path
    given where the loaded plan belongs is the usual slip)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        raise PlanError(
            f"apply takes a Plan, not the path {str(plan)!r}: load it first, "
            f"am.apply(step, am.Plan.load({str(plan)!r}))."
        )
    raise PlanError(
        f"apply takes a Plan (from am.plan or am.Plan.load), got {type(plan).__name__}."
    )


def apply(fn: Callable, plan: Plan, *, devices: Sequence[Any] | None = None) -> Callable:
    """A callable that runs `fn` with the plan's shardings on `devices` (default: all).

    The result computes what `fn` computes (up to float reassociation). Arguments may be
    numpy or jax arrays; they are placed with the plan's shardings. The step is traced
    and compiled once per argument structure. A step jitted with `donate_argnums` (and
    no ZeRO in the plan) keeps its donated state laid out in memory as XLA chooses: the
    first call lays the state out so, giving up the donated arrays, and the state it
    returns goes back in as it is (DESIGN.md, "Layouts of the state").
    """
    plan = _a_plan(plan)
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
