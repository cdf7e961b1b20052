"""Capture: trace a training step with `jax.make_jaxpr` into a `Graph`.

Nested calls (jit, closed_call, custom_jvp_call, custom_vjp_call, remat/checkpoint, and any
other primitive that wraps one sub-program of the same signature) are inlined, so a plan
can fix tensors inside them. scan, while and cond stay one op each: their bodies run many
times (or once of several), and their cost is the body's times the trip count (cond: the
dearest branch). Each body is also captured as a program of its own (`Graph.bodies`), bound
to the loop's operands and results, so that what it communicates is priced per trip. Tensor ids: input leaves first (flat order of the argument tuple), then the
top-level constants, then each op's literal operands and outputs in program order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend.core as jcore

from .._errors import CaptureError
from .._graph import Graph, InputLeaf, LoopBody, Op, OutputLeaf, Role, Tensor, TensorKind
from . import _flops
from ._donation import donated_leaves
from ._flops import LOOPS, loop_cost, sub_program


class CaptureWarning(UserWarning):
    """Something in the step could not be costed exactly (an unknown primitive, a while
    loop without a static trip count)."""


_OPT_NAME = re.compile(r"^(opt|optim|optimizer|tx)(_|$)|opt_?state|optimizer|optim_")
_PARAM_NAMES = {"params", "variables", "weights", "model", "net", "network", "theta", "w"}
_PARAM_NAME = re.compile(r"param|weight|trainable")
_BATCH_NAMES = {"x", "y", "xs", "ys", "data", "inputs", "sample", "samples", "examples"}
_BATCH_NAME = re.compile(r"batch|input|label|target|token|image|feature|example")
# Path fragments that mark optimizer state inside any argument (optax's state tuples,
# Flax's TrainState.opt_state), parameters inside a state object, and non-trainable state.
_OPT_MARKERS = (".opt_state", "['opt_state']", ".mu", ".nu", ".count", ".inner_state", ".trace")
_PARAM_MARKERS = (".params", "['params']")
_OTHER_MARKERS = ("['batch_stats']", ".batch_stats", ".step")
# Arguments of non-trainable state: Keras's non_trainable_variables, Flax's batch_stats
# passed on their own (named like a batch, but statistics of features, not examples).
_OTHER_NAME = re.compile(r"^non_|stats")


def capture(fn: Callable[..., Any], *args: Any, roles: Mapping[Any, Any] | None = None) -> Graph:
    """Trace `fn(*args)` into a `Graph`; `args` may hold arrays or `jax.ShapeDtypeStruct`s.

    Nothing is allocated: `jax.make_jaxpr` only needs shapes and dtypes. Static arguments
    must be closed over (`functools.partial`), not passed.

    Roles of the input leaves, first rule that matches:

    1. `roles` overrides, most specific first: a leaf-path prefix (a string starting with
       "[", e.g. "[0]['params']['embed']"), then an argument name, then an argument index.
       Values are `Role`s or their strings ("param", "opt_state", "batch", "other").
    2. Optimizer state: an argument named opt_state, optimizer_state, opt, tx_state...;
       a path through ".opt_state"/"['opt_state']" (Flax's TrainState); or, in an
       argument not named like parameters, a path through optax's state fields (".mu",
       ".nu", ".count", ".inner_state", ".trace") → OPT_STATE.
    3. Non-trainable state: an argument named non_... (Keras's non_trainable_variables) or
       ...stats (Flax's batch_stats), a path through "batch_stats" or a TrainState's
       ".step" → OTHER.
    4. Parameters: an argument named params, variables, weights, model,
       trainable_variables...; or a path through ".params"/"['params']" in an argument not
       named like a batch → PARAM.
    5. Batch: an argument named batch, inputs, x, y, data, images, tokens, labels,
       targets... → BATCH, except a single raw PRNG key (uint32[2] or [4]) in it,
       which has no batch dimension (→ OTHER). Any other argument that holds an optax state node → OPT_STATE.
    6. If no leaf is a PARAM by now, the first argument with floating-point leaves is the
       parameters (its float leaves). Everything left is OTHER.

    A step jitted with `donate_argnums`/`donate_argnames` has its donated leaves marked
    (`InputLeaf.donated`): XLA may write its outputs over them.

    An unknown primitive is kept as one op, costed at 10 FLOPs per output element plus all
    its bytes, marked `known=False`, and warned about once per primitive name per capture.
    """
    closed, out_shape = _trace(fn, args)
    leaves = _Leaves.of(args, out_shape, closed.jaxpr)
    b = _Builder()
    env: dict[Any, int] = {}
    for var in closed.jaxpr.invars:
        env[var] = b.tensor(var.aval, TensorKind.INPUT)
    for var, value in zip(closed.jaxpr.constvars, closed.consts, strict=True):
        env[var] = b.const(var.aval, value)
    b.emit(closed.jaxpr, env, "")
    outputs = tuple(
        OutputLeaf(path, b.atom(env, v))
        for path, v in zip(leaves.out_paths, closed.jaxpr.outvars, strict=True)
    )
    invars, paths, arg_index = closed.jaxpr.invars, leaves.paths, leaves.arg_index
    leaf_roles = _infer_roles(fn, args, paths, arg_index, invars, roles)
    donated = set(donated_leaves(fn, args, len(paths)))
    inputs = tuple(
        InputLeaf(path, arg_index[i], env[invars[i]], leaf_roles[i], i in donated)
        for i, path in enumerate(paths)
    )
    tensors = tuple(b.tensors)
    ops = tuple(b.ops)
    return Graph(
        tensors=tensors,
        ops=ops,
        inputs=inputs,
        outputs=outputs,
        fingerprint=_fingerprint(tensors, ops, inputs, outputs),
        jaxpr=closed,
        in_tree=leaves.in_tree,
        out_tree=leaves.out_tree,
        eqns=tuple(b.eqns),
        const_values=b.const_values,
        bodies=b.bodies,
    )


def _trace(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any]:
    """(closed jaxpr, output shapes) of `fn(*args)`, or a CaptureError that says what to
    pass instead: a step that fails to trace, maps itself over devices, or does nothing."""
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as err:  # any tracing failure is the user's to fix: say how
        raise CaptureError(
            f"could not trace {getattr(fn, '__name__', fn)!r}: {type(err).__name__}: {err}\n"
            "hint: pass arrays or jax.ShapeDtypeStruct pytrees; static arguments (ints, "
            "strings, modules) should be closed over with functools.partial"
        ) from err
    _refuse_per_device(closed.jaxpr)
    if not closed.jaxpr.outvars or not closed.jaxpr.eqns:
        what = "returns nothing" if not closed.jaxpr.outvars else "computes nothing"
        raise CaptureError(
            f"{getattr(fn, '__name__', fn)!r} {what}, so there is no work to plan: return "
            "what the step computes (the loss, the new parameters and optimizer state)."
        )
    return closed, out_shape


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """The step's argument and output leaves, by path, matched to the traced program."""

    paths: list[str]
    """Each input leaf's path (`jax.tree_util.keystr`), in flat order."""
    arg_index: list[int]
    """Each input leaf's argument number."""
    in_tree: Any
    out_paths: list[str]
    out_tree: Any

    @classmethod
    def of(cls, args: tuple[Any, ...], out_shape: Any, jaxpr: Any) -> _Leaves:
        paths_leaves, in_tree = jax.tree_util.tree_flatten_with_path(args)
        paths = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
        if len(paths) != len(jaxpr.invars):  # e.g. a leaf make_jaxpr splits or drops
            raise CaptureError(
                f"{len(paths)} argument leaves but {len(jaxpr.invars)} traced inputs; "
                "pass arrays or jax.ShapeDtypeStruct leaves only"
            )
        out_leaves = jax.tree_util.tree_flatten_with_path(out_shape)[0]
        return cls(
            paths=paths,
            arg_index=[int(re.match(r"\[(\d+)\]", p).group(1)) for p in paths],
            in_tree=in_tree,
            out_paths=[jax.tree_util.keystr(p) for p, _ in out_leaves],
            out_tree=jax.tree_util.tree_structure(out_shape),
        )


#: Primitives of a program written per device: its shardings are the user's, not a plan's.
_PER_DEVICE = frozenset({"shard_map", "xla_pmap", "pmap"})


def _refuse_per_device(jaxpr: Any) -> None:
    """A step that maps itself over devices (pmap, shard_map) already fixes how its work is
    split, and one mesh cannot hold both its mapping and a plan's: refuse it here, before a
    plan is made that `apply` cannot run."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _PER_DEVICE:
            where = str(eqn.source_info.name_stack) or "the top level"
            raise CaptureError(
                f"the step calls {eqn.primitive.name} ({where}): automap plans how a step "
                "written for one device is split, and cannot re-split a per-device program. "
                "Pass the step without jax.pmap / jax.shard_map (automap shards it), or run "
                "it as it is, without a plan."
            )
        for sub in jcore.jaxprs_in_params(eqn.params):
            _refuse_per_device(sub)


class _Builder:
    """Walks a jaxpr, inlining calls, and appends tensors and ops in program order."""

    def __init__(self, warned: set[str] | None = None) -> None:
        self.tensors: list[Tensor] = []
        self.ops: list[Op] = []
        self.eqns: list[Any] = []
        self.const_values: dict[int, Any] = {}
        self.warned: set[str] = set() if warned is None else warned
        self.dtype_names: dict[Any, str] = {}
        self.bodies: dict[int, tuple[LoopBody, ...]] = {}

    def tensor(self, aval: Any, kind: TensorKind, producer: int | None = None) -> int:
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", None)
        if dtype not in self.dtype_names:  # str(dtype) is slow and asked for every tensor
            self.dtype_names[dtype] = "token" if dtype is None else str(dtype)
        dtype = self.dtype_names[dtype]
        self.tensors.append(Tensor(len(self.tensors), shape, dtype, kind, producer))
        return len(self.tensors) - 1

    def const(self, aval: Any, value: Any) -> int:
        tid = self.tensor(aval, TensorKind.CONST)
        self.const_values[tid] = value
        return tid

    def atom(self, env: dict[Any, int], atom: Any) -> int:
        # Each literal occurrence is its own CONST tensor: literals have no identity in a jaxpr.
        if isinstance(atom, jcore.Literal):
            return self.const(atom.aval, atom.val)
        return env[atom]

    def warn(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, CaptureWarning, stacklevel=4)

    def emit(self, jaxpr: Any, env: dict[Any, int], stack: str) -> None:
        for eqn in jaxpr.eqns:
            here = _join(stack, str(eqn.source_info.name_stack))
            inner = sub_program(eqn)
            if inner is not None:  # a call: run its body in place, its vars bound to ours
                body, consts = inner
                sub_env: dict[Any, int] = {}
                for var, value in zip(body.constvars, consts, strict=True):
                    sub_env[var] = self.const(var.aval, value)
                for var, outer in zip(body.invars, eqn.invars, strict=True):
                    sub_env[var] = self.atom(env, outer)
                self.emit(body, sub_env, _join(here, eqn.params.get("name", eqn.primitive.name)))
                for outer, var in zip(eqn.outvars, body.outvars, strict=True):
                    if not isinstance(outer, jcore.DropVar):
                        env[outer] = self.atom(sub_env, var)
                continue
            self._op(eqn, env, here)

    def _op(self, eqn: Any, env: dict[Any, int], stack: str) -> None:
        name = eqn.primitive.name
        inputs = tuple(self.atom(env, v) for v in eqn.invars)
        index = len(self.ops)
        outputs = tuple(self.tensor(v.aval, TensorKind.INTERMEDIATE, index) for v in eqn.outvars)
        for var, tid in zip(eqn.outvars, outputs, strict=True):
            if not isinstance(var, jcore.DropVar):
                env[var] = tid
        in_avals = [v.aval for v in eqn.invars]
        out_avals = [v.aval for v in eqn.outvars]
        trip = 1
        if name in LOOPS:
            cost = loop_cost(eqn)
            flops, read, written, trip = cost.flops, cost.read, cost.written, cost.trip
            known = not cost.unknown
            if cost.trip_unknown:
                self.warn(
                    "while",  # once per capture: the advice is the same for every loop
                    f"automap: a while loop ({stack or 'top level'}) has no static trip "
                    "count; its body is costed as if it ran once (and so is any other such "
                    "loop in this step)",
                )
            for prim in sorted(cost.unknown):
                self._warn_unknown(prim)
            self.bodies[index] = self._bodies(eqn, inputs, outputs, trip)
        else:
            flops, read, written = _flops.op_cost(name, in_avals, out_avals, eqn.params)
            known = _flops.is_known(name)
            if not known:
                self._warn_unknown(name)
        self.ops.append(
            Op(
                index=index,
                primitive=name,
                inputs=inputs,
                outputs=outputs,
                params=eqn.params,
                flops=float(flops),
                bytes_read=int(read),
                bytes_written=int(written),
                trip_count=int(trip),
                name_stack=stack,
                known=known,
            )
        )
        self.eqns.append(eqn)

    def _bodies(
        self, eqn: Any, ins: tuple[int, ...], outs: tuple[int, ...], trip: int
    ) -> tuple[LoopBody, ...]:
        """The loop's sub-programs, each bound to the loop's operands and results as XLA
        binds them: a scan slices its stacked operands (`xs`) and stacks its per-trip
        results (`ys`) along their leading dim; carried values enter, leave and go round
        with one layout (XLA gives a while loop's state one sharding); a cond's branches
        read its operands (after the predicate) and write its results."""
        p = eqn.params
        name = eqn.primitive.name
        if name == "scan":
            nc, ncar = p["num_consts"], p["num_carry"]
            init = ins[nc : nc + ncar]
            offsets = [0] * (nc + ncar) + [1] * (len(ins) - nc - ncar)
            out_offsets = [0] * ncar + [1] * (len(outs) - ncar)

            def extra(body_in, body_out):  # the loop-back edge: carry out is carry in
                return [(t, body_out[i], 0) for i, t in enumerate(init)]

            body = self._body(p["jaxpr"], ins, offsets, outs, out_offsets, trip, extra, nc)
            return (body,)
        if name == "cond":
            branches = p["branches"]
            dearest = max(
                range(len(branches)),
                key=lambda k: (
                    (c := _flops.jaxpr_cost(branches[k].jaxpr)).flops,
                    c.read + c.written,
                ),
            )
            zeros_in, zeros_out = [0] * (len(ins) - 1), [0] * len(outs)
            return tuple(
                self._body(
                    br, ins[1:], zeros_in, outs, zeros_out, 1, None, len(zeros_in), k == dearest
                )
                for k, br in enumerate(branches)
            )
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]

        def back(body_in, body_out):  # the loop-back edge, as for a scan's carry
            return [(t, body_out[i], 0) for i, t in enumerate(init)]

        body = self._body(
            p["body_jaxpr"],
            (*bconsts, *init),
            [0] * (bn + len(init)),
            outs,
            [0] * len(outs),
            trip,
            back,
            bn,
        )
        test = self._body(
            p["cond_jaxpr"], (*cconsts, *init), [0] * (cn + len(init)), (), [], trip, None, cn
        )
        return (body, test)

    def _body(
        self,
        closed: Any,
        ins: tuple[int, ...],
        in_offsets: list[int],
        outs: tuple[int, ...],
        out_offsets: list[int],
        trips: int,
        extra: Callable[[list[int], list[int]], list[tuple[int, int, int]]] | None,
        invariant: int,
        priced: bool = True,
    ) -> LoopBody:
        """One sub-program captured on its own (its own tensor ids) and its binds; its
        first `invariant` operands are the same on every trip (consts)."""
        b = _Builder(self.warned)
        env: dict[Any, int] = {}
        jaxpr = closed.jaxpr
        body_in = [b.tensor(v.aval, TensorKind.INPUT) for v in jaxpr.invars]
        env.update(zip(jaxpr.invars, body_in, strict=True))
        for var, value in zip(jaxpr.constvars, closed.consts, strict=True):
            env[var] = b.const(var.aval, value)
        b.emit(jaxpr, env, "")
        body_out = [b.atom(env, v) for v in jaxpr.outvars]
        binds = [*zip(ins, body_in, in_offsets, strict=True)]
        if outs:  # a while loop's test returns its predicate, bound to nothing outside
            binds += [*zip(outs, body_out, out_offsets, strict=True)]
        if extra is not None:
            binds += extra(body_in, body_out)
        graph = Graph(
            tensors=tuple(b.tensors),
            ops=tuple(b.ops),
            inputs=(),
            outputs=tuple(OutputLeaf(f"[{i}]", t) for i, t in enumerate(body_out)),
            fingerprint="",
            eqns=tuple(b.eqns),
            const_values=b.const_values,
            bodies=b.bodies,
        )
        return LoopBody(graph, tuple(binds), max(int(trips), 1), priced, invariant)

    def _warn_unknown(self, name: str) -> None:
        self.warn(
            name,
            f"automap: no cost rule for primitive '{name}'; it is costed conservatively "
            "(10 FLOPs per output element, all its bytes) and kept replicated",
        )


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a and b else a or b


def _infer_roles(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    paths: list[str],
    arg_index: list[int],
    invars: list[Any],
    overrides: Mapping[Any, Any] | None,
) -> list[Role]:
    names = _arg_names(fn, len(args))
    _check_overrides(overrides, names, paths, len(args))
    optax_args = {i for i, a in enumerate(args) if _holds_optax_state(a)}
    out: list[Role | None] = []
    for path, i in zip(paths, arg_index, strict=True):
        name, rest = names[i] or "", path[len(f"[{i}]") :]
        batch_named = name in _BATCH_NAMES or bool(_BATCH_NAME.search(name))
        role: Role | None = _override(overrides, path, name, i)
        if role is None:
            # Keras's non_trainable_variables (BatchNorm statistics, seeds) are not trained.
            untrained = bool(_OTHER_NAME.search(name))
            param_named = not untrained and (name in _PARAM_NAMES or bool(_PARAM_NAME.search(name)))
            opt_path = any(m in rest for m in _OPT_MARKERS[:2])
            optax_field = any(m in rest for m in _OPT_MARKERS[2:]) and not param_named
            if opt_path or optax_field or _OPT_NAME.search(name):
                role = Role.OPT_STATE
            elif untrained or any(m in rest for m in _OTHER_MARKERS):
                role = Role.OTHER
            elif param_named or (any(m in rest for m in _PARAM_MARKERS) and not batch_named):
                role = Role.PARAM
            elif batch_named and not _raw_key(invars[len(out)].aval):
                role = Role.BATCH
            elif i in optax_args:
                role = Role.OPT_STATE
        out.append(role)
    if Role.PARAM not in out:
        floating = [jax.numpy.issubdtype(v.aval.dtype, jax.numpy.floating) for v in invars]
        firsts = [i for i, r, f in zip(arg_index, out, floating, strict=True) if r is None and f]
        if firsts:
            for k, (i, r) in enumerate(zip(arg_index, out, strict=True)):
                if i == firsts[0] and r is None and floating[k]:
                    out[k] = Role.PARAM
    return [r or Role.OTHER for r in out]


def _raw_key(aval: Any) -> bool:
    """A single raw PRNG key (`jax.random.PRNGKey`: uint32[2]; the rbg kinds: uint32[4])
    travels with a batch but is not one: its 2 must not be read as the batch size. A
    batch of keys (uint32[B, 2]) is a batch."""
    return str(aval.dtype) == "uint32" and tuple(aval.shape) in ((2,), (4,))


def _check_overrides(
    overrides: Mapping[Any, Any] | None, names: list[str | None], paths: list[str], n: int
) -> None:
    """Each `roles` entry must name a role and match something: a typo in either would
    otherwise be ignored silently, and the plan made on guessed roles."""
    if overrides is None:
        return
    if not isinstance(overrides, Mapping):
        raise CaptureError(
            f"roles must be a dict such as {{'params': 'param'}}, got {type(overrides).__name__}"
        )
    valid = ", ".join(repr(r.value) for r in Role)
    for key, value in overrides.items():
        try:
            Role(value)
        except ValueError:
            raise CaptureError(
                f"roles[{key!r}] = {value!r} is not a role; use one of {valid}"
            ) from None
        if isinstance(key, str) and key.startswith("["):
            matched = any(p.startswith(key) for p in paths)
        elif isinstance(key, str):
            matched = key in names
        else:
            matched = isinstance(key, int) and not isinstance(key, bool) and 0 <= key < n
        if not matched:
            known = ", ".join(repr(x) for x in names if x) or "none"
            raise CaptureError(
                f"roles key {key!r} matches no argument of the step (argument names: {known}; "
                f"indices 0-{n - 1}; or a leaf-path prefix such as {paths[0]!r})"
                if paths
                else f"roles key {key!r} matches nothing: the step takes no arguments"
            )


def _override(overrides: Mapping[Any, Any] | None, path: str, name: str, index: int) -> Role | None:
    if not overrides:
        return None
    prefixes = [
        k for k in overrides if isinstance(k, str) and k.startswith("[") and path.startswith(k)
    ]
    if prefixes:
        return Role(overrides[max(prefixes, key=len)])
    if name and name in overrides:
        return Role(overrides[name])
    if index in overrides:
        return Role(overrides[index])
    return None


def _arg_names(fn: Callable[..., Any], n: int) -> list[str | None]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins, some C callables: no names to go by
        return [None] * n
    names: list[str | None] = []
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            break
    return (names + [None] * n)[:n]


def _holds_optax_state(arg: Any) -> bool:
    found = False

    def look(node: Any) -> bool:
        nonlocal found
        found = found or type(node).__module__.split(".")[0] == "optax"
        return False

    jax.tree_util.tree_flatten(arg, is_leaf=look)
    return found


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _render(value: Any) -> str:
    # Functions (custom rules, thunks) print with their address; their name is what's stable.
    if callable(value) and not isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return getattr(value, "__qualname__", type(value).__name__)
    return _ADDRESS.sub("", str(value))


def _fingerprint(tensors: tuple, ops: tuple, inputs: tuple, outputs: tuple) -> str:
    h = hashlib.sha256()

    def sig(t: int) -> str:
        return f"{t}:{tensors[t].dtype}{list(tensors[t].shape)}"

    for leaf in inputs:
        h.update(f"in {leaf.path} {sig(leaf.tensor)}\n".encode())
    for op in ops:
        params = ",".join(f"{k}={_render(v)}" for k, v in sorted(op.params.items()))
        ins = " ".join(sig(t) for t in op.inputs)
        outs = " ".join(sig(t) for t in op.outputs)
        h.update(f"op {op.primitive} [{params}] ({ins}) -> ({outs})\n".encode())
    for leaf in outputs:
        h.update(f"out {leaf.path} {sig(leaf.tensor)}\n".encode())
    return h.hexdigest()
