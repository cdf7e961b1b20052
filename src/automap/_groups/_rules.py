"""Sharding semantics of each primitive: which tensor dimensions are one logical dimension.

A rule looks at one op and says, in (tensor id, dim) pairs:

- `ties`: an input dim and an output dim (or two input dims) that must be split the same
  way for the op to run locally on its shard (elementwise: every dim; dot_general: batch,
  free and contracting dims; reshape: the major factor of a split or merged dim...);
- `reduced`: input dims the op sums over (dot_general contracting, reduce_sum axes, conv
  input features, the vocabulary of an embedding gather, the scattered rows of a
  scatter-add). Split on a mesh axis they leave each device with a partial result, which
  XLA completes with an all-reduce (or a reduce-scatter when the result is wanted split).

Any input dim neither tied nor reduced must be whole on every device: if it arrives split,
the op first all-gathers it. Dims of size 1 are never tied: they cannot be split, and
tying them would merge unrelated dimensions into one group.

scan, while and cond are priced through their bodies (`Graph.bodies`): two dims of the
loop's operands and results are tied when the body ties them (XLA gives a loop's operands
one layout for every trip: what the body links, the partitioner keeps aligned), and
`body_tensor_groups` tells the cost model which group each body dim belongs to.

Unknown primitives get no ties at all (every operand replicated, the op computed on every
device): conservative, and `Rule.known` is False so the caller can warn once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .._graph import Graph, Op

DimRef = tuple[int, int]  # (tensor id, dim)


@dataclasses.dataclass(frozen=True)
class Rule:
    ties: tuple[tuple[DimRef, DimRef], ...]
    reduced: tuple[DimRef, ...]
    compute: str  # "matmul" (flops), "memory" (bandwidth), "loop" (either) or "free"
    known: bool = True
    # Dims kept whole on every device whatever the plan: the spatial dims of convolutions
    # and pooling windows. XLA can split them with halo exchanges (collective-permutes),
    # which this model does not cost, so their groups are never split.
    whole: tuple[DimRef, ...] = ()
    # Dims a slice, pad, concatenate or split resizes (a rotary embedding's halves of the
    # head dim, and the head dim they make): `build_groups` keeps their groups whole but
    # for the batch. Split, XLA keeps them split through the op with halo exchanges and
    # all-to-alls (collective-permutes of 2.5 shards of a [.., 64] -> 2 x [.., 32] split
    # over 4 chips), not the all-gather of the whole dim an untied reshard prices; and a
    # plan splitting only the halves it leaves whole (no collective where one is priced).
    resized: tuple[DimRef, ...] = ()


# Elementwise primitives: same-shaped operands and results, every dim tied.
ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex
    conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp
    exp2 expm1 floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic
    lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt
    square stop_gradient sub tan tanh xor bitcast_convert_type random_wrap random_unwrap
    random_bits threefry2x32 population_count clz""".split()  # noqa: SIM905
)
# Pure metadata or layout changes XLA does without touching memory (or fuses away).
FREE = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "iota", "stop_gradient"})
REDUCE_SUM_LIKE = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
    }
)
ARG_REDUCE = frozenset({"argmax", "argmin"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
LOOPS = frozenset({"scan", "while", "cond"})
WINDOW = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window"})
#: Ops that cut a dim into pieces or join pieces into one (`Rule.resized`).
RESIZING = frozenset({"slice", "pad", "concatenate", "split"})


def rule(op: Op, graph: Graph) -> Rule:
    """The sharding rule of one op (see the module docstring), made once per op of a
    graph (`Graph.memo`; an op not the graph's own, as a test makes, each time)."""
    if not (op.index < len(graph.ops) and graph.ops[op.index] is op):
        return _rule(op, graph)
    rules = graph.memo.setdefault("rules", {})
    found = rules.get(op.index)
    if found is None:
        found = rules[op.index] = _rule(op, graph)
    return found


def _rule(op: Op, graph: Graph) -> Rule:
    fn = _RULES.get(op.primitive)
    shapes = [graph.tensors[t].shape for t in op.inputs]
    out_shapes = [graph.tensors[t].shape for t in op.outputs]
    if fn is None and op.primitive in ELEMENTWISE:
        fn = _elementwise
    if fn is None or not op.known:
        return Rule((), (), "memory", known=False)
    if op.primitive in LOOPS and op.index in graph.bodies and graph.bodies[op.index]:
        ties, reduced = _loop_ties(op, graph), []
    else:
        ties, reduced = fn(op, shapes, out_shapes)
    ties = tuple((a, b) for a, b in ties if _size(graph, a) > 1 and _size(graph, b) > 1 and a != b)
    reduced = tuple(r for r in reduced if _size(graph, r) > 1)
    if op.primitive in LOOPS:
        compute = "loop"
    elif op.primitive in ("dot_general", "conv_general_dilated"):
        compute = "matmul"
    elif op.primitive in FREE:
        compute = "free"
    else:
        compute = "memory"
    whole: tuple[DimRef, ...] = ()
    if op.primitive == "conv_general_dilated":
        dn = op.params["dimension_numbers"]
        specs = (dn.lhs_spec, dn.rhs_spec, dn.out_spec)
        refs = (op.inputs[0], op.inputs[1], op.outputs[0])
        whole = tuple((t, d) for t, spec in zip(refs, specs, strict=True) for d in spec[2:])
    elif op.primitive in WINDOW or op.primitive.startswith("select_and_"):
        wd, ws = op.params["window_dimensions"], op.params["window_strides"]
        dims = [d for d in range(len(wd)) if wd[d] != 1 or ws[d] != 1]
        whole = tuple(
            (t, d)
            for t in (*op.inputs, *op.outputs)
            for d in dims
            if graph.tensors[t].ndim == len(wd)
        )
    return Rule(ties, reduced, compute, whole=whole, resized=_resized(op, graph))


def _resized(op: Op, graph: Graph) -> tuple[DimRef, ...]:
    """The (tensor, dim)s of a RESIZING op along which its operands and results differ
    in size (`Rule.resized`); () for any other op."""
    if op.primitive not in RESIZING:
        return ()
    refs = [t for t in (*op.inputs, *op.outputs) if graph.tensors[t].ndim]
    ndim = graph.tensors[op.outputs[0]].ndim
    dims = [d for d in range(ndim) if len({graph.tensors[t].shape[d] for t in refs}) > 1]
    return tuple((t, d) for t in refs for d in dims)


def dim_ties(op: Op, graph: Graph) -> list[tuple[DimRef, DimRef]]:
    """(tensor, dim) pairs that are the same logical dimension through this op."""
    return list(rule(op, graph).ties)


def reduced_dims(op: Op, graph: Graph) -> list[DimRef]:
    """Input (tensor, dim)s whose split leaves the op's outputs as partial sums."""
    return list(rule(op, graph).reduced)


# A node of a loop's union-find: (-1, tensor, dim) for the loop's own operands and
# results, (k, tensor, dim) for body k's tensors.
Node = tuple[int, int, int]


def _loop_components(op: Op, graph: Graph) -> dict[Node, Node]:
    """Union-find over the loop's operand/result dims and its bodies' dims, tied by the
    bodies' own rules (nested loops through theirs) and by the binds at the boundary.
    Returns each node's root."""
    parent: dict[Node, Node] = {}

    def find(x: Node) -> Node:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: Node, b: Node) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for k, body in enumerate(graph.bodies[op.index]):
        bg = body.graph
        for bop in bg.ops:
            for (t1, d1), (t2, d2) in rule(bop, bg).ties:
                union((k, t1, d1), (k, t2, d2))
        for outer, inner, offset in body.binds:
            oshape, ishape = graph.tensors[outer].shape, bg.tensors[inner].shape
            for d, size in enumerate(ishape):
                if size > 1 and d + offset < len(oshape) and oshape[d + offset] == size:
                    union((-1, outer, d + offset), (k, inner, d))
    return {x: find(x) for x in list(parent)}


def _loop_ties(op: Op, graph: Graph) -> Ties:
    """Ties between the loop's own operand and result dims that its bodies link."""
    first: dict[Node, DimRef] = {}
    ties: Ties = []
    own = set(op.inputs) | set(op.outputs)
    for node, root in _loop_components(op, graph).items():
        k, t, d = node
        if k != -1 or t not in own:
            continue
        if root in first:
            ties.append((first[root], (t, d)))
        else:
            first[root] = (t, d)
    return ties


def body_tensor_groups(
    op: Op, graph: Graph, tensor_groups: Sequence[Sequence[int]], none: int
) -> list[tuple[tuple[int, ...], ...]]:
    """For each body of a loop op, the group of every dim of every body tensor: the group
    of a loop operand or result dim it is linked to, or `none` (a dim that lives only
    inside the body, which no plan decides: XLA keeps it as propagation leaves it, and
    it is priced unsplit)."""
    comps = _loop_components(op, graph)
    root_group: dict[Node, int] = {}
    for node, root in comps.items():
        if node[0] == -1 and root not in root_group:
            root_group[root] = tensor_groups[node[1]][node[2]]
    out = []
    for k, body in enumerate(graph.bodies[op.index]):
        out.append(
            tuple(
                tuple(
                    root_group.get(comps.get((k, t.id, d), (k, t.id, d)), none)
                    for d in range(t.ndim)
                )
                for t in body.graph.tensors
            )
        )
    return out


def _size(graph: Graph, ref: DimRef) -> int:
    return graph.tensors[ref[0]].shape[ref[1]]


# ---- the rules: each returns (ties, reduced) in (tensor, dim) terms ----------------------
# Arguments: the op, input shapes and output shapes (shapes are enough; ids come from op).

Ties = list[tuple[DimRef, DimRef]]


def _elementwise(op: Op, shapes: Sequence, outs: Sequence) -> tuple[Ties, list]:
    # Scalars (rank 0, e.g. select_n's predicate or clamp's bounds) and size-1 dims
    # (jax 0.10 lets `eq` take (32, 1) and (1, 16) operands) broadcast implicitly.
    ties: Ties = []
    for o, oshape in zip(op.outputs, outs, strict=False):
        for t, shape in zip(op.inputs, shapes, strict=False):
            if len(shape) == len(oshape):
                ties += [((t, d), (o, d)) for d in range(len(shape)) if shape[d] == oshape[d]]
    return ties, []


def _dot_general(op: Op, shapes: Sequence, outs: Sequence) -> tuple[Ties, list]:
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs, out = op.inputs[0], op.inputs[1], op.outputs[0]
    ties: Ties = []
    for i, (a, b) in enumerate(zip(lb, rb, strict=False)):
        ties += [((lhs, a), (out, i)), ((rhs, b), (out, i))]
    for a, b in zip(lc, rc, strict=False):
        ties.append(((lhs, a), (rhs, b)))
    k = len(lb)
    for d in range(len(shapes[0])):
        if d not in lc and d not in lb:
            ties.append(((lhs, d), (out, k)))
            k += 1
    for d in range(len(shapes[1])):
        if d not in rc and d not in rb:
            ties.append(((rhs, d), (out, k)))
            k += 1
    return ties, [(lhs, a) for a in lc] + [(rhs, b) for b in rc]


def _conv(op: Op, shapes: Sequence, outs: Sequence) -> tuple[Ties, list]:
    dn = op.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs, out = op.inputs[0], op.inputs[1], op.outputs[0]
    ties: Ties = [((rhs, rhs_spec[0]), (out, out_spec[1]))]  # output features
    reduced: list = []
    if op.params.get("batch_group_count", 1) == 1:
        ties.append(((lhs, lhs_spec[0]), (out, out_spec[0])))
    if op.params.get("feature_group_count", 1) == 1:
        # Input features are contracted: a split leaves partial sums (the weight gradient
        # conv contracts over the batch this way, hence the data-parallel all-reduce).
        ties.append(((lhs, lhs_spec[1]), (rhs, rhs_spec[1])))
        reduced = [(lhs, lhs_spec[1]), (rhs, rhs_spec[1])]
    # Spatial dims are left untied: splitting them needs halo exchanges we do not model.
    return ties, reduced


def _reduce(op: Op, shapes: Sequence, outs: Sequence) -> tuple[Ties, list]:
    axes = tuple(op.params["axes"])
    (t,), o = op.inputs[:1], op.outputs[0]
    kept = [d for d in range(len(shapes[0])) if d not in axes]
    ties = [((t, d), (o, i)) for i, d in enumerate(kept)]
    if op.primitive in ARG_REDUCE:
        return ties, []  # an argmax over shards is not a sum: the axis must be whole
    return ties, [(t, a) for a in axes]


def _all_but(op: Op, shapes: Sequence, outs: Sequence, axis: int) -> Ties:
    ties: Ties = []
    for t, shape in zip(op.inputs, shapes, strict=False):
        for o, oshape in zip(op.outputs, outs, strict=False):
            if len(shape) == len(oshape):
                ties += [((t, d), (o, d)) for d in range(len(shape)) if d != axis]
    return ties


def _all_but_param(name: str | None):
    """Rule tying every dim but the one named by param `name` (None: the last dim)."""

    def fn(op, shapes, outs):
        axis = len(shapes[0]) - 1 if name is None else op.params[name]
        return _all_but(op, shapes, outs, axis), []

    return fn


def _same_size_dims(src: int, dst: int, sshape, dshape, dims) -> Ties:
    """Tie dim d of src to dim d of dst for each d in dims where the sizes agree."""
    return [((src, d), (dst, d)) for d in dims if sshape[d] == dshape[d]]


def _broadcast_in_dim(op, shapes, outs):
    t, o = op.inputs[0], op.outputs[0]
    bd = op.params["broadcast_dimensions"]
    return [((t, i), (o, int(d))) for i, d in enumerate(bd) if shapes[0][i] == outs[0][d]], []


def _transpose(op, shapes, outs):
    t, o = op.inputs[0], op.outputs[0]
    return [((t, int(p)), (o, i)) for i, p in enumerate(op.params["permutation"])], []


def _squeeze(op, shapes, outs):
    t, o = op.inputs[0], op.outputs[0]
    dims = {d % len(shapes[0]) for d in op.params["dimensions"]}
    kept = [d for d in range(len(shapes[0])) if d not in dims]
    return [((t, d), (o, i)) for i, d in enumerate(kept)], []


def _reshape(op, shapes, outs):
    t, o = op.inputs[0], op.outputs[0]
    if op.params.get("dimensions") is not None:
        return [], []  # reshape with a transpose folded in: rare, stay conservative
    return [((t, a), (o, b)) for a, b in reshape_ties(shapes[0], outs[0])], []


def reshape_ties(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """Dim pairs a reshape keeps: walk both shapes in blocks of equal product and tie the
    major (first, non-1) dims of each block. Splitting hidden into heads x head_dim ties
    hidden to heads: a block split of hidden on k devices is a split of heads on k."""
    return [(ia[0], jb[0]) for ia, jb in reshape_blocks(src, dst)]


def reshape_blocks(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list, list]]:
    """The blocks of equal product (source dims, destination dims), size-1 dims left out."""
    a = [d for d in range(len(src)) if src[d] != 1]
    b = [d for d in range(len(dst)) if dst[d] != 1]
    blocks: list[tuple[list, list]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ia, jb = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= src[a[i]]
                ia.append(a[i])
                i += 1
            elif pb < pa and j < len(b):
                pb *= dst[b[j]]
                jb.append(b[j])
                j += 1
            else:
                return blocks  # shapes do not line up (cannot happen for a valid reshape)
        blocks.append((ia, jb))
    return blocks


def minor_factors(op: Op, graph: Graph) -> list[tuple[DimRef, DimRef]]:
    """(major, minor) dims a reshape merges into one (heads, head_dim -> hidden). With both
    split, XLA keeps the merged dim split on both axes, which one axis per group cannot
    express: `build_groups` keeps such minor dims whole when their major can be split."""
    if op.primitive != "reshape" or op.params.get("dimensions") is not None:
        return []
    t, o = op.inputs[0], op.outputs[0]
    out = []
    for ia, jb in reshape_blocks(graph.tensors[t].shape, graph.tensors[o].shape):
        out += [((t, ia[0]), (t, d)) for d in ia[1:]] + [((o, jb[0]), (o, d)) for d in jb[1:]]
    return out


def _pad(op, shapes, outs):
    t, o = op.inputs[0], op.outputs[0]
    cfg = op.params["padding_config"]
    dims = [d for d, (lo, hi, it) in enumerate(cfg) if (lo, hi, it) == (0, 0, 0)]
    return [((t, d), (o, d)) for d in dims], []


def _slice(op, shapes, outs):
    t, o = op.inputs[0], op.outputs[0]
    return _same_size_dims(t, o, shapes[0], outs[0], range(len(shapes[0]))), []


def _dynamic_update_slice(op, shapes, outs):
    t, u, o = op.inputs[0], op.inputs[1], op.outputs[0]
    ties = [((t, d), (o, d)) for d in range(len(shapes[0]))]
    ties += _same_size_dims(u, o, shapes[1], outs[0], range(len(shapes[1])))
    return ties, []


def _gather(op, shapes, outs):
    dn = op.params["dimension_numbers"]
    operand, idx, o = op.inputs[0], op.inputs[1], op.outputs[0]
    oshape, ishape, out = shapes[0], shapes[1], outs[0]
    slice_sizes = op.params["slice_sizes"]
    offset_dims = tuple(dn.offset_dims)
    skip = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    window = [d for d in range(len(oshape)) if d not in skip]
    ties: Ties = [
        ((operand, d), (o, od))
        for d, od in zip(window, offset_dims, strict=False)
        if slice_sizes[d] == oshape[d]
    ]
    # The output's other dims are the index array's dims but its last (the index vector).
    batch_out = [d for d in range(len(out)) if d not in offset_dims]
    idx_dims = list(range(len(ishape) - 1))
    ties += [((idx, i), (o, od)) for i, od in zip(idx_dims, batch_out, strict=False)]
    for od_, id_ in zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=False):
        ties.append(((operand, od_), (idx, id_)))
    # Gathering rows of a split table (a vocabulary-parallel embedding): each device reads
    # the rows it holds, zeros elsewhere, and an all-reduce adds the pieces.
    reduced = [(operand, d) for d in dn.start_index_map if d not in dn.operand_batching_dims]
    return ties, reduced


def _scatter(op, shapes, outs):
    dn = op.params["dimension_numbers"]
    operand, idx, upd, o = op.inputs[0], op.inputs[1], op.inputs[2], op.outputs[0]
    oshape, ishape, ushape = shapes[0], shapes[1], shapes[2]
    ties: Ties = [((operand, d), (o, d)) for d in range(len(oshape))]
    skip = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    window = [d for d in range(len(oshape)) if d not in skip]
    uwd = tuple(dn.update_window_dims)
    ties += [
        ((upd, ud), (o, d)) for d, ud in zip(window, uwd, strict=False) if ushape[ud] == oshape[d]
    ]
    scatter_dims = [d for d in range(len(ushape)) if d not in uwd]
    ties += [
        ((upd, ud), (idx, i)) for i, ud in zip(range(len(ishape) - 1), scatter_dims, strict=False)
    ]
    for od_, id_ in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims, strict=False):
        ties.append(((operand, od_), (idx, id_)))
    batching_idx = set(dn.scatter_indices_batching_dims)
    rows = [ud for i, ud in enumerate(scatter_dims) if i not in batching_idx]
    if op.primitive in ("scatter-add", "scatter_add"):
        # Rows scattered from a split update (an embedding gradient over a split batch)
        # each add into a full table: partial sums.
        return ties, [(upd, ud) for ud in rows]
    return ties, []


def _window(op, shapes, outs):
    # Pooling: dims with a unit window and stride (batch, channels) pass through.
    wd, ws = op.params["window_dimensions"], op.params["window_strides"]
    dims = [d for d in range(len(wd)) if wd[d] == 1 and ws[d] == 1]
    ties: Ties = []
    for t, shape in zip(op.inputs, shapes, strict=False):
        if len(shape) == len(outs[0]):
            ties += [((t, d), (op.outputs[0], d)) for d in dims]
    return ties, []


def _rev(op, shapes, outs):
    t, o = op.inputs[0], op.outputs[0]
    rev = set(op.params["dimensions"])
    return [((t, d), (o, d)) for d in range(len(shapes[0])) if d not in rev], []


def _positional(op, shapes, outs):
    # optimization_barrier: input i is output i.
    ties: Ties = []
    for t, o, shape in zip(op.inputs, op.outputs, shapes, strict=False):
        ties += [((t, d), (o, d)) for d in range(len(shape))]
    return ties, []


def _no_ties(op, shapes, outs):
    return [], []


_RULES = {
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "concatenate": _all_but_param("dimension"),
    "split": _all_but_param("axis"),
    "pad": _pad,
    "slice": _slice,
    "dynamic_slice": _slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "gather": _gather,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter": _scatter,
    "select_and_scatter_add": _window,
    "select_and_gather_add": _window,
    "sort": _all_but_param("dimension"),
    "top_k": _all_but_param(None),
    "rev": _rev,
    "optimization_barrier": _positional,
    "iota": _no_ties,
    # Loops and conditionals: tied through their bodies (`_loop_ties`) when capture kept
    # them (`Graph.bodies`); without bodies every operand is taken whole (replicated).
    **{p: _no_ties for p in ("scan", "while", "cond")},
    "rng_bit_generator": _no_ties,
    "rng_uniform": _no_ties,
    **{p: _reduce for p in REDUCE_SUM_LIKE | ARG_REDUCE},
    **{p: _all_but_param("axis") for p in CUMULATIVE},
    **{p: _window for p in WINDOW},
}
KNOWN_PRIMITIVES = frozenset(_RULES) | ELEMENTWISE
