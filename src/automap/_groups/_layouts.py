"""Layouts: an assignment of mesh axes to linkage groups as the Plan that realizes it.

Input: a Graph, its Groups, a mesh and an assignment {group: axis}. Output: every tensor's
spec (`layouts`) and the Plan with its input and output specs, the internal tensors it
pins, and with ZeRO the gradients and the update pinned to the data-sharded layout
(`plan_from_assignment`). DESIGN.md, "Specs" and "Linkage groups".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Mapping

from .._axes import DATA, PIPE
from .._capture import find_residuals, loss_boundary
from .._graph import Graph, Role, TensorKind
from .._plan import Plan, Spec
from ._linkage import Groups
from ._mixed import gathers_compute, narrow_params
from ._rules import dim_ties
from ._state import state_inputs

#: An input or output path's leading argument position (`[1]` of `[1]['mu']...`).


def expand_classes(groups: Groups, by_class: Mapping[int, str | None]) -> dict[int, str | None]:
    """A coarse (per layer class) assignment as a per-group one."""
    return {gid: by_class[c] for c, ids in groups.classes().items() if c in by_class for gid in ids}


def layouts(graph: Graph, groups: Groups, assignment: Mapping[int, str | None]) -> tuple[Spec, ...]:
    """Per tensor, the mesh axis of each dim. One axis cannot split two dims of a tensor:
    the dim whose group has the smaller id keeps it (the same rule in the cost model)."""
    return _layouts_and_drops(graph, groups, assignment)[0]


def _layouts_and_drops(
    graph: Graph, groups: Groups, assignment: Mapping[int, str | None]
) -> tuple[tuple[Spec, ...], tuple[bool, ...]]:
    """`layouts`, and per tensor whether its layout dropped a split of the assignment:
    the few latest, as the planner makes the plans of one assignment for many points."""
    key = frozenset(assignment.items())
    make = functools.partial(_find_layouts, groups, dict(assignment))
    return graph.recall("layouts", groups, key, make, keep=RECENT_LAYOUTS)


#: How many assignments' layouts of one graph are kept (a 1T GPT's: 200,000 specs each).
RECENT_LAYOUTS = 8


def _find_layouts(
    groups: Groups, assignment: Mapping[int, str | None]
) -> tuple[tuple[Spec, ...], tuple[bool, ...]]:
    lay = _spec_per_tensor(groups, assignment)
    lost = tuple(
        _dropped(spec, tg, assignment) for spec, tg in zip(lay, groups.tensor_groups, strict=True)
    )
    return lay, lost


def _spec_per_tensor(groups: Groups, assignment: Mapping[int, str | None]) -> tuple[Spec, ...]:
    out = []
    for tg in groups.tensor_groups:
        spec: list[str | None] = []
        taken: dict[str, int] = {}
        for g in tg:
            axis = assignment.get(g)
            if axis is not None and (axis not in taken or taken[axis] > g):
                if axis in taken:  # an earlier dim with a larger group id gives it up
                    spec[spec.index(axis)] = None
                taken[axis] = g
                spec.append(axis)
            else:
                spec.append(None)
        out.append(tuple(spec))
    return tuple(out)


# Anchors: ops whose result layout XLA must be told (it may pick another otherwise).
_ANCHORS = frozenset({"dot_general", "conv_general_dilated", "gather", "scatter-add"})
#: A lookup's gradient, as JAX's versions spell the primitive.
_SCATTERS = frozenset({"scatter-add", "scatter_add"})


def plan_from_assignment(
    graph: Graph,
    groups: Groups,
    mesh: Mapping[str, int],
    assignment: Mapping[int, str | None],
    *,
    name: str = "",
    zero_stage: int = 0,
    data_axis: str = DATA,
    zero_gather: str = "compute",
) -> Plan:
    """The plan that realizes an assignment: input/output specs and internal constraints.
    With ZeRO, the gradients and the optimizer update are pinned to the ZeRO layout (one
    stage and pipeline stages alike). `zero_gather` (`Plan.zero_gather`): what ZeRO-1/2
    gathers where the step is mixed-precision; the plan records "compute" only where that
    changes anything (`_mixed.py`)."""
    assignment = _takeable(groups, mesh, assignment)
    lay = layouts(graph, groups, assignment)
    narrow: dict[int, tuple[int, ...]] = {}
    if data_axis == DATA and gathers_compute(zero_stage, mesh, zero_gather):
        narrow = narrow_params(graph, zero_region(graph, groups)[1])
    specs = _input_specs(graph, lay, mesh, zero_stage, data_axis, set(narrow))
    constraints = _anchors(graph, groups, lay, mesh, assignment, zero_stage)
    if zero_stage >= 1 and mesh.get(data_axis, 1) > 1:
        constraints.update(_zero_constraints(graph, groups, lay, mesh, data_axis))
    # The casts of masters kept on shards are gathered whole (their layout's).
    constraints.update((c, lay[c]) for casts in narrow.values() for c in casts)
    return Plan(
        mesh=dict(mesh),
        specs=specs,
        out_specs=_output_specs(graph, lay, specs),
        constraints=constraints,
        zero_stage=zero_stage,
        zero_gather="compute" if narrow else "params",
        name=name,
        assignment={int(g): a for g, a in sorted(assignment.items())},
    )


def _takeable(
    groups: Groups, mesh: Mapping[str, int], assignment: Mapping[int, str | None]
) -> dict[int, str | None]:
    """Only splits the group can take (as the cost model reads the assignment): an axis on
    an unsplittable group, or one whose size does not divide the group, is dropped."""
    return {
        int(g): a
        for g, a in assignment.items()
        if a in mesh
        and groups.groups[int(g)].splittable
        and groups.groups[int(g)].divisor % mesh[a] == 0
    }


def _input_specs(
    graph: Graph,
    lay: tuple[Spec, ...],
    mesh: Mapping[str, int],
    zero_stage: int,
    data_axis: str,
    masters: Collection[int] = (),
) -> dict[str, Spec]:
    """Each input leaf's spec: its layout, sharded over data as ZeRO's stage asks (and
    the float32 `masters` ZeRO-1/2 keeps on shards, `_mixed.py`)."""
    specs: dict[str, Spec] = {}
    for leaf in graph.inputs:
        spec = lay[leaf.tensor]
        shape = graph.tensors[leaf.tensor].shape
        zero = (leaf.role == Role.OPT_STATE and zero_stage >= 1) or (
            leaf.role == Role.PARAM and (zero_stage >= 3 or leaf.tensor in masters)
        )
        if zero and data_axis in mesh and mesh[data_axis] > 1:
            spec = zero_spec(spec, shape, mesh, data_axis)
        specs[leaf.path] = spec
    return specs


def _output_specs(graph: Graph, lay: tuple[Spec, ...], specs: dict[str, Spec]) -> dict[str, Spec]:
    out_specs: dict[str, Spec] = {}
    state = state_inputs(graph)
    for leaf in graph.outputs:
        same = state.get(leaf.path)
        # New params and optimizer state keep their inputs' specs: the loop can go on.
        if (
            same is not None
            and graph.tensors[same.tensor].shape == graph.tensors[leaf.tensor].shape
        ):
            out_specs[leaf.path] = specs[same.path]
        else:
            out_specs[leaf.path] = lay[leaf.tensor]
    return out_specs


def _anchors(
    graph: Graph,
    groups: Groups,
    lay: tuple[Spec, ...],
    mesh: Mapping[str, int],
    assignment: Mapping[int, str | None],
    zero_stage: int,
) -> dict[int, Spec]:
    """The layouts XLA must be told, {tensor id: spec}: the results of anchor ops, of ops
    touching a tensor whose layout dropped a split, of seams, and ZeRO-3's gathers."""
    constraints: dict[int, Spec] = {}
    if math.prod(mesh.values()) <= 1:
        return constraints
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}
    # A seam's result is pinned too: left free, XLA may keep the batch split through the
    # flatten (and all-reduce the dense layers' gradients) where the plan has it whole.
    seams = {s.op for s in groups.seams}
    # A microbatch split is pinned: left free, XLA keeps the input's block layout through
    # the reshape (microbatches split, each one's examples less so) and gathers the
    # scanned dim for the loop, which leaves devices computing the same examples.
    seams.update(groups.microbatch_splits)
    shards = _shard_readers(graph, groups) if zero_stage >= 3 else frozenset()
    lost = _layouts_and_drops(graph, groups, assignment)[1]
    for op in graph.ops:
        dropped = any(lost[t] for t in op.inputs) or any(lost[t] for t in op.outputs)
        # ZeRO-3: a parameter is gathered where it is first used (its cast to the compute
        # dtype); unconstrained, XLA would split the matmul over data. Not where the step
        # reads the shards (a metric of the parameters): pinned whole, XLA gathered it.
        gathers = zero_stage >= 3 and params.intersection(op.inputs) and op.index not in shards
        if op.primitive in _ANCHORS or dropped or op.index in seams or gathers:
            for t in op.outputs:
                if graph.tensors[t].ndim:
                    constraints[t] = lay[t]
    return constraints


def _zero_constraints(
    graph: Graph, groups: Groups, lay: tuple[Spec, ...], mesh: Mapping[str, int], data_axis: str
) -> dict[int, Spec]:
    """DeepSpeed's pattern: each gradient is reduce-scattered into the ZeRO layout (its
    data-parallel partial sums meet a layout split over data), the optimizer update runs on
    each device's shard, and the new parameters leave in their own layout (gathered over
    data, but for ZeRO-3). A tensor there takes the data axis on the dim linked to the one
    the state it becomes takes it on: a transposed or reshaped gradient then needs no
    all-to-all."""
    return _zero_pins(graph, groups, lay, mesh, data_axis)


def _zero_pins(graph, groups, lay, mesh, data_axis) -> dict[int, Spec]:
    """`_zero_constraints` under the layouts `lay`: {tensor: its spec with the data axis}."""
    constraints: dict[int, Spec] = {}
    pinned, update = zero_region(graph, groups)
    wanted = _zero_groups(graph, groups, lay, mesh, data_axis, update)
    dims = _zero_dims(graph, groups, lay, mesh, data_axis, update)
    for t in (*pinned, *(t for i in sorted(update) for t in graph.ops[i].outputs)):
        spec = _on_groups(
            lay[t],
            graph.tensors[t].shape,
            groups.tensor_groups[t],
            wanted.get(t, ()),
            mesh,
            data_axis,
            dims.get(t, ()),
        )
        if spec is not None:
            constraints[t] = spec
    return constraints


def zero_pinned_dims(graph: Graph, groups: Groups, data_size: int) -> dict[int, int]:
    """Per tensor ZeRO pins (gradients and the update's results), the dim its constraint
    puts a data axis of `data_size` on, in a plan that splits no other dim of it (data
    parallelism's, where ZeRO is offered): what the update's own sums run over (the cost
    model's `_zero.UpdateReductions`). A tensor not listed is not pinned."""
    lay = tuple((None,) * t.ndim for t in graph.tensors)
    pins = _zero_pins(graph, groups, lay, {DATA: data_size}, DATA)
    return {t: spec.index(DATA) for t, spec in pins.items()}


def zero_mismatch(graph: Graph, groups: Groups, plan: Plan) -> str:
    """Why `plan` cannot run as it is priced: its `zero_stage` is not the one its shardings
    were made with ("" when it is, or when that cannot be told). The cost model reads the
    stage from the field and the runtime does what the specs and constraints say, so a
    plan edited with `dataclasses.replace(plan, zero_stage=k)` would be priced as ZeRO-k
    and run as before. Told by making the plan's recorded assignment again at each stage:
    only a plan whose shardings are exactly another stage's is refused."""
    if plan.assignment is None:
        return ""
    mesh = {a: n for a, n in plan.mesh.items() if a != PIPE}  # a pipeline's stage mesh

    def shardings(stage: int, gather: str = plan.zero_gather) -> tuple:
        made = plan_from_assignment(
            graph, groups, mesh, plan.assignment, zero_stage=stage, zero_gather=gather
        )
        return dict(made.specs), dict(made.constraints)

    own = dict(plan.specs), dict(plan.constraints)
    if shardings(plan.zero_stage) == own:
        return ""
    other = "params" if plan.zero_gather == "compute" else "compute"
    if plan.zero_stage in range(4) and shardings(plan.zero_stage, other) == own:
        return (
            f"the plan says zero_gather={plan.zero_gather!r} but its shardings gather "
            f"{other!r} (was it edited?), so it would be priced gathering one and run "
            f"gathering the other: set zero_gather back to {other!r}."
        )
    made_at = [k for k in range(4) if k != plan.zero_stage and shardings(k) == own]
    if not made_at:
        return ""  # edited otherwise (specs by hand): nothing to say about ZeRO
    stages = " or ".join(map(str, made_at))  # ZeRO-1 and ZeRO-2 shard alike
    if plan.zero_stage not in range(4):  # no recipe makes it: name the stages that exist
        return (
            f"the plan says zero_stage={plan.zero_stage}, which is no ZeRO stage (0, 1, 2 "
            f"or 3), and its shardings are those of zero_stage={stages}: set zero_stage "
            f"back to {made_at[0]}."
        )
    return (
        f"the plan says zero_stage={plan.zero_stage} but its shardings are those of "
        f"zero_stage={stages} (was it edited with dataclasses.replace?), so it would be "
        f"priced at one stage and run at another. Make the plan again at stage "
        f"{plan.zero_stage}, e.g. am.plan_recipe(..., recipe=am.Recipe(..., "
        f"zero={plan.zero_stage})), or set zero_stage back to {made_at[0]}."
    )


def _state_zeroed(graph, lay, mesh, data_axis):
    """(output tensor, dims ZeRO splits over data) for each new parameter and optimizer
    state the step returns: the dims its `zero_spec` adds to the state input's layout."""
    state = state_inputs(graph)
    for out in graph.outputs:
        leaf = state.get(out.path)
        if leaf is not None:
            t, shape = leaf.tensor, graph.tensors[leaf.tensor].shape
            zeroed = zero_spec(lay[t], shape, mesh, data_axis)
            yield (
                out.tensor,
                [d for d, (a, b) in enumerate(zip(zeroed, lay[t], strict=True)) if a != b],
            )


def _zero_groups(graph, groups, lay, mesh, data_axis, update) -> dict[int, set[int]]:
    """Per tensor of the update, the groups of the dims that ZeRO splits over data in the
    new parameters and optimizer state it flows into (read back from the update's end)."""
    want: dict[int, set[int]] = {}
    for out, dims in _state_zeroed(graph, lay, mesh, data_axis):
        want.setdefault(out, set()).update(groups.of(out, d) for d in dims)
    # A tensor passes on only groups it has: through a scalar (clip_by_global_norm's
    # scale, read by every gradient) each gradient took every other one's groups, and a
    # transposed gradient was pinned on its other dim (an all-to-all at the transpose).
    for i in sorted(update, reverse=True):
        op = graph.ops[i]
        w = set().union(*(want.get(t, set()) for t in op.outputs))
        for t in op.inputs:
            want.setdefault(t, set()).update(w.intersection(groups.tensor_groups[t]))
    return want


def _zero_dims(graph, groups, lay, mesh, data_axis, update) -> dict[int, set[int]]:
    """Per tensor of the update, the dims (not groups) the new state's ZeRO split reaches
    through the update ops' ties, read back from its end: where two dims of a tensor
    share a group (a square weight on the residual width), the group cannot tell which
    one a transposed gradient must split, and the wrong one cost an all-to-all per
    weight (a 200-layer residual model)."""
    want: dict[int, set[int]] = {}
    for out, dims in _state_zeroed(graph, lay, mesh, data_axis):
        want.setdefault(out, set()).update(dims)
    for i in sorted(update, reverse=True):
        op = graph.ops[i]
        for a, b in dim_ties(op, graph):
            for (t, d), (u, e) in ((a, b), (b, a)):
                if t in op.outputs and u in op.inputs and d in want.get(t, ()):
                    want.setdefault(u, set()).add(e)
    return want


def _on_groups(
    spec: Spec, shape, tgroups, wanted, mesh, data_axis: str, dims: Collection[int] = ()
) -> Spec | None:
    """`spec` with the data axis added on its first dim in a `wanted` group, `dims` (the
    dims tied to the state's split) first (None: no such dim can take it)."""
    if any(e == data_axis or (isinstance(e, tuple) and data_axis in e) for e in spec):
        return None
    order = sorted(range(len(spec)), key=lambda d: d not in dims)
    for d in order:
        e, g = spec[d], tgroups[d]
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        if g in wanted and shape[d] % (mesh[data_axis] * math.prod(mesh[a] for a in axes)) == 0:
            new = data_axis if not axes else (*axes, data_axis)
            return (*spec[:d], new, *spec[d + 1 :])
    return None


def zero_region(graph: Graph, groups: Groups) -> tuple[tuple[int, ...], frozenset[int]]:
    """What ZeRO pins to its layout split over data: the gradients (of `update_region`)
    that meet it where they are made, and the update ops. With the data axis not carrying
    the batch, XLA then computes only the device's shard of a pinned gradient (slicing
    the operand that carries the split dim) and runs the update on shards.

    A gradient in a 16-bit compute dtype is left free: pinned there, XLA would sum it in
    16 bits, where it now sums after the cast to the parameters' float32. A lookup's
    gradient (a scatter-add of the rows' gradients into the table) keeps the plan's
    layout, summed over data, and meets the ZeRO layout where the update (or a tied
    table's sum with its other gradient) reads it. Pinned to the ZeRO layout itself, XLA
    all-to-alls the rows' gradients onto the table's data split and scatters them there:
    a collective the cost model does not price."""
    gradients, update = update_region(graph, groups)
    pinned = tuple(
        t
        for t in gradients
        if graph.tensors[t].itemsize >= 4
        and graph.ops[graph.tensors[t].producer].primitive not in _SCATTERS
    )
    return pinned, update


def update_region(graph: Graph, groups: Groups) -> tuple[tuple[int, ...], frozenset[int]]:
    """The gradients (batch-free tensors, rank >= 1, made by ops that touch the batch and
    read by ops that do not, or returned) and the update ops (ops that do not touch the
    batch but read a gradient, directly or not): where ZeRO shards the step. Empty when
    the step has no batch dimension to tell them by."""
    batch = set(groups.batch_groups)
    batched = {t.id for t in graph.tensors if batch.intersection(groups.tensor_groups[t.id])}
    if not batched:
        return (), frozenset()
    per_example = [any(t in batched for t in (*op.inputs, *op.outputs)) for op in graph.ops]
    consumers = graph.consumers()
    returned = {leaf.tensor for leaf in graph.outputs}
    gradients = sorted(
        t
        for op in graph.ops
        if per_example[op.index]
        for t in op.outputs
        if t not in batched
        and graph.tensors[t].ndim
        and (t in returned or any(not per_example[c] for c in consumers[t]))
    )
    after = set(gradients)
    update: set[int] = set()
    for op in graph.ops:
        if not per_example[op.index] and after.intersection(op.inputs):
            update.add(op.index)
            after.update(op.outputs)
    return tuple(gradients), frozenset(update)


@dataclasses.dataclass(frozen=True)
class Regather:
    """ZeRO-3 as FSDP runs it: the backward gathers the parameters it reads once more,
    instead of keeping the forward's gathered copies alive from forward to backward.

    The captured step is already differentiated, so its backward ops read the forward's
    gathered values (a weight's cast to the compute dtype, say). The runtime
    (`_run/_fsdp.py`, layer by layer) makes those values again for the backward, from
    the sharded parameters, at the first backward read; the cost model charges the second
    gather of `params`."""

    boundary: int  # the last forward op
    backward: frozenset[int]  # ops that take the gathered values again: after the loss,
    # outside the optimizer update (which runs on the shards)
    remake: tuple[int, ...]  # forward ops computing from parameters alone, in order
    tensors: frozenset[int]  # what the backward reads of parameters or of `remake`'s results
    params: tuple[int, ...]  # the parameter tensors those are made from


def regather_plan(graph: Graph, groups: Groups) -> Regather:
    """Which backward reads ZeRO-3 serves with a second gather (empty without a loss: no
    backward to tell)."""
    return graph.recall(
        "regather_plan", groups, None, lambda: _regather_plan(graph, groups), keep=1
    )


def _regather_plan(graph: Graph, groups: Groups) -> Regather:
    if loss_boundary(graph) is None:
        return Regather(len(graph.ops), frozenset(), (), frozenset(), ())
    boundary = find_residuals(graph).boundary
    gradients, update = update_region(graph, groups)
    roots: dict[int, frozenset[int]] = {
        leaf.tensor: frozenset({leaf.tensor}) for leaf in graph.leaves(Role.PARAM)
    }
    remake = []
    for op in graph.ops[: boundary + 1]:
        ins = [t for t in op.inputs if graph.tensors[t].kind is not TensorKind.CONST]
        if ins and all(t in roots for t in ins):
            remake.append(op.index)
            made = frozenset().union(*(roots[t] for t in ins))
            roots.update((t, made) for t in op.outputs)
    backward = _making(graph, gradients, boundary + 1, update)
    tensors = frozenset(t for i in backward for t in graph.ops[i].inputs if t in roots)
    params = sorted(frozenset().union(*(roots[t] for t in tensors)))
    return Regather(boundary, backward, tuple(remake), tensors, tuple(params))


def _shard_readers(graph: Graph, groups: Groups) -> frozenset[int]:
    """The ops past the forward that ZeRO-3's runtime runs on the parameters' shards: all
    but the backward (`regather_plan`), so the update and what reads the parameters
    beside it (a metric of them, AdamW's weight decay)."""
    rg = regather_plan(graph, groups)
    return frozenset(range(rg.boundary + 1, len(graph.ops))) - rg.backward


def _making(graph: Graph, gradients: Collection[int], start: int, update: Collection[int]):
    """The ops from `start` on, outside the `update`, that the `gradients` are made from:
    the backward. Not a metric of the parameters (`optax.global_norm(params)` returned
    beside the state) nor the update's own reads (AdamW's weight decay): those read the
    shards, as the update does, where gathered again they cost a gather per parameter
    (XLA merged the first layer's with the forward's, and the price counted it). All of
    them where no gradient is known (a step without a batch dimension)."""
    later = [op for op in graph.ops[start:] if op.index not in update]
    if not gradients:
        return frozenset(op.index for op in later)
    wanted, out = set(gradients), set()
    for op in reversed(later):
        if wanted.intersection(op.outputs):
            out.add(op.index)
            wanted.update(op.inputs)
    return frozenset(out)


def lookups(graph: Graph) -> dict[int, int]:
    """The ops that index a parameter (an embedding table read by a gather): op index ->
    the parameter. ZeRO-3 gathers such a table where the lookup reads it, as it gathers
    a weight where a matmul reads it. Left sharded there, XLA looks the rows up in the
    table's ZeRO shards (its hidden dim split over data) and moves them back to the batch
    split with an all-to-all: a collective the plan does not ask for and the cost model,
    which charges the table's all-gather, does not price."""
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}
    return {
        op.index: op.inputs[0]
        for op in graph.ops
        if op.primitive == "gather" and op.inputs and op.inputs[0] in params
    }


def unzero_spec(spec: Spec, data_axis: str) -> Spec:
    """`spec` without the data axis (the layout a ZeRO-3 parameter is gathered to)."""
    out: list = []
    for e in spec:
        if isinstance(e, tuple):
            rest = tuple(a for a in e if a != data_axis)
            out.append(rest if len(rest) > 1 else rest[0] if rest else None)
        else:
            out.append(None if e == data_axis else e)
    return tuple(out)


def _dropped(spec: Spec, tg: tuple[int, ...], assignment: Mapping[int, str]) -> bool:
    return any(s is None and g in assignment for s, g in zip(spec, tg, strict=True))


def zero_spec(spec: Spec, shape: tuple[int, ...], mesh: Mapping[str, int], data_axis: str) -> Spec:
    """Add the data axis to one dim (ZeRO): the first unsplit dim it divides, else the first
    split dim whose shard it divides. Left alone when no dim fits (a scalar count)."""
    if any(e == data_axis or (isinstance(e, tuple) and data_axis in e) for e in spec):
        return spec
    n = mesh[data_axis]
    for d, e in enumerate(spec):
        if e is None and shape[d] % n == 0:
            return (*spec[:d], data_axis, *spec[d + 1 :])
    for d, e in enumerate(spec):
        axes = (e,) if isinstance(e, str) else e
        if e is not None and shape[d] % (n * math.prod(mesh[a] for a in axes)) == 0:
            return (*spec[:d], (*axes, data_axis), *spec[d + 1 :])
    return spec


def shardable(shape: tuple[int, ...], size: int) -> bool:
    """Whether a data axis of `size` divides some dim of `shape`: if none, `zero_spec`
    leaves the tensor whole on every layout (a float32 master of a bias of 6, say, is
    then held whole, updated whole and gathered by nobody)."""
    return any(n % size == 0 for n in shape)


def assignment_from_specs(
    graph: Graph, groups: Groups, plan: Plan, data_axis: str = DATA
) -> dict[int, str]:
    """A plan's assignment {group: axis} read back from its specs and constraints, for a
    plan that records none (written by hand, or by another tool): the axes its specs name,
    propagated to their groups. The data axis ZeRO adds to parameters and optimizer state,
    and to the gradients and updates its constraints shard, is not a group decision (the
    batch's is read from the inputs). The cost model prices such a plan by it and the
    runtime lays ZeRO-3's layer-by-layer ties by it, so both read the plan alike."""
    out: dict[int, str] = {}
    role = {leaf.path: leaf.role for leaf in graph.inputs}
    sources = [(leaf.tensor, plan.specs.get(leaf.path), role[leaf.path]) for leaf in graph.inputs]
    sources += [(t, spec, None) for t, spec in plan.constraints.items()]
    for t, spec, r in sources:
        if spec is None or t >= len(graph.tensors):
            continue
        zero = (r == Role.OPT_STATE and plan.zero_stage >= 1) or (
            r == Role.PARAM and plan.zero_stage >= 3
        )
        zero |= r is None and plan.zero_stage >= 1  # a constraint: ZeRO's shards
        for d, e in enumerate(spec[: graph.tensors[t].ndim]):
            axes = [e] if isinstance(e, str) else list(e or ())
            if zero:
                axes = [a for a in axes if a != data_axis]
            if axes:
                out.setdefault(groups.of(t, d), axes[0])
    return out
