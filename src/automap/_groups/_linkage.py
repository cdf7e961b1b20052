"""Linkage groups: the union of tensor dimensions tied by the primitives' rules.

Deciding the mesh axis of one group decides every tensor dimension in it, so the search
space is one choice per group rather than one per tensor dimension (the paper's pruning).
Repeated layers give groups of the same signature; they share a `layer_class`, so a coarse
space decides once per class and a fine one per group.

This module also turns an assignment {group id: mesh axis or None} into per-tensor
layouts and into a `Plan` that `apply` can run.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping

import numpy as np

from .._axes import DATA
from .._graph import Graph, InputLeaf, Op, Role
from .._plan import Plan, Spec
from ._rules import minor_factors, rule

_DIGITS = re.compile(r"\d+")
_POSITION = re.compile(r"^\[\d+\]")


@dataclasses.dataclass(frozen=True)
class Group:
    id: int
    members: tuple[tuple[int, int], ...]  # (tensor id, dim), sorted
    divisor: int  # gcd of member sizes: an axis of size k may split the group iff divisor % k == 0
    conflicted: bool  # two dims of one tensor in the group: cannot be split
    batch: bool  # holds dim 0 of a batch input
    param_dims: tuple[tuple[str, int], ...]  # (input leaf path, dim) of parameter leaves
    bytes: int  # bytes of the distinct tensors touched
    flops: float  # flops of the ops touching it
    layer_class: int  # groups of repeated layers with the same signature share a class
    reduced: bool  # some op sums over it: splitting it implies partial sums (all-reduces)

    @property
    def splittable(self) -> bool:
        return self.divisor > 1 and not self.conflicted


@dataclasses.dataclass(frozen=True)
class Seam:
    """A flatten where the batch group was cut in two (see `build_groups`): its input's
    batch dim is in `before`, its output's in `after`. With the two on different axes the
    op reshards (the cost model charges it); on the same axis it runs locally."""

    op: int
    before: int
    after: int
    convolutions: int  # `before` or `after`: the side the convolutions are on


@dataclasses.dataclass(frozen=True)
class Groups:
    groups: tuple[Group, ...]
    tensor_groups: tuple[tuple[int, ...], ...]  # per tensor id: the group id of each dim
    seams: tuple[Seam, ...] = ()

    def of(self, tensor: int, dim: int) -> int:
        return self.tensor_groups[tensor][dim]

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def batch_groups(self) -> tuple[int, ...]:
        """The splittable groups of the batch dimension: one, or one per side of each seam
        (the batch of convolutions and of the fully connected layers after a flatten)."""
        return tuple(g.id for g in self.groups if g.batch and g.splittable)

    def seam_pairs(self) -> tuple[tuple[int, int], ...]:
        """(convolutions' batch group, the other side's batch group) of each seam."""
        pairs = {(s.convolutions, s.before + s.after - s.convolutions) for s in self.seams}
        return tuple(sorted(pairs))

    @property
    def batch_size(self) -> int | None:
        """What every batch group divides by: the batch size, or None without a batch."""
        ids = self.batch_groups
        return math.gcd(*(self.groups[g].divisor for g in ids)) if ids else None

    def decision_groups(self) -> tuple[int, ...]:
        """Ids of the groups a searcher decides (the splittable ones), by bytes descending."""
        ids = [g.id for g in self.groups if g.splittable]
        return tuple(sorted(ids, key=lambda i: (-self.groups[i].bytes, i)))

    def classes(self) -> dict[int, tuple[int, ...]]:
        """Layer class -> ids of its splittable groups (the coarse space's decisions)."""
        out: dict[int, list[int]] = {}
        for g in self.groups:
            if g.splittable:
                out.setdefault(g.layer_class, []).append(g.id)
        return {c: tuple(ids) for c, ids in out.items()}

    def stats(self) -> dict[str, int]:
        """Space sizes before and after pruning: tensor dims, groups, decisions."""
        dims = sum(len(t) for t in self.tensor_groups)
        return {
            "dims": dims,
            "splittable_dims": sum(len(g.members) for g in self.groups if g.splittable),
            "groups": len(self.groups),
            "decisions": len(self.decision_groups()),
            "decisions_layer_grouped": len(self.classes()),
        }

    def largest(self, n: int = 10) -> tuple[Group, ...]:
        return tuple(self.groups[i] for i in self.decision_groups()[:n])


def build_groups(graph: Graph, *, layer_grouping: bool = True, seams: bool = True) -> Groups:
    """Union-find over (tensor, dim) pairs tied by each op's rule.

    With `seams`, the batch dimension is cut at each flatten of per-example features
    ([B, h, w, c] -> [B, h*w*c] and back, `_flatten_tie`) that parts convolutions from the
    layers after them: the convolutions' batch and the fully connected layers' batch become
    two groups, so a plan can split one and not the other ("one weird trick"). Where another
    path still links the two sides they stay one group; other dims are never cut."""
    offsets = np.zeros(len(graph.tensors) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([t.ndim for t in graph.tensors])
    rules = [rule(op, graph) for op in graph.ops]
    flat_ties = [
        [(int(offsets[ta]) + da, int(offsets[tb]) + db) for (ta, da), (tb, db) in r.ties]
        for r in rules
    ]
    find = _union(int(offsets[-1]), (tie for ties in flat_ties for tie in ties))
    batch_dims = {(leaf.tensor, 0) for leaf in graph.leaves(Role.BATCH)}
    cuts = _cut_seams(graph, offsets, flat_ties, find, batch_dims) if seams else _Cuts()
    find = cuts.find or find

    reduced_flat: set[int] = set()
    whole_flat: set[int] = set()
    minor_flat: list[tuple[int, int]] = []
    op_dims: list[list[int]] = []
    for op, r in zip(graph.ops, rules, strict=True):
        reduced_flat.update(int(offsets[t]) + d for t, d in r.reduced)
        whole_flat.update(int(offsets[t]) + d for t, d in r.whole)
        minor_flat += [
            (int(offsets[a[0]]) + a[1], int(offsets[b[0]]) + b[1])
            for a, b in minor_factors(op, graph)
        ]
        touched = [*op.inputs, *op.outputs]
        op_dims.append([int(offsets[t]) + d for t in touched for d in range(graph.tensors[t].ndim)])

    roots = [find(x) for x in range(int(offsets[-1]))]
    gid_of_root: dict[int, int] = {}
    for r in roots:  # group ids in order of first (tensor, dim): deterministic
        gid_of_root.setdefault(r, len(gid_of_root))
    flat_gid = np.array([gid_of_root[r] for r in roots], dtype=np.int64)
    n = len(gid_of_root)
    members: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for t in graph.tensors:
        for d in range(t.ndim):
            members[flat_gid[offsets[t.id] + d]].append((t.id, d))

    flops = np.zeros(n)
    for op, dims in zip(graph.ops, op_dims, strict=True):
        for g in set(flat_gid[dims].tolist()):
            flops[g] += op.flops
    reduced = np.zeros(n, dtype=bool)
    reduced[flat_gid[sorted(reduced_flat)]] = True
    whole = np.zeros(n, dtype=bool)
    whole[flat_gid[sorted(whole_flat)]] = True
    whole |= _pinned_minors(graph, members, flat_gid, minor_flat, whole)
    if cuts.batch_flat:  # every part of a cut batch group is a batch group
        batch_dims = {
            (t.id, d)
            for t in graph.tensors
            for d in range(t.ndim)
            if int(offsets[t.id]) + d in cuts.batch_flat
        }
    param_path = {leaf.tensor: leaf.path for leaf in graph.leaves(Role.PARAM)}

    # Divisor 1 (never split) for groups of dead tensors (never read, not a step output:
    # a decision without consequence) and groups a rule keeps whole (conv spatial dims).
    used = {t for op in graph.ops for t in op.inputs} | {leaf.tensor for leaf in graph.outputs}
    groups = []
    for gid, mem in enumerate(members):
        tensors = [t for t, _ in mem]
        free = not whole[gid] and any(t in used for t in tensors)
        sizes = [graph.tensors[t].shape[d] if free else 1 for t, d in mem]
        groups.append(
            dict(
                id=gid,
                members=tuple(mem),
                divisor=math.gcd(*sizes),
                conflicted=len(set(tensors)) < len(tensors),
                batch=any(m in batch_dims for m in mem),
                param_dims=tuple((param_path[t], d) for t, d in mem if t in param_path),
                bytes=sum(graph.tensors[t].nbytes for t in set(tensors)),
                flops=float(flops[gid]),
                reduced=bool(reduced[gid]),
            )
        )
    classes = _layer_classes(graph, groups, layer_grouping)
    tensor_groups = tuple(
        tuple(int(g) for g in flat_gid[offsets[t.id] : offsets[t.id + 1]]) for t in graph.tensors
    )
    found = tuple(
        Seam(op, int(flat_gid[a]), int(flat_gid[b]), int(flat_gid[a if cuts.conv[op] else b]))
        for op, (a, b) in sorted(cuts.ties.items())
        if flat_gid[a] != flat_gid[b]
    )
    return Groups(
        tuple(Group(layer_class=c, **g) for g, c in zip(groups, classes, strict=True)),
        tensor_groups,
        found,
    )


@dataclasses.dataclass(frozen=True)
class _Cuts:
    """The batch ties `_cut_seams` cut, and the union-find without them."""

    ties: Mapping[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # op -> tie
    conv: Mapping[int, bool] = dataclasses.field(default_factory=dict)  # op -> input on conv side
    find: Callable[[int], int] | None = None
    batch_flat: frozenset[int] = frozenset()  # flat dims of the batch before the cuts


def _cut_seams(graph: Graph, offsets, flat_ties, find, batch_dims) -> _Cuts:
    """Cut the batch's dim-0 tie at each flatten (`_flatten_tie`), then keep only the cuts
    that part convolution tensors from the rest, cutting again until that holds: a flatten
    inside the convolutions, or one after them that another path bridges, stays tied."""
    n = int(offsets[-1])
    batch_roots = {find(int(offsets[t]) + d) for t, d in batch_dims if graph.tensors[t].ndim}
    cut: dict[int, tuple[int, int]] = {}
    for op in graph.ops:
        tie = _flatten_tie(op, graph)
        if tie is not None and find(int(offsets[tie[0][0]])) in batch_roots:
            cut[op.index] = (int(offsets[tie[0][0]]), int(offsets[tie[1][0]]))
    conv = {t for op in graph.ops if op.primitive == "conv_general_dilated" for t in op.inputs}
    while cut:  # each pass keeps a subset: it ends
        kept = (
            tie
            for i, ties in enumerate(flat_ties)
            for tie in ties
            if cut.get(i) not in (tie, tie[::-1])
        )
        cut_find = _union(n, kept)
        conv_roots = {
            cut_find(int(offsets[t]) + d) for t in conv for d in range(graph.tensors[t].ndim)
        }
        on_conv = {i: cut_find(x) in conv_roots for i, (x, _) in cut.items()}
        parting = {i: xy for i, xy in cut.items() if on_conv[i] != (cut_find(xy[1]) in conv_roots)}
        if parting == cut:
            batch = frozenset(x for x in range(n) if find(x) in batch_roots)
            return _Cuts(cut, on_conv, cut_find, batch)
        cut = parting
    return _Cuts()


def _union(n: int, ties) -> Callable[[int], int]:
    """Union-find over n flat dims joined by `ties`; returns `find`. Roots are the smallest
    member, so group ids do not depend on the order of the ties."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x, y in ties:
        a, b = find(x), find(y)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return find


def _flatten_tie(op: Op, graph: Graph) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The dim-0 tie of a reshape that flattens per-example features into one dim ([B, h,
    w, c] -> [B, h*w*c], dim 0 kept) or unflattens them (its transpose in the backward
    pass)."""
    if op.primitive != "reshape" or op.params.get("dimensions") is not None:
        return None
    (t,), (o,) = op.inputs, op.outputs
    a, b = graph.tensors[t].shape, graph.tensors[o].shape
    flat, features = (b, a) if len(b) <= len(a) else (a, b)
    if len(flat) != 2 or len(features) < 3 or a[0] != b[0] or a[0] <= 1 or flat[1] <= 1:
        return None  # also no flatten: one that only adds or drops dims of size 1
    return (t, 0), (o, 0)


def _pinned_minors(graph, members, flat_gid, minor_flat, whole) -> np.ndarray:
    """Groups of minor reshape factors whose major factor can be split (head_dim next to
    heads): kept whole. Splitting both is what XLA would express as one dim on two axes
    (then an all-reduce over both at the next matmul); splitting head_dim is never useful."""
    out = np.zeros(len(members), dtype=bool)
    for major, minor in minor_flat:
        gm, gn = flat_gid[major], flat_gid[minor]
        if gm == gn or whole[gm]:
            continue
        tensors = [t for t, _ in members[gm]]
        sizes = [graph.tensors[t].shape[d] for t, d in members[gm]]
        if len(set(tensors)) == len(tensors) and math.gcd(*sizes) > 1:
            out[gn] = True
    return out


def _layer_classes(graph: Graph, groups: list[dict], layer_grouping: bool) -> list[int]:
    """One class per signature. A group touching parameters is known by its parameters'
    paths with digits normalized (`layer_3` ~ `layer_7`) plus its size; other groups by
    their structure (divisor, member count, producers' primitives)."""
    if not layer_grouping:
        return list(range(len(groups)))
    producer = [
        "input" if t.producer is None else graph.ops[t.producer].primitive for t in graph.tensors
    ]
    sigs: dict[tuple, int] = {}
    out = []
    for g in groups:
        if g["param_dims"]:
            key: tuple = tuple(sorted({(_DIGITS.sub("#", p), d) for p, d in g["param_dims"]}))
        else:
            key = tuple(sorted((producer[t], graph.tensors[t].ndim, d) for t, d in g["members"]))
        sig = (key, g["divisor"], len(g["members"]), g["batch"])
        out.append(sigs.setdefault(sig, len(sigs)))
    return out


def expand_classes(groups: Groups, by_class: Mapping[int, str | None]) -> dict[int, str | None]:
    """A coarse (per layer class) assignment as a per-group one."""
    return {gid: by_class[c] for c, ids in groups.classes().items() if c in by_class for gid in ids}


def layouts(graph: Graph, groups: Groups, assignment: Mapping[int, str | None]) -> tuple[Spec, ...]:
    """Per tensor, the mesh axis of each dim. One axis cannot split two dims of a tensor:
    the dim whose group has the smaller id keeps it (the same rule in the cost model)."""
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


def plan_from_assignment(
    graph: Graph,
    groups: Groups,
    mesh: Mapping[str, int],
    assignment: Mapping[int, str | None],
    *,
    name: str = "",
    zero_stage: int = 0,
    data_axis: str = DATA,
    shard_update: bool = True,
) -> Plan:
    """The plan that realizes an assignment: input/output specs and internal constraints.
    With ZeRO, `shard_update` pins the gradients and the optimizer update to the ZeRO
    layout (a pipeline stage, which reduces its gradients in a program of its own, does
    not yet)."""
    # Only splits the group can take (as the cost model reads the assignment): an axis on
    # an unsplittable group, or one whose size does not divide the group, is dropped.
    assignment = {
        int(g): a
        for g, a in assignment.items()
        if a in mesh
        and groups.groups[int(g)].splittable
        and groups.groups[int(g)].divisor % mesh[a] == 0
    }
    lay = layouts(graph, groups, assignment)
    specs: dict[str, Spec] = {}
    for leaf in graph.inputs:
        spec = lay[leaf.tensor]
        shape = graph.tensors[leaf.tensor].shape
        zero = (leaf.role == Role.OPT_STATE and zero_stage >= 1) or (
            leaf.role == Role.PARAM and zero_stage >= 3
        )
        if zero and data_axis in mesh and mesh[data_axis] > 1:
            spec = zero_spec(spec, shape, mesh, data_axis)
        specs[leaf.path] = spec
    out_specs: dict[str, Spec] = {}
    # A pipeline (`shard_update=False`) keeps its inputs' specs only where the paths are
    # equal, as its cost model prices it (pipelined ZeRO gathers the state for the update).
    state = state_inputs(graph) if shard_update else _same_path(graph)
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
    constraints: dict[int, Spec] = {}
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}
    # A seam's result is pinned too: left free, XLA may keep the batch split through the
    # flatten (and all-reduce the dense layers' gradients) where the plan has it whole.
    seams = {s.op for s in groups.seams}
    if math.prod(mesh.values()) > 1:
        for op in graph.ops:
            dropped = any(
                _dropped(lay[t], groups.tensor_groups[t], assignment)
                for t in (*op.inputs, *op.outputs)
            )
            if op.primitive in _ANCHORS or dropped or op.index in seams:
                for t in op.outputs:
                    if graph.tensors[t].ndim:
                        constraints[t] = lay[t]
            elif zero_stage >= 3 and params.intersection(op.inputs):
                # ZeRO-3: a parameter is gathered where it is first used (its cast to the
                # compute dtype); unconstrained, XLA would split the matmul over data.
                for t in op.outputs:
                    if graph.tensors[t].ndim:
                        constraints[t] = lay[t]
    if shard_update and zero_stage >= 1 and mesh.get(data_axis, 1) > 1:
        # DeepSpeed's pattern: each gradient is reduce-scattered into the ZeRO layout (its
        # data-parallel partial sums meet a layout split over data), the optimizer update
        # runs on each device's shard, and the new parameters leave in their own layout
        # (gathered over data, but for ZeRO-3). A tensor there takes the data axis on the
        # dim linked to the one the state it becomes takes it on: a transposed or
        # reshaped gradient then needs no all-to-all.
        gradients, update = update_region(graph, groups)
        wanted = _zero_groups(graph, groups, lay, mesh, data_axis, update)
        # A gradient in a 16-bit compute dtype is left free: pinned there, XLA would sum
        # it in 16 bits, where it now sums after the cast to the parameters' float32.
        pinned = [t for t in gradients if graph.tensors[t].itemsize >= 4]
        for t in (*pinned, *(t for i in sorted(update) for t in graph.ops[i].outputs)):
            spec = _on_groups(
                lay[t],
                graph.tensors[t].shape,
                groups.tensor_groups[t],
                wanted.get(t, ()),
                mesh,
                data_axis,
            )
            if spec is not None:
                constraints[t] = spec
    return Plan(
        mesh=dict(mesh),
        specs=specs,
        out_specs=out_specs,
        constraints=constraints,
        zero_stage=zero_stage,
        name=name,
        assignment={int(g): a for g, a in sorted(assignment.items())},
    )


def _zero_groups(graph, groups, lay, mesh, data_axis, update) -> dict[int, set[int]]:
    """Per tensor of the update, the groups of the dims that ZeRO splits over data in the
    new parameters and optimizer state it flows into (read back from the update's end)."""
    want: dict[int, set[int]] = {}
    state = state_inputs(graph)
    for out in graph.outputs:
        leaf = state.get(out.path)
        if leaf is not None:
            t, shape = leaf.tensor, graph.tensors[leaf.tensor].shape
            zeroed = zero_spec(lay[t], shape, mesh, data_axis)
            dims = [d for d, (a, b) in enumerate(zip(zeroed, lay[t], strict=True)) if a != b]
            want.setdefault(out.tensor, set()).update(groups.of(out.tensor, d) for d in dims)
    for i in sorted(update, reverse=True):
        op = graph.ops[i]
        w = set().union(*(want.get(t, set()) for t in op.outputs))
        for t in op.inputs:
            want.setdefault(t, set()).update(w)
    return want


def _on_groups(spec: Spec, shape, tgroups, wanted, mesh, data_axis: str) -> Spec | None:
    """`spec` with the data axis added on its first dim in a `wanted` group (None: no such
    dim can take it)."""
    if any(e == data_axis or (isinstance(e, tuple) and data_axis in e) for e in spec):
        return None
    for d, (e, g) in enumerate(zip(spec, tgroups, strict=True)):
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        if g in wanted and shape[d] % (mesh[data_axis] * math.prod(mesh[a] for a in axes)) == 0:
            new = data_axis if not axes else (*axes, data_axis)
            return (*spec[:d], new, *spec[d + 1 :])
    return None


def state_inputs(graph: Graph) -> dict[str, InputLeaf]:
    """Per output path, the parameter or optimizer-state input it is the new value of: the
    same path but for the position in the step's arguments and results (`[0]['params']`
    in, `[1]['params']` out), where that names one input."""
    state = [leaf for leaf in graph.inputs if leaf.role in (Role.PARAM, Role.OPT_STATE)]
    by_path = {leaf.path: leaf for leaf in state}
    by_tail: dict[str, list[InputLeaf]] = {}
    for leaf in state:
        by_tail.setdefault(_tail(leaf.path), []).append(leaf)
    out = {}
    for leaf in graph.outputs:
        match = [by_path[leaf.path]] if leaf.path in by_path else by_tail.get(_tail(leaf.path), [])
        if len(match) == 1:
            out[leaf.path] = match[0]
    return out


def _same_path(graph: Graph) -> dict[str, InputLeaf]:
    """Per output path, the input leaf with the very same path."""
    by_path = {leaf.path: leaf for leaf in graph.inputs}
    return {leaf.path: by_path[leaf.path] for leaf in graph.outputs if leaf.path in by_path}


def _tail(path: str) -> str:
    """A leaf path without its leading position (`[1]['params']` -> `['params']`)."""
    return _POSITION.sub("", path, count=1)


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


def _dropped(spec: Spec, tg: tuple[int, ...], assignment: Mapping[int, str]) -> bool:
    return any(s is None and g in assignment for s, g in zip(spec, tg, strict=True))


def group_partners(groups: Groups, wanted: set[int]) -> dict[int, set[int]]:
    """For each group in `wanted`, the groups of `wanted` it shares a tensor with: two
    such groups cannot take the same mesh axis."""
    partners: dict[int, set[int]] = {gid: set() for gid in wanted}
    for tensor_groups in groups.tensor_groups:
        present = wanted.intersection(tensor_groups)
        for gid in present:
            partners[gid] |= present - {gid}
    return partners


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
