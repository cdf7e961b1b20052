"""The captured program: tensors, ops and inputs, as plain frozen data.

A `Graph` is what every other part of Auto-MAP reads: linkage groups are built over its
tensor dimensions, the cost model walks its ops, and `apply` re-runs its jaxpr. It is made
by `capture` (see `_capture/`) and never mutated afterwards.

Identifiers are plain ints: a tensor's id is its index in `Graph.tensors`, an op's index is
its position in `Graph.ops` (program order, nested calls inlined). Both are deterministic
for the same program, so plans may refer to them (checked by `Graph.fingerprint`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any


class Role(enum.StrEnum):
    """What an input leaf is to the training step; drives ZeRO and data-parallel choices."""

    PARAM = "param"
    OPT_STATE = "opt_state"
    BATCH = "batch"
    OTHER = "other"


@functools.cache  # a graph has a handful of dtypes; the cost model asks millions of times
def dtype_itemsize(dtype: str) -> int:
    """Bytes per element; JAX's extended dtypes (PRNG keys such as "key<fry>") included."""
    import jax.numpy as jnp

    try:
        return jnp.dtype(dtype).itemsize
    except TypeError:
        if dtype.startswith("key<"):
            # A threefry key is two uint32 words; other implementations are no larger.
            return 8
        raise


class TensorKind(enum.StrEnum):
    INPUT = "input"  # a leaf of the step's arguments
    CONST = "const"  # a literal or a closed-over constant
    INTERMEDIATE = "intermediate"  # produced by an op


@dataclasses.dataclass(frozen=True)
class Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32", "bfloat16", "int32"
    kind: TensorKind
    producer: int | None = None  # index of the op that writes it (None for inputs/consts)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # Kept once computed (the cost model reads a tensor's bytes millions of times per
    # model): a frozen tensor's shape and dtype never change.
    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)  # exact ints, and ~10x faster than np.prod here

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclasses.dataclass(frozen=True)
class Op:
    index: int
    primitive: str  # jaxpr primitive name, e.g. "dot_general"
    inputs: tuple[int, ...]  # tensor ids, in operand order (literals included as CONST tensors)
    outputs: tuple[int, ...]  # tensor ids
    # The eqn's params, as JAX gives them (dimension_numbers, axes, permutation, ...).
    # Not serialized: a Graph is rebuilt by capture, never loaded from disk.
    params: Mapping[str, Any] = dataclasses.field(compare=False, repr=False)
    flops: float  # for the whole op (loops: the body's times the trip count)
    bytes_read: int
    bytes_written: int
    trip_count: int = 1  # >1 for scan/while kept as one op
    name_stack: str = ""  # JAX name stack: where in the user's code the op came from
    known: bool = True  # False for a primitive without a sharding/cost rule (kept replicated)


@dataclasses.dataclass(frozen=True)
class InputLeaf:
    path: (
        str  # jax.tree_util.keystr of the leaf within the argument tuple, e.g. "[0]['params']['w']"
    )
    arg_index: int  # which positional argument of the step it belongs to
    tensor: int  # tensor id
    role: Role
    # The step donates it (jitted with donate_argnums): XLA may write an output over it
    # (`_capture.donated_leaves`; what the cost model does with it: `_cost/_outputs.py`).
    donated: bool = False


@dataclasses.dataclass(frozen=True)
class OutputLeaf:
    path: str  # keystr of the leaf within the step's output pytree
    tensor: int


@dataclasses.dataclass(frozen=True)
class LoopBody:
    """One sub-program of a scan, while or cond op, as a program of its own: how XLA's
    partitioner sees it (one iteration, or one branch), so that its collectives can be
    priced where they happen, inside the loop, once per trip."""

    graph: Graph  # the body: its own tensor ids, ops (and nested loops' bodies)
    # (outer tensor, body tensor, offset): outer dim d + offset is body dim d. Offset 1 is
    # a scan's stacked operand or result, sliced or stacked along its leading dim per trip.
    binds: tuple[tuple[int, int, int], ...]
    trips: int  # runs per run of the op (a scan's length; 1 for a branch)
    priced: bool = True  # a cond's branches: only the dearest one is priced (capture's rule)
    # The first `invariant` binds are operands that are the same on every trip (a scan's
    # or while's consts, a cond's operands): XLA hoists a reshard of one out of the loop.
    invariant: int = 0


@dataclasses.dataclass(frozen=True)
class Graph:
    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    inputs: tuple[InputLeaf, ...]
    outputs: tuple[OutputLeaf, ...]
    fingerprint: str  # hash of the program's structure: ops, shapes, dtypes, input paths
    # The traced program and argument structure, for apply/verify. Not compared.
    jaxpr: Any = dataclasses.field(compare=False, repr=False, default=None)
    in_tree: Any = dataclasses.field(compare=False, repr=False, default=None)
    out_tree: Any = dataclasses.field(compare=False, repr=False, default=None)
    # For the interpreter (`_run/_interpret.py`): the inlined JaxprEqn of each op (aligned with
    # `ops`), and the value of each CONST tensor (literals, closed-over constants).
    eqns: tuple[Any, ...] = dataclasses.field(compare=False, repr=False, default=())
    const_values: Mapping[int, Any] = dataclasses.field(
        compare=False, repr=False, default_factory=dict
    )
    # Op index of each scan, while and cond -> its sub-programs (`LoopBody`), for pricing
    # what their bodies communicate.
    bodies: Mapping[int, tuple[LoopBody, ...]] = dataclasses.field(
        compare=False, repr=False, default_factory=dict
    )

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    @functools.cached_property
    def memo(self) -> dict[str, Any]:
        """Values later stages derive from this graph, each under a name of its own (an
        op's sharding rule: `_groups.rule`). The graph is immutable, so they hold for its
        life; a search asks for them again for every plan it prices (a 1T GPT's rules
        were made 1.9 million times for its 88,000 ops)."""
        return {}

    def recall(
        self, name: str, owner: object, key: Hashable, make: Callable[[], Any], keep: int
    ) -> Any:
        """`make()`, remembered in `memo` under `name` and `key`, the `keep` latest: for
        values derived from this graph and `owner` (the groups they were made with,
        compared by identity: hashing a large model's groups would cost more than most
        values). The planner asks for the same partitions and layouts again for every
        saver and schedule it prices."""
        held = self.memo.setdefault(name, {})
        if held.get("owner") is not owner:
            held.clear()
            held.update(owner=owner, values={})
        values = held["values"]
        if key in values:
            values[key] = values.pop(key)  # the latest last
        else:
            values[key] = make()
            if len(values) > keep:
                del values[next(iter(values))]
        return values[key]

    def leaves(self, role: Role) -> tuple[InputLeaf, ...]:
        return tuple(leaf for leaf in self.inputs if leaf.role == role)

    @property
    def batch_rows(self) -> int | None:
        """The leading size of the batch leaves when they agree (the batch size a user
        would name), else None: recorded in plans to say so when a call's batch differs."""
        shapes = [self.tensors[leaf.tensor].shape for leaf in self.leaves(Role.BATCH)]
        sizes = {shape[0] for shape in shapes if shape}
        return sizes.pop() if len(sizes) == 1 else None

    def role_bytes(self, role: Role) -> int:
        return sum(self.tensors[leaf.tensor].nbytes for leaf in self.leaves(role))

    def param_count(self) -> int:
        return sum(self.tensors[leaf.tensor].size for leaf in self.leaves(Role.PARAM))

    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """For each tensor id, the indices of the ops that read it (program order)."""
        return self._consumers

    @functools.cached_property
    def _consumers(self) -> tuple[tuple[int, ...], ...]:
        # Computed once: the graph is immutable, and the cost model asks for it every time
        # it prices a pipeline plan (`_cost/_traffic.py`).
        users: list[list[int]] = [[] for _ in self.tensors]
        for op in self.ops:
            for t in dict.fromkeys(op.inputs):
                users[t].append(op.index)
        return tuple(tuple(u) for u in users)
