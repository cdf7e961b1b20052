"""FLOPs and bytes per jaxpr primitive: a table of rules, one per primitive name.

Conventions (the cost model reads these numbers, so they are fixed here once):

- A FLOP is one floating-point add or multiply; a multiply-accumulate is two.
- `dot_general` and `conv_general_dilated` are exact: 2 × (output elements) × (reduction
  length). Convolution padding is counted as if it were data, which is what every published
  FLOP count of a CNN does. XLA's own `cost_analysis` does not: it skips the padded taps
  (`_verify/_flops.py` counts a convolution as XLA does, to compare with it).
- Elementwise primitives cost one FLOP per output element, transcendentals included
  (exp, log, tanh, logistic, erf, rsqrt...): they run at the memory roofline anyway, so a
  per-primitive constant would change nothing the planner decides.
- Reductions (reduce_*, argmax, cumsum, ...) cost one FLOP per input element.
- Data movement (reshape, transpose, broadcast, slice, gather, convert, select_n, ...)
  costs 0 FLOPs but moves bytes.
- bytes_read is the sum of the input tensors' bytes, bytes_written the outputs'. Reshape,
  squeeze, expand_dims and bitcast_convert_type are free (0 bytes): XLA lowers them to
  bitcasts of the same buffer. `convert_element_type` is *not* free: when XLA cannot fuse
  it into a neighbour it is a real pass over memory, and counting it errs on the safe side.

Loops and conditionals (scan, while, cond) are costed by `_trace.py`, which walks their
bodies with these same rules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.extend.core as jcore

# An aval is anything with `.shape` and `.dtype` (jax's ShapedArray, ShapeDtypeStruct).
Aval = Any
FlopRule = Callable[[Sequence[Aval], Sequence[Aval], Mapping[str, Any]], float]


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


def size(aval: Aval) -> int:
    # math.prod over a tuple of ints: numpy's prod is ten times slower, and capture calls
    # this for every operand of every op (tens of thousands for a 24-layer model).
    return math.prod(getattr(aval, "shape", ()))


def nbytes(aval: Aval) -> int:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:  # tokens and other abstract values hold no data
        return 0
    # Extended dtypes (PRNG keys) carry their own itemsize, as numpy dtypes do.
    return size(aval) * int(dtype.itemsize)


ELEMENTWISE: frozenset[str] = _names(
    """
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt
    ceil clamp clz complex conj cos cosh digamma div eq eq_to erf erf_inv erfc exp exp2
    expm1 floor ge gt igamma igamma_grad_a igammac imag integer_pow is_finite le le_to
    lgamma log log1p logistic lt lt_to max min mul ne neg nextafter not or polygamma
    population_count pow real regularized_incomplete_beta rem round rsqrt shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor
    zeta random_gamma_grad threefry2x32
    """
)

# One FLOP per input element.
REDUCTIONS: frozenset[str] = _names(
    """
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor reduce
    argmax argmin cumsum cumprod cummax cummin cumlogsumexp psum pmax pmin
    """
)

# 0 FLOPs, bytes only.
DATA_MOVEMENT: frozenset[str] = _names(
    """
    broadcast_in_dim transpose slice dynamic_slice dynamic_update_slice gather scatter
    concatenate pad rev select_n convert_element_type iota copy copy_p device_put
    sharding_constraint mesh_cast reshard optimization_barrier stop_gradient
    reduce_precision random_bits random_seed random_wrap random_unwrap random_fold_in
    random_split rng_bit_generator rng_uniform split pvary all_gather all_to_all ppermute
    ragged_all_to_all axis_index empty empty2 create_token after_all name platform_index
    """
)

# Same buffer, new shape: XLA emits a bitcast, so neither FLOPs nor bytes.
FREE: frozenset[str] = frozenset(["reshape", "squeeze", "expand_dims", "bitcast_convert_type"])


def _dot_general(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    # 2 × batch × M × N × K = 2 × |lhs| × (rhs dims that are neither batch nor contracting).
    (_, rhs_contract), (_, rhs_batch) = params["dimension_numbers"]
    lhs, rhs = ins[0], ins[1]
    tied = set(rhs_contract) | set(rhs_batch)
    rhs_free = math.prod(d for i, d in enumerate(rhs.shape) if i not in tied)
    return 2.0 * size(lhs) * rhs_free


def _conv(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    # Each output element is a dot of length (kernel spatial × kernel input features). The
    # kernel's input-feature dimension is already C_in / feature_group_count, and with
    # batch_group_count the output features are split among batch groups, so the kernel
    # shape alone gives the reduction length in both cases.
    rhs = ins[1]
    out_feature_dim = params["dimension_numbers"].rhs_spec[0]
    per_output = size(rhs) // max(rhs.shape[out_feature_dim], 1)
    return 2.0 * size(outs[0]) * per_output


def _elementwise(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    return float(sum(size(o) for o in outs))


def _reduction(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    return float(sum(size(i) for i in ins if getattr(i, "shape", None) is not None))


def _zero(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    return 0.0


def _window(params: Mapping[str, Any]) -> int:
    return math.prod(params.get("window_dimensions", ()) or (1,))


def _reduce_window(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    return float(size(outs[0]) * _window(params))


def _select_scatter(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    # Max-pool gradient: a compare per window element of each source position, plus the add.
    return float(size(ins[0]) * _window(params) + size(ins[0]))


def _scatter_combine(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    return float(size(ins[2]))  # one combine per update element


def _sort(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    n = ins[0].shape[params["dimension"]] if ins[0].shape else 1
    return float(size(ins[0]) * max(math.ceil(math.log2(max(n, 2))), 1))


def _top_k(ins: Sequence[Aval], outs: Sequence[Aval], params: Mapping[str, Any]) -> float:
    k = int(params.get("k", 1))
    return float(size(ins[0]) * max(math.ceil(math.log2(max(k, 2))), 1))


RULES: dict[str, FlopRule] = {
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "reduce_window_sum": _reduce_window,
    "reduce_window_max": _reduce_window,
    "reduce_window_min": _reduce_window,
    "reduce_window": _reduce_window,
    "select_and_gather_add": _reduce_window,
    "select_and_scatter_add": _select_scatter,
    "select_and_scatter": _select_scatter,
    "scatter-add": _scatter_combine,
    "scatter_add": _scatter_combine,
    "scatter-mul": _scatter_combine,
    "scatter_mul": _scatter_combine,
    "scatter-min": _scatter_combine,
    "scatter-max": _scatter_combine,
    "sort": _sort,
    "top_k": _top_k,
    "approx_top_k": _top_k,
    **dict.fromkeys(ELEMENTWISE, _elementwise),
    **dict.fromkeys(REDUCTIONS, _reduction),
    **dict.fromkeys(DATA_MOVEMENT | FREE, _zero),
}

# Conservative cost of a primitive without a rule: ten FLOPs per output element.
UNKNOWN_FLOPS_PER_ELEMENT = 10


def is_known(primitive_name: str) -> bool:
    """Whether `primitive_name` has a FLOP rule (loops and calls are handled by capture)."""
    return primitive_name in RULES


def op_cost(
    primitive_name: str,
    in_avals: Sequence[Aval],
    out_avals: Sequence[Aval],
    params: Mapping[str, Any],
) -> tuple[float, int, int]:
    """(flops, bytes_read, bytes_written) of one first-order primitive application.

    A primitive without a rule gets 10 FLOPs per output element and all its bytes; the
    caller decides whether to warn.
    """
    read = sum(nbytes(a) for a in in_avals)
    written = sum(nbytes(a) for a in out_avals)
    rule = RULES.get(primitive_name)
    if rule is None:
        return float(UNKNOWN_FLOPS_PER_ELEMENT * sum(size(o) for o in out_avals)), read, written
    if primitive_name in FREE:
        return 0.0, 0, 0
    return float(rule(in_avals, out_avals, params)), read, written


# --- Calls and loops ---------------------------------------------------------------------

# Call-like primitives: one sub-program with the caller's signature, run once in place.
CALLS: frozenset[str] = _names(
    """
    jit pjit closed_call core_call call custom_jvp_call custom_vjp_call
    custom_vjp_call_jaxpr remat remat2 checkpoint
    """
)
# Kept as one op each: the body runs a trip count of times (cond: one branch of several).
LOOPS: frozenset[str] = frozenset({"scan", "while", "cond"})
# Primitives that hold one sub-program but change its meaning (per-shard shapes, solves):
# never inlined, even when the signature happens to match.
_NOT_CALLS: frozenset[str] = _names(
    """
    shard_map xla_pmap custom_linear_solve custom_transpose_call run_state pallas_call
    """
)
_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _aval_key(aval: Any) -> tuple[Any, Any]:
    return tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", ""))


def sub_program(eqn: Any) -> tuple[Any, list[Any]] | None:
    """(open jaxpr, its consts) to inline in place of `eqn`, or None if `eqn` is not a call.

    Named calls (jit, custom_jvp_call, remat...) are inlined by name; any other primitive
    is inlined when it holds exactly one sub-program whose inputs and outputs have the
    eqn's own shapes and dtypes (a call under another name, e.g. from a newer JAX).
    """
    name = eqn.primitive.name
    if name in LOOPS or name in _NOT_CALLS:
        return None
    if name in CALLS:
        found = next((eqn.params[k] for k in _BODY_KEYS if k in eqn.params), None)
    else:
        subs = [v for v in eqn.params.values() if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))]
        found = subs[0] if len(subs) == 1 else None
    if found is None:
        return None
    if isinstance(found, jcore.ClosedJaxpr):
        body, consts = found.jaxpr, list(found.consts)
    else:
        body, consts = found, []
    if len(body.constvars) != len(consts):
        return None
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    if name not in CALLS:
        pairs = [
            *zip(body.invars, eqn.invars, strict=True),
            *zip(body.outvars, eqn.outvars, strict=True),
        ]
        if any(_aval_key(a.aval) != _aval_key(b.aval) for a, b in pairs):
            return None
    return body, consts


@dataclasses.dataclass(frozen=True)
class OpCost:
    """The cost of a sub-program (a loop's body times its trip count)."""

    flops: float = 0.0
    read: int = 0
    written: int = 0
    trip: int = 1
    trip_unknown: bool = False  # a while loop whose trip count was taken as 1
    unknown: frozenset[str] = frozenset()  # primitives costed without a rule

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(
            self.flops + other.flops,
            self.read + other.read,
            self.written + other.written,
            1,
            self.trip_unknown or other.trip_unknown,
            self.unknown | other.unknown,
        )

    def times(self, n: int) -> OpCost:
        return OpCost(
            self.flops * n, self.read * n, self.written * n, n, self.trip_unknown, self.unknown
        )


def jaxpr_cost(jaxpr: Any) -> OpCost:
    """Total cost of an open jaxpr, calls inlined and loops multiplied out."""
    total = OpCost()
    for eqn in jaxpr.eqns:
        inner = sub_program(eqn)
        if inner is not None:
            total = total + jaxpr_cost(inner[0])
        elif eqn.primitive.name in LOOPS:
            total = total + loop_cost(eqn)
        else:
            name = eqn.primitive.name
            ins = [v.aval for v in eqn.invars]
            outs = [v.aval for v in eqn.outvars]
            flops, read, written = op_cost(name, ins, outs, eqn.params)
            unknown = frozenset() if is_known(name) else frozenset({name})
            total = total + OpCost(flops, read, written, 1, False, unknown)
    return total


def loop_cost(eqn: Any) -> OpCost:
    """Cost of a scan (body × length), while (body and test × trip count, 1 when it cannot
    be read statically) or cond (the dearest branch) eqn, with its trip count."""
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        return jaxpr_cost(params["jaxpr"].jaxpr).times(int(params["length"]))
    if name == "cond":
        costs = [jaxpr_cost(b.jaxpr) for b in params["branches"]]
        worst = max(costs, key=lambda c: (c.flops, c.read + c.written))
        unknown = frozenset().union(*(c.unknown for c in costs))
        trip_unknown = any(c.trip_unknown for c in costs)
        return dataclasses.replace(worst, unknown=unknown, trip_unknown=trip_unknown)
    body = jaxpr_cost(params["body_jaxpr"].jaxpr) + jaxpr_cost(params["cond_jaxpr"].jaxpr)
    trip = while_trip_count(eqn)
    if trip is None:
        return dataclasses.replace(body, trip_unknown=True)
    return body.times(trip)


def _static(atom: Any) -> int | None:
    if isinstance(atom, jcore.Literal):
        try:
            return int(atom.val)
        except (TypeError, ValueError):
            return None
    return None


def while_trip_count(eqn: Any) -> int | None:
    """The trip count of a counting while loop (`i < n`, `i += step`, literal start, step
    and bound), as `lax.fori_loop` and hand-written counters produce; None otherwise."""
    p = eqn.params
    cj, bj = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, init = eqn.invars[:cn], eqn.invars[cn + bn :]
    if len(cj.eqns) != 1 or cj.eqns[0].primitive.name not in ("lt", "le"):
        return None
    test = cj.eqns[0]
    counter, bound = test.invars
    carry = list(cj.invars[cn:])
    if test.outvars[0] is not cj.outvars[0] or not any(counter is v for v in carry):
        return None
    k = next(i for i, v in enumerate(carry) if v is counter)
    lower = _static(init[k])
    if isinstance(bound, jcore.Literal):
        upper = _static(bound)
    elif any(bound is v for v in cj.invars[:cn]):
        upper = _static(cond_consts[next(i for i, v in enumerate(cj.invars[:cn]) if v is bound)])
    elif any(bound is v for v in carry):
        j = next(i for i, v in enumerate(carry) if v is bound)
        # The bound is a carry: static only if the body hands it back unchanged.
        passed = bj.outvars[j] is bj.invars[bn + j]
        upper = _static(init[j]) if passed else None
    else:
        upper = None
    step = None
    for beqn in bj.eqns:
        if beqn.outvars[0] is bj.outvars[k] and beqn.primitive.name == "add":
            a, c = beqn.invars
            if a is bj.invars[bn + k]:
                step = _static(c)
            elif c is bj.invars[bn + k]:
                step = _static(a)
    if lower is None or upper is None or not step or step < 0:
        return None
    span = upper - lower + (1 if test.primitive.name == "le" else 0)
    return max(0, -(-span // step))
