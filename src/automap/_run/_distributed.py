"""Feeding an applied plan whose mesh spans several processes (`jax.distributed`).

Under multi-controller JAX every process runs the same program on its own devices, and
each argument of the jitted step is one global `jax.Array` of which a process holds only
the shards on its devices. The step's arguments are given per process:

- batch leaves (capture's `Role.BATCH`): each process feeds its own share, the global
  batch split evenly along dimension 0 in process order (process 0's rows first), so a
  data loader reads only its host's examples;
- every other leaf (parameters, optimizer state, counters): the same full value on every
  process (made from the same seed); each process places the shards its devices hold;
- a leaf that already is a global `jax.Array` (an output of the previous step fed back)
  is used as it is, resharded if the plan wants another layout.

The outputs are global `jax.Array`s. A scalar loss is replicated and reads as a number on
every process; a sharded output is read whole with
`jax.experimental.multihost_utils.process_allgather(out, tiled=True)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, Sharding

from .._capture import capture
from .._errors import ApplyError
from .._graph import Role
from ._shared import leaf_dtype, leaf_shape


class Feed:
    """How this process feeds one argument structure: which leaves are its batch share,
    and the global abstract arguments the plan's program is traced with.

    Every process builds its Feed at the same point (the first call with a structure),
    and the construction is a collective: the processes compare their batch shares, so
    that a wrong share is an error on every process rather than a hang in the step."""

    def __init__(self, fn: Callable, mesh: Mesh, args: tuple, graph: Any = None) -> None:
        check_mesh(mesh)
        flat, treedef = jax.tree_util.tree_flatten_with_path(args)
        self.paths = [jax.tree_util.keystr(p) for p, _ in flat]
        leaves = [x for _, x in flat]
        batch = _batch_paths(fn, args, graph)
        # Rows this process feeds, for the batch leaves given as process-local data; None
        # for the leaves that are the same on every process or already global arrays.
        self.local_rows: list[int | None] = [
            leaf_shape(x)[0] if p in batch and leaf_shape(x) and not _is_global(x) else None
            for p, x in zip(self.paths, leaves, strict=True)
        ]
        check_shares(self.paths, self.local_rows)
        n = jax.process_count()
        self.global_leaves = [
            jax.ShapeDtypeStruct(
                leaf_shape(x) if rows is None else (rows * n, *leaf_shape(x)[1:]),
                leaf_dtype(x),
                weak_type=_weak(x),
            )
            for x, rows in zip(leaves, self.local_rows, strict=True)
        ]
        self.global_args = jax.tree_util.tree_unflatten(treedef, self.global_leaves)

    def place(self, leaves: Sequence[Any], shardings: Sequence[Sharding]) -> list[jax.Array]:
        """The flat arguments as global arrays with the plan's shardings."""
        out = []
        for x, s, rows, g in zip(
            leaves, shardings, self.local_rows, self.global_leaves, strict=True
        ):
            if _is_global(x):
                out.append(jax.device_put(x, s))  # no copy when already laid out as planned
            elif rows is not None:
                out.append(_place_share(np.asarray(x), s, g.shape))
            else:
                host = _host(x)
                out.append(jax.make_array_from_callback(g.shape, s, lambda i, h=host: h[i]))
        return out


def check_mesh(mesh: Mesh) -> None:
    """Every process must hold part of the mesh: a process without devices in it would
    have nothing to compute, and the program's collectives would wait for it forever."""
    held = {d.process_index for d in mesh.devices.flat}
    missing = sorted(set(range(jax.process_count())) - held)
    if missing:
        raise ApplyError(
            f"the plan's mesh {dict(mesh.shape)} covers {mesh.size} of the "
            f"{jax.device_count()} devices of the {jax.process_count()} processes, none of "
            f"process(es) {missing}. Under jax.distributed the mesh must use every "
            f"process's devices: make a plan for {jax.device_count()} devices "
            f"(`automap plan --devices {jax.device_count()}`)."
        )


def check_shares(paths: Sequence[str], local_rows: Sequence[int | None]) -> None:
    """All processes must feed equal shares of the batch (a collective: every process
    calls it, and every process raises the same error)."""
    fed = [(p, r) for p, r in zip(paths, local_rows, strict=True) if r is not None]
    if not fed:
        return
    n = jax.process_count()
    every = np.asarray(multihost_utils.process_allgather(np.array([r for _, r in fed])))
    every = every.reshape(n, len(fed))  # [processes, batch leaves]
    for k, (path, _) in enumerate(fed):
        rows = every[:, k]
        if (rows == rows[0]).all():
            continue
        total = int(rows.sum())
        share = (
            f"{total // n} rows each"
            if total % n == 0
            else f"equal shares, and {total} rows do not split evenly over {n} processes"
        )
        raise ApplyError(
            f"batch input {path}: the processes fed {rows.tolist()} rows along dimension 0 "
            f"(process 0 first), a global batch of {total}. Each of the {n} processes must "
            f"feed its share of the global batch, global batch / {n} = {share}."
        )


def _place_share(local: np.ndarray, sharding: Sharding, shape: tuple[int, ...]) -> jax.Array:
    """One global batch leaf from this process's rows."""
    if rows_in_process_order(sharding, shape):
        return jax.make_array_from_process_local_data(sharding, local, shape)
    # The plan does not split the batch over processes in process order (e.g. a batch
    # replicated over a model axis that spans processes): each process needs rows other
    # processes hold, so every process first gathers the whole batch.
    whole = np.asarray(multihost_utils.process_allgather(local, tiled=True))
    return jax.make_array_from_callback(shape, sharding, lambda i: whole[i])


def rows_in_process_order(sharding: Sharding, shape: tuple[int, ...]) -> bool:
    """Do process p's devices hold exactly rows [p*n, (p+1)*n) of dimension 0, its share?"""
    n = shape[0] // jax.process_count()
    held: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        start, stop, _ = index[0].indices(shape[0])
        p = device.process_index
        if start < p * n or stop > (p + 1) * n:
            return False
        held.setdefault(p, set()).add((start, stop))
    # Shards of one sharding are equal slices: distinct ones do not overlap, so their
    # lengths add up to the rows covered.
    return all(sum(b - a for a, b in spans) == n for spans in held.values())


def _batch_paths(fn: Callable, args: tuple, graph: Any) -> set[str]:
    """Paths of the batch leaves, by the roles capture gives (the roles planning used)."""
    if graph is None:
        graph = capture(fn, *args)
    return {leaf.path for leaf in graph.inputs if leaf.role == Role.BATCH}


def _is_global(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _host(x: Any) -> Any:
    """A value to slice shards from: numpy, except for PRNG keys, which numpy cannot hold."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    return np.asarray(x)


def _weak(x: Any) -> bool:
    # Python scalars trace as weakly typed; keeping that keeps the program (and so the
    # plan's fingerprint) the one traced from the arguments themselves.
    return bool(getattr(x, "weak_type", type(x) in (bool, int, float, complex)))
