"""Are a sharded step's outputs the unsharded step's, up to float reassociation?

Sharding changes the order of additions (a sum split over devices, then all-reduced), so
outputs differ in the last bits. Which bits differ is a rounding outcome: it changes with
the CPU (AVX2 or AVX-512 kernels block their sums differently), the plan and the data. So
no verdict may hang on one: every tolerance below is set by the structure of the step
(the roles of its inputs, the dtypes it computes in, which outputs are computed alike),
with margins no reordering reaches, and each term says what it is for:

- Rounding of the output's own dtype: ROUNDING_ULPS x eps(dtype) x |want|, elementwise.
  Two orders may round a result to neighbouring values of its dtype (a bf16 output's last
  bit, a float32 parameter's `old + update`).
- A floor relative to the leaf's *family*: `Rounding.floor` x the family's largest
  magnitude. A family is the leaves the step computes by the same formula for every
  parameter (all of Adam's `[2][0].nu[...]`, all new parameters): an output path that
  ends with a parameter's path (past what all parameters share, e.g. `['params']`) and
  has its shape belongs to the family of what comes before that suffix; any other leaf
  (the loss) is its own family. Per-parameter optimizer state is grouped by what the step
  does with it instead (`_state_families`): the state leaves that feed a parameter's new
  value, in output order, are its first moment, its second..., whatever their paths
  (Keras's optimizer variables are one flat list). The floor is relative to the family, not the leaf,
  because a leaf whose exact value is ~0 (the gradient of an attention key bias, which
  softmax ignores, and its Adam moments of ~1e-21) is a sum of terms of the family's
  size that cancel: its rounding is the family's, not its own. The floor's relative
  size is read from the captured program's sums (dot_general, conv, reduce_sum...) and
  has two parts. RESULT_ULPS x the widest machine epsilon of the dtypes they produce: a
  split sum rounds its partial sums and their total to that dtype, 2^-7 in bf16 where
  float32 rounds at 2^-23. And SUM_ULPS x the accumulators' epsilon (float32's: XLA
  sums 16-bit floats in float32) x sqrt(the most terms one sum adds): a long float32
  sum blocked differently (another split, or AVX2 against AVX-512 kernels) rounds
  differently, growing like a random walk.
- Parameters (an output leaf paired with an input leaf whose capture role is parameter:
  the same path past the argument or output index, shape and dtype; optimizer state is
  not a parameter) are compared on their update, new - old, whose family is all
  parameters' updates. When the step carries per-parameter optimizer state (optimizer-
  state inputs with the parameters' shapes: Adam's mu and nu, momentum's trace), the
  update may also flip: FLIP x the leaf's largest update. Adam's update m / (sqrt(v) + eps)
  is about +-lr whatever the gradient's size, so a gradient that is rounding (true value
  0) moves its parameter by +-lr either way; an update's sign may flip, its size may not
  grow. The allowance is safe because that state is itself held to the tight rules above:
  a wrong gradient shows in the moments (and the loss) whatever the parameters do. A plain
  SGD step (no per-parameter state) never gets it: its update is lr x gradient.
- The measured noise: `reordered` runs the unsharded step once more with its inputs
  split over a few devices (the same mathematics summed in another order); a leaf's
  tolerance is never below NOISE_FACTOR x that run's largest error on it. The run can
  only widen a tolerance, never decide whether a rule applies.

Non-finite values: a NaN or inf where the reference has the same passes; a NaN where the
reference has a number (or a number where it has a NaN) fails, with an error of inf.
Complex outputs are compared on the magnitude of the difference; integer and bool
outputs exactly. The verdict names the first leaf out of tolerance with its own largest
error (or, when all pass, the leaf of the largest error).

Real mistakes stay far outside: a dropped gradient all-reduce leaves the moments of the
local share of the batch (off by O(1) of their family), a gradient reduced twice is off
by the mesh-axis size, a lost microbatch by its share, swapped shards by the parameters'
own size, and the loss off outright.

Without the step's captured program (`graph`), roles and compute dtypes are unknown: a
fixed tolerance is used (RTOL, and ATOL plus ATOL_SCALE of the leaf's scale), meant for
comparing two runs of one plan, not for verifying a plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._graph import Graph, Role

#: Elementwise rounding of an output's own dtype: a result may land on a neighbouring
#: value, or two (the update added to a parameter, then rounded).
ROUNDING_ULPS = 4.0
#: The family floor (`Rounding.floor`): RESULT_ULPS machine epsilons of the dtype the
#: step's sums produce, plus SUM_ULPS of its accumulators' times sqrt(terms per sum).
#: Measured over the 48 expert plans of mlp and small bert-base and gpt2-xl at float32
#: and bf16 (AVX2 kernels, no reordered run): reordering used at most 0.09 of the floor
#: in float32 and 0.21 in bf16; the mistakes in tests/test_numerics.py all fail.
RESULT_ULPS = 16.0
SUM_ULPS = 4.0
#: How much noisier the plan's order may be than the reordered run's (measured up to 3x in
#: bf16), and how many of its largest updates a flipped parameter may move (+lr to -lr).
NOISE_FACTOR = 8.0
FLIP = 2.0
#: How many tensors past an optimizer-state output `_state_families` looks for the
#: parameter it updates (Adam's bias correction and update take a dozen).
REACH = 2000

#: Without the step's program: a fixed tolerance (see the module doc).
RTOL = 2e-4
ATOL = 2e-5
ATOL_SCALE = 5e-3  # of the leaf's largest magnitude

#: Primitives whose results are sums, and so depend on the order of their additions.
SUMS = frozenset(
    {
        "dot_general",
        "conv_general_dilated",
        "reduce_sum",
        "reduce",
        "cumsum",
        "psum",
        "reduce_window_sum",
        "ragged_dot",
    }
)


class Comparison(NamedTuple):
    """The verdict: all leaves within tolerance; the largest absolute error of the leaf
    named (the first leaf out of tolerance, else the leaf of the largest error)."""

    equal: bool
    max_abs_err: float
    leaf: str


class _Leaf(NamedTuple):
    path: str
    got: np.ndarray
    want: np.ndarray
    noise: np.ndarray | None
    prior: np.ndarray | None  # the parameter before the step (None: not a parameter)
    family: str
    eps: float  # machine epsilon of the output's own dtype; 0 for integers and bools (exact)


def compare_outputs(
    got: Any, want: Any, *, graph: Graph | None = None, before: Any = None, noise: Any = None
) -> Comparison:
    """`got` (the sharded step's outputs) against `want` (the unsharded step's).

    `graph`: the step captured (`capture`), for its input roles and compute dtypes;
    `before`: the step's arguments, so that parameters are compared on their update;
    `noise`: the unsharded step run in another order (`reordered`), which may widen a
    tolerance. See the module doc for the rules."""
    prepared = _prepare(got, want, graph, before, noise)
    if isinstance(prepared, Comparison):
        return prepared
    return _verdict(*prepared)


def margins(
    got: Any, want: Any, *, graph: Graph | None = None, before: Any = None, noise: Any = None
) -> dict[str, tuple[float, float]]:
    """Per floating output leaf, (its largest error, the tolerance at that element), by
    the rules `compare_outputs` applies: how close each leaf came to being called
    different (a benchmark's table, a false alarm's diagnosis). Empty when the outputs'
    structures or shapes differ."""
    prepared = _prepare(got, want, graph, before, noise)
    if isinstance(prepared, Comparison):
        return {}
    leaves, tolerance = prepared
    out = {}
    for leaf in leaves:
        if leaf.eps and leaf.want.size:
            err = _errors(leaf.got, leaf.want)
            tol = np.broadcast_to(tolerance(leaf), err.shape)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(tol > 0, err / tol, np.where(err > 0, np.inf, 0.0))
            k = np.unravel_index(int(np.argmax(ratio)), err.shape)
            out[leaf.path] = (float(err[k]), float(tol[k]))
    return out


def _prepare(got: Any, want: Any, graph: Any, before: Any, noise: Any) -> Any:
    """The output leaves and their tolerance rule, or the Comparison that fails outputs
    whose structure or shapes differ."""
    import jax

    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    if got_tree != want_tree:
        return Comparison(False, float("inf"), "output structure differs")
    for (path, g), w in zip(got_leaves, want_leaves, strict=True):
        if np.shape(g) != np.shape(w):
            return Comparison(False, float("inf"), f"{jax.tree_util.keystr(path)}: shape differs")
    noisy = _leaves_like(noise, want_tree) or [None] * len(want_leaves)
    if graph is None:
        leaves = [
            _leaf(jax.tree_util.keystr(p), g, w, n, None, "")
            for (p, g), w, n in zip(got_leaves, want_leaves, noisy, strict=True)
        ]
        return leaves, _fixed_tolerance
    context = _Context.of(graph, before, [p for p, _ in got_leaves], want_leaves)
    leaves = [
        _leaf(jax.tree_util.keystr(p), g, w, n, prior, family)
        for (p, g), w, n, prior, family in zip(
            got_leaves, want_leaves, noisy, context.priors, context.families, strict=True
        )
    ]
    scales = _family_scales(leaves)

    def tolerance(leaf: _Leaf) -> np.ndarray:
        return _tolerance(leaf, scales[leaf.family], context)

    return leaves, tolerance


def reordered(fn: Any, args: Sequence[Any], devices: Sequence[Any]) -> Any:
    """`fn(*args)` with every input split on its first dimension the devices divide:
    the unsharded mathematics, summed in another order. None with fewer than two devices,
    or when the program will not run split (then no measured noise widens a tolerance)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(devices) < 2:
        return None
    mesh = Mesh(np.array(list(devices)), ("reorder",))

    def split(x: Any) -> NamedSharding:
        dims = [d for d, size in enumerate(np.shape(x)) if size % len(devices) == 0]
        spec = [None] * (dims[0] + 1) if dims else []
        if dims:
            spec[dims[0]] = "reorder"
        return NamedSharding(mesh, PartitionSpec(*spec))

    try:
        placed = jax.device_put(tuple(args), jax.tree_util.tree_map(split, tuple(args)))
        return jax.device_get(jax.jit(fn)(*placed))
    except Exception:  # any failure only means no noise measurement: the rules still apply
        return None


class Rounding(NamedTuple):
    """How finely a step's sums round, read from its captured program (`step_rounding`)."""

    result_eps: float  # the widest machine epsilon among the dtypes its sums produce
    sum_eps: float  # its accumulators': float32's (XLA sums 16-bit floats in it), or finer
    terms: int  # the most terms one output element of one sum adds

    @property
    def floor(self) -> float:
        """A family's floor, relative to its scale: a sum's result rounded to its dtype
        (a partial sum of a split, then the total), and the accumulation's own rounding,
        which grows like the square root of the number of terms."""
        return RESULT_ULPS * self.result_eps + SUM_ULPS * self.sum_eps * math.sqrt(self.terms)


def step_rounding(graph: Graph) -> Rounding:
    """The `Rounding` of the step: its sums (dot_general, conv, reduce_sum..., loop bodies
    included); a step without any sum rounds as its widest floating dtype."""
    dtypes, terms = _sums(graph)
    if not dtypes:
        dtypes = {t.dtype for t in graph.tensors}
    eps = [float(np.finfo(_np_dtype(d)).eps) for d in dtypes if _is_float_name(d)]
    result = max(eps, default=float(np.finfo(np.float32).eps))
    accumulation = min(result, float(np.finfo(np.float32).eps))
    return Rounding(result, accumulation, max(terms, 1))


class _Context(NamedTuple):
    """What the step's structure says of each output leaf."""

    priors: list[np.ndarray | None]  # a parameter's value before the step
    families: list[str]
    rounding: Rounding
    flips: bool  # the step carries per-parameter optimizer state

    @classmethod
    def of(cls, graph: Graph, before: Any, out_paths: list[tuple], want: list[Any]) -> _Context:
        import jax

        roles = {leaf.path: leaf.role for leaf in graph.inputs}
        ins = jax.tree_util.tree_flatten_with_path(before)[0] if before is not None else []
        in_rows = [(_entries(p), np.shape(x), _dtype(x)) for p, x in ins]
        out_rows = [
            (_entries(p), np.shape(w), _dtype(w)) for p, w in zip(out_paths, want, strict=True)
        ]
        in_roles = [roles.get("".join(e)) for e, _, _ in in_rows]
        pairs = _pair(out_rows, in_rows)
        priors = [
            np.asarray(ins[pairs[k]][1], np.float64)
            if k in pairs and in_roles[pairs[k]] == Role.PARAM and _is_float_name(out_rows[k][2])
            else None
            for k in range(len(out_rows))
        ]
        params = [row for row, role in zip(in_rows, in_roles, strict=True) if role == Role.PARAM]
        shapes = {shape for _, shape, _ in params if shape}
        flips = any(
            role == Role.OPT_STATE and _is_float_name(dtype) and shape in shapes
            for (_, shape, dtype), role in zip(in_rows, in_roles, strict=True)
        )
        suffixes = _param_suffixes(params)
        families = [_family(e, shape, suffixes) for e, shape, _ in out_rows]
        state = [
            k
            for k in range(len(out_rows))
            if k in pairs
            and in_roles[pairs[k]] == Role.OPT_STATE
            and out_rows[k][1] in shapes
            and _is_float_name(out_rows[k][2])
        ]
        paths = ["".join(e) for e, _, _ in out_rows]
        params_out = [k for k, prior in enumerate(priors) if prior is not None]
        for k, family in _state_families(graph, paths, state, params_out).items():
            families[k] = family
        return cls(priors, families, step_rounding(graph), flips)


def _state_families(
    graph: Graph, paths: list[str], state: list[int], params: list[int]
) -> dict[int, str]:
    """Output index -> family of per-parameter optimizer state, by what the step does with
    it: a state leaf (Adam's new mu or nu) feeds the new value of one parameter, and
    the state leaves of each parameter, in output order, are its first moment, its second...
    Paths cannot say so where the state is a flat list: Keras's optimizer variables are
    `[iterations, lr, m_0, v_0, m_1, v_1, ...]`, and `[3][13]` (v of the key bias) shares
    nothing with its parameter `[0][5]` but a shape. Alone in its family, a moment whose
    true value is 0 (~1e-21, sums of terms that cancel) was held to its own size."""
    tensor_of = {leaf.path: leaf.tensor for leaf in graph.outputs}
    param_of = {tensor_of[paths[k]]: k for k in params if paths[k] in tensor_of}
    outputs = set(tensor_of.values())
    consumers = graph.consumers()
    feeds: dict[int, list[int]] = {}
    for k in state:
        if paths[k] not in tensor_of:
            continue
        reached = _reached(graph, tensor_of[paths[k]], outputs, consumers) & param_of.keys()
        if len(reached) == 1:
            feeds.setdefault(param_of[reached.pop()], []).append(k)
    return {
        k: f"{paths[k].split(']')[0]}] state {rank}"
        for ks in feeds.values()
        for rank, k in enumerate(ks)
    }


def _reached(graph: Graph, start: int, outputs: set[int], consumers: Any) -> set[int]:
    """The step's output tensors computed from `start` (not past another output): a
    moment's reach is its parameter's update. Bounded: a state leaf the whole step reads
    on (more than REACH tensors away) is given no parameter."""
    seen, todo, found = {start}, [start], set()
    while todo and len(seen) <= REACH:
        for op in consumers[todo.pop()]:
            for t in graph.ops[op].outputs:
                if t in seen:
                    continue
                seen.add(t)
                if t in outputs:
                    found.add(t)
                else:
                    todo.append(t)
    return found if not todo else set()


def _tolerance(leaf: _Leaf, scale: float, context: _Context) -> np.ndarray:
    want = _finite(leaf.want)
    rounding = ROUNDING_ULPS * leaf.eps * np.abs(want)
    tol = rounding + context.rounding.floor * scale
    if leaf.prior is not None and context.flips:
        tol = tol + FLIP * float(np.max(np.abs(want - _finite(leaf.prior)), initial=0.0))
    if leaf.noise is not None:
        tol = np.maximum(tol, NOISE_FACTOR * _largest(_errors(leaf.noise, leaf.want)))
    return tol


def _fixed_tolerance(leaf: _Leaf) -> np.ndarray:
    want = np.abs(_finite(leaf.want))
    tol = ATOL + ATOL_SCALE * float(np.max(want, initial=0.0)) + RTOL * want
    if leaf.noise is not None:
        tol = np.maximum(tol, NOISE_FACTOR * _largest(_errors(leaf.noise, leaf.want)))
    return tol


def _verdict(leaves: list[_Leaf], tolerance: Any) -> Comparison:
    worst, worst_path, failed = 0.0, "", None
    for leaf in leaves:
        if not leaf.want.size:
            continue
        err = _errors(leaf.got, leaf.want)
        ok = bool(np.all(err == 0)) if not leaf.eps else bool(np.all(err <= tolerance(leaf)))
        largest = float(np.max(err))
        if not ok and failed is None:
            failed = Comparison(False, largest, leaf.path)
        if largest > worst or not worst_path:
            worst, worst_path = largest, leaf.path
    return failed or Comparison(True, worst, worst_path)


def _errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| elementwise; equal non-finite values (NaN and NaN, inf and inf) are 0
    apart, a non-finite value against anything else is inf apart."""
    both = ~np.isfinite(got) & ~np.isfinite(want)
    same = both & ((np.isnan(got) & np.isnan(want)) | (got == want))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(got - want).astype(np.float64)
    return np.where(same, 0.0, np.where(np.isfinite(err), err, np.inf))


def _largest(err: np.ndarray) -> float:
    finite = err[np.isfinite(err)]
    return float(finite.max()) if finite.size else 0.0


def _family_scales(leaves: list[_Leaf]) -> dict[str, float]:
    """Per family, the largest magnitude of what is compared (a parameter's update)."""
    scales: dict[str, float] = {}
    for leaf in leaves:
        if not leaf.eps or not leaf.want.size:
            continue
        value = leaf.want if leaf.prior is None else leaf.want - leaf.prior
        size = float(np.max(np.abs(_finite(value)), initial=0.0))
        scales[leaf.family] = max(scales.get(leaf.family, 0.0), size)
    return scales


def _pair(outs: list[tuple], ins: list[tuple]) -> dict[int, int]:
    """Output leaf index -> input leaf index of the same value before the step.

    First whole items: an output item (what follows the output index) pairs with the one
    argument whose leaves have the same paths, shapes and dtypes (Keras's lists pair
    as lists, where `[1][3]` alone would also match the optimizer's `[3][3]`). Leaves left
    over pair by path past the index, shape and dtype, where that is unique both ways."""
    out_items, in_items = _items(outs), _items(ins)
    signatures: dict[tuple, list[Any]] = {}
    for head, rows in in_items.items():
        signatures.setdefault(_signature(ins, rows), []).append(head)
    pairs: dict[int, int] = {}
    claimed: dict[Any, int] = {}
    for rows in out_items.values():
        heads = signatures.get(_signature(outs, rows), [])
        if len(heads) == 1:
            claimed[heads[0]] = claimed.get(heads[0], 0) + 1
    for rows in out_items.values():
        heads = signatures.get(_signature(outs, rows), [])
        if len(heads) == 1 and claimed[heads[0]] == 1:
            pairs.update(zip(rows, in_items[heads[0]], strict=True))
    used = set(pairs.values())
    left_in = _unique_keys([k for k in range(len(ins)) if k not in used], ins)
    left_out = _unique_keys([k for k in range(len(outs)) if k not in pairs], outs)
    pairs.update({k: left_in[key] for key, k in left_out.items() if key in left_in})
    return pairs


def _items(rows: list[tuple]) -> dict[str, list[int]]:
    items: dict[str, list[int]] = {}
    for k, (entries, _, _) in enumerate(rows):
        if entries:
            items.setdefault(entries[0], []).append(k)
    return items


def _signature(rows: list[tuple], ks: list[int]) -> tuple:
    return tuple((rows[k][0][1:], rows[k][1], rows[k][2]) for k in ks)


def _unique_keys(ks: list[int], rows: list[tuple]) -> dict[tuple, int]:
    seen: dict[tuple, int | None] = {}
    for k in ks:
        entries, shape, dtype = rows[k]
        key = (entries[1:], shape, dtype)
        seen[key] = None if key in seen else k
    return {key: k for key, k in seen.items() if k is not None}


def _param_suffixes(params: list[tuple]) -> dict[tuple, tuple]:
    """Each parameter's path past its argument index and past what every parameter's
    path shares (`['params']`), at least its last entry, with its shape."""
    rel = [entries[1:] for entries, _, _ in params if len(entries) > 1]
    if not rel:
        return {}
    common = 0
    while all(len(r) > common + 1 and r[common] == rel[0][common] for r in rel):
        common += 1
    return {entries[1:][common:]: shape for entries, shape, _ in params if len(entries) > 1}


def _family(entries: tuple, shape: tuple, suffixes: dict[tuple, tuple]) -> str:
    """What comes before the longest parameter suffix the path ends with (that parameter's
    shape); the whole path when none."""
    for k in range(1, len(entries)):
        if suffixes.get(entries[k:]) == shape:
            return "".join(entries[:k])
    return "".join(entries)


def _entries(path: tuple) -> tuple[str, ...]:
    import jax

    return tuple(jax.tree_util.keystr((key,)) for key in path)


def _leaf(path: str, g: Any, w: Any, n: Any, prior: Any, family: str) -> _Leaf:
    """One output leaf as float64 (complex128) copies, its dtype's epsilon kept; a typed
    PRNG key as its key data (compared exactly)."""
    g, w, n = (_key_data(x) for x in (g, w, n))
    dtype = _dtype(w)
    kind = np.complex128 if "complex" in dtype else np.float64
    noise = None if n is None or np.shape(n) != np.shape(w) else np.asarray(n, kind)
    eps = float(np.finfo(_np_dtype(dtype)).eps) if _is_float_name(dtype) else 0.0
    return _Leaf(path, np.asarray(g, kind), np.asarray(w, kind), noise, prior, family, eps)


def _key_data(x: Any) -> Any:
    """A typed PRNG key array's integers (numpy cannot hold the key dtype); else `x`."""
    import jax

    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def _finite(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), x, 0)


def _dtype(x: Any) -> str:
    return str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def _is_float_name(name: str) -> bool:
    return "float" in name or "complex" in name


def _np_dtype(name: str) -> Any:
    import jax.numpy as jnp

    return jnp.dtype(name)


def _sums(graph: Graph) -> tuple[set[str], int]:
    """The floating dtypes the graph's sums produce, and the most terms one adds."""
    dtypes, terms = set(), 1
    for op in graph.ops:
        if op.primitive in SUMS:
            dtypes.update(graph.tensors[t].dtype for t in op.outputs)
            terms = max(terms, _terms(graph, op))
        for body in graph.bodies.get(op.index, ()):
            inner, n = _sums(body.graph)
            dtypes |= inner
            terms = max(terms, n)
    return dtypes, terms


def _terms(graph: Graph, op: Any) -> int:
    """How many terms one output element of the sum `op` adds."""
    shapes = [graph.tensors[t].shape for t in op.inputs]
    if op.primitive == "dot_general":
        (contracting, _), _ = op.params["dimension_numbers"]
        return math.prod(shapes[0][d] for d in contracting)
    if op.primitive == "conv_general_dilated":
        kernel, out_feature = shapes[1], op.params["dimension_numbers"].rhs_spec[0]
        return math.prod(kernel) // max(kernel[out_feature], 1)
    if op.primitive == "cumsum":
        return shapes[0][op.params["axis"]]
    out = max((graph.tensors[t].size for t in op.outputs), default=1)
    return max(math.prod(shapes[0]) // max(out, 1), 1) if shapes else 1


def _leaves_like(noise: Any, tree: Any) -> list | None:
    import jax

    if noise is None:
        return None
    leaves, noise_tree = jax.tree_util.tree_flatten(noise)
    return leaves if noise_tree == tree else None
