"""Linkage groups: the union of tensor dimensions tied by the primitives' rules.

Deciding the mesh axis of one group decides every tensor dimension in it, so the search
space is one choice per group rather than one per tensor dimension (the paper's pruning).
Repeated layers give groups of the same signature; they share a `layer_class`, so a coarse
space decides once per class and a fine one per group.

What an assignment {group id: mesh axis or None} of these groups means as tensor layouts
and a `Plan` is `_layouts.py`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping

import numpy as np

from .._graph import Graph, Op, Role
from ._rules import minor_factors, reshape_blocks, rule

_DIGITS = re.compile(r"\d+")


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
    # Reshapes that split the batch into microbatches ([B, ...] -> [M, B/M, ...]) or merge
    # them back (`_microbatch_ties`): the batch goes on with the per-microbatch dim, which
    # the block layout of the input does not give, so the plan pins their results.
    microbatch_splits: tuple[int, ...] = ()

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
    find = union_find(int(offsets[-1]), (tie for ties in flat_ties for tie in ties))
    batch_dims = {(leaf.tensor, 0) for leaf in graph.leaves(Role.BATCH)}
    splits = _microbatch_ties(graph, offsets, flat_ties, find, batch_dims)
    if splits:
        find = union_find(int(offsets[-1]), (tie for ties in flat_ties for tie in ties))
    cuts = _cut_seams(graph, offsets, flat_ties, find, batch_dims) if seams else _Cuts()
    if cuts.batch_flat:  # every part of a cut batch group is a batch group
        batch_dims = {
            (t.id, d)
            for t in graph.tensors
            for d in range(t.ndim)
            if int(offsets[t.id]) + d in cuts.batch_flat
        }
    flat_gid = _group_ids(cuts.find or find, int(offsets[-1]))
    members = _members(graph, offsets, flat_gid)
    groups = _group_fields(
        graph, members, flat_gid, _RuleDims.of(graph, rules, offsets, splits), batch_dims
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
        tuple(sorted(splits)),
    )


def _group_ids(find: Callable[[int], int], n_flat: int) -> np.ndarray:
    """Each flat (tensor, dim)'s group id; ids in order of first (tensor, dim), so that they
    are deterministic."""
    roots = [find(x) for x in range(n_flat)]
    gid_of_root: dict[int, int] = {}
    for r in roots:
        gid_of_root.setdefault(r, len(gid_of_root))
    return np.array([gid_of_root[r] for r in roots], dtype=np.int64)


def _members(
    graph: Graph, offsets: np.ndarray, flat_gid: np.ndarray
) -> list[list[tuple[int, int]]]:
    """Each group's (tensor id, dim) members, sorted."""
    members: list[list[tuple[int, int]]] = [[] for _ in range(int(flat_gid.max(initial=-1)) + 1)]
    for t in graph.tensors:
        for d in range(t.ndim):
            members[flat_gid[offsets[t.id] + d]].append((t.id, d))
    return members


@dataclasses.dataclass(frozen=True)
class _RuleDims:
    """What the ops' rules say of the flat (tensor, dim)s, beyond their ties."""

    reduced: set[int]
    """Dims some op sums over."""
    whole: set[int]
    """Dims a rule keeps whole (conv spatial dims)."""
    resized: list[list[int]]
    """Per op, the dims it resizes (`Rule.resized`: a slice, pad, concatenate or split)."""
    minor: list[tuple[int, int]]
    """(major, minor) dim pairs a reshape merges into one (`minor_factors`)."""
    op_dims: list[list[int]]
    """Per op, every dim of the tensors it reads or writes."""

    @classmethod
    def of(cls, graph: Graph, rules: list, offsets: np.ndarray, splits: set[int]) -> _RuleDims:
        reduced: set[int] = set()
        whole: set[int] = set()
        resized: list[list[int]] = []
        minor: list[tuple[int, int]] = []
        op_dims: list[list[int]] = []
        for op, r in zip(graph.ops, rules, strict=True):
            reduced.update(int(offsets[t]) + d for t, d in r.reduced)
            whole.update(int(offsets[t]) + d for t, d in r.whole)
            resized.append([int(offsets[t]) + d for t, d in r.resized])
            minor += [
                (int(offsets[a[0]]) + a[1], int(offsets[b[0]]) + b[1])
                for a, b in minor_factors(op, graph)
                if op.index not in splits  # the batch goes on with the minor factor
            ]
            touched = [*op.inputs, *op.outputs]
            op_dims.append(
                [int(offsets[t]) + d for t in touched for d in range(graph.tensors[t].ndim)]
            )
        return cls(reduced, whole, resized, minor, op_dims)


def _group_fields(
    graph: Graph,
    members: list[list[tuple[int, int]]],
    flat_gid: np.ndarray,
    dims: _RuleDims,
    batch_dims: set[tuple[int, int]],
) -> list[dict]:
    """Every field of each `Group` but its layer class, as keyword arguments."""
    n = len(members)
    flops = np.zeros(n)
    for op, op_dims in zip(graph.ops, dims.op_dims, strict=True):
        for g in set(flat_gid[op_dims].tolist()):
            flops[g] += op.flops
    reduced = np.zeros(n, dtype=bool)
    reduced[flat_gid[sorted(dims.reduced)]] = True
    whole = np.zeros(n, dtype=bool)
    whole[flat_gid[sorted(dims.whole)]] = True
    # The groups of the dims an op resizes are kept whole (`Rule.resized`), but where one
    # is a batch group: data parallelism is not given up, after a concatenate of two
    # batches either (none in the zoo; XLA's collectives there not measured).
    batch = np.array([any(m in batch_dims for m in mem) for mem in members], dtype=bool)
    for flat in dims.resized:
        gids = flat_gid[flat]
        if not batch[gids].any():
            whole[gids] = True
    whole |= _pinned_minors(graph, members, flat_gid, dims.minor, whole)
    param_path = {leaf.tensor: leaf.path for leaf in graph.leaves(Role.PARAM)}

    # Divisor 1 (never split) for groups of dead tensors (never read, not a step output:
    # a decision without consequence) and groups a rule keeps whole (conv spatial dims,
    # resized dims).
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
                batch=bool(batch[gid]),
                param_dims=tuple((param_path[t], d) for t, d in mem if t in param_path),
                bytes=sum(graph.tensors[t].nbytes for t in set(tensors)),
                flops=float(flops[gid]),
                reduced=bool(reduced[gid]),
            )
        )
    return groups


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
        cut_find = union_find(n, kept)
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


def _microbatch_ties(graph: Graph, offsets, flat_ties, find, batch_dims) -> set[int]:
    """Re-ties, in `flat_ties` (in place), the batch at each reshape that splits it into
    microbatches ([B, ...] -> [M, B/M, ...], gradient accumulation written as a reshape
    and a scan or vmap over M) or merges them back: the reshape rule ties B to the major
    factor M (a block split: `reshape_ties`), but the program goes on with B/M examples
    per trip, so B is tied to that factor and M is a dim of its own. Only a dim of the
    batch leaves' own size counts, so that [B, S] -> [B*S] (batch and sequence merged)
    keeps its tie. Returns the ops re-tied."""
    rows = graph.batch_rows
    roots = {find(int(offsets[t])) for t, d in batch_dims if graph.tensors[t].ndim}
    if rows is None or rows <= 1 or not roots:
        return set()
    found = set()
    for op in graph.ops:
        if op.primitive != "reshape" or op.params.get("dimensions") is not None:
            continue
        (t,), (o,) = op.inputs, op.outputs
        a, b = graph.tensors[t].shape, graph.tensors[o].shape
        for ia, jb in reshape_blocks(a, b):
            for (one, whole, shape), (many, parts, pshape) in (
                ((t, ia, a), (o, jb, b)),
                ((o, jb, b), (t, ia, a)),
            ):
                x = int(offsets[one]) + whole[0]
                if len(whole) != 1 or len(parts) < 2 or shape[whole[0]] != rows:
                    continue
                if find(x) not in roots or pshape[parts[1]] <= 1:
                    continue
                major, minor = int(offsets[many]) + parts[0], int(offsets[many]) + parts[1]
                ties = flat_ties[op.index]
                ties[:] = [(p, q) for p, q in ties if {p, q} != {x, major}] + [(x, minor)]
                found.add(op.index)
    return found


def union_find(n: int, ties) -> Callable[[int], int]:
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


def group_partners(groups: Groups, wanted: set[int]) -> dict[int, set[int]]:
    """For each group in `wanted`, the groups of `wanted` it shares a tensor with: two
    such groups cannot take the same mesh axis."""
    partners: dict[int, set[int]] = {gid: set() for gid in wanted}
    for tensor_groups in groups.tensor_groups:
        present = wanted.intersection(tensor_groups)
        for gid in present:
            partners[gid] |= present - {gid}
    return partners
