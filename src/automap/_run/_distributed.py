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

A pipeline plan's stages each run on their own sub-mesh, which may sit inside one process
or span several. Its runtime (`_pipelined.py`) feeds and moves values with the functions
below, which every process calls in the same order with the same arguments:

- `Feed.whole`: the batch shares gathered into the global batch on every process (a stage
  needs the rows of every microbatch it runs, whichever process fed them);
- `move`: a value onto a stage's sharding. Host data is placed shard by shard; a global
  array already on the stage's devices is resharded there; one crossing processes is
  sent by `send`, a collective-permute over the pair of stage meshes (JAX's `device_put`
  moves arrays between processes only on TPU runtimes), or, when it comes from devices
  that are not a stage of the same size (a global array the caller made), gathered;
- `gather`: an output whole on every process, wherever its stage lies
  (`process_allgather` needs an array on every process's devices).

Every process decides alike whether a `jax.Array` is a global array or host data of its
own (`is_global`): an array that lies on another process's devices, or on one of the
run's meshes (an output of a previous step), is global; any other array (a value made
with `jax.random` or `jnp` on this process's default device) is host data, the same on
every process.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

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

    def __init__(
        self, fn: Callable, meshes: Sequence[Mesh], args: tuple, graph: Any = None
    ) -> None:
        check_mesh(meshes)
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

    def whole(self, leaves: Sequence[Any]) -> list[Any]:
        """The flat arguments with every batch share replaced by the global batch, the
        shares of all processes in process order (an all-gather every process joins)."""
        return [
            x
            if rows is None
            else np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))
            for x, rows in zip(leaves, self.local_rows, strict=True)
        ]


def check_mesh(meshes: Sequence[Mesh]) -> None:
    """Every process must hold part of the plan's mesh (a pipeline's: the union of its
    stage meshes): a process without devices in it would have nothing to compute, and the
    program's collectives would wait for it forever."""
    devices = {d for mesh in meshes for d in mesh.devices.flat}
    held = {d.process_index for d in devices}
    missing = sorted(set(range(jax.process_count())) - held)
    if missing:
        what = (
            f"the plan's mesh {dict(meshes[0].shape)} covers"
            if len(meshes) == 1
            else f"the plan's {len(meshes)} pipeline stages cover"
        )
        raise ApplyError(
            f"{what} {len(devices)} of the "
            f"{jax.device_count()} devices of the {jax.process_count()} processes, none of "
            f"process(es) {missing}. Under jax.distributed the mesh must use every "
            f"process's devices: make a plan for {jax.device_count()} devices "
            f"(`automap plan --devices {jax.device_count()}`)."
        )


def check_stages(meshes: Sequence[Mesh]) -> None:
    """A value crossing processes between stages goes device to device (`send`), which
    needs the two stages to have as many devices."""
    sizes = [m.size for m in meshes]
    procs = [{d.process_index for d in m.devices.flat} for m in meshes]
    if any(
        sizes[i] != sizes[j] and len(procs[i] | procs[j]) > 1
        for i, j in itertools.combinations(range(len(meshes)), 2)
    ):
        raise ApplyError(
            f"the pipeline's stages have {sizes} devices and lie on different processes; "
            "under jax.distributed each device sends its shard to one device of the next "
            "stage, so the stages need equal device counts. Make a plan with equal stages "
            "(every searcher makes them)."
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
    """A value to slice shards from: numpy (of JAX's dtype for a Python scalar), except
    for PRNG keys, which numpy cannot hold."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    return np.asarray(x, dtype=leaf_dtype(x))


def _weak(x: Any) -> bool:
    # Python scalars trace as weakly typed; keeping that keeps the program (and so the
    # plan's fingerprint) the one traced from the arguments themselves.
    return bool(getattr(x, "weak_type", type(x) in (bool, int, float, complex)))


# ---- values between stages (pipelines) -----------------------------------------------

# The leading axis of a send's program: index 0 the sender's devices, 1 the receiver's.
_PAIR = "_send"


def is_global(x: Any, meshes: Sequence[Mesh]) -> bool:
    """Is `x` a global array (rather than this process's copy of host data)? Decided alike
    on every process: an array on another process's devices, or on one of `meshes`."""
    if not isinstance(x, jax.Array):
        return False
    sharding = x.sharding
    return not x.is_fully_addressable or (
        isinstance(sharding, NamedSharding) and any(sharding.mesh == m for m in meshes)
    )


def move(value: Any, sharding: NamedSharding, meshes: Sequence[Mesh]) -> jax.Array:
    """`value` laid out as `sharding`, a stage's, which may lie on other processes' devices.
    Every process calls it alike; `meshes` are the run's (see `is_global`)."""
    if not is_global(value, meshes):  # host data: each process places the shards it holds
        host, dtype = _host(value), leaf_dtype(value)  # a Python scalar's dtype as JAX's
        return jax.make_array_from_callback(
            leaf_shape(value), sharding, lambda i: host[i], dtype=dtype
        )
    if value.sharding.device_set == sharding.device_set:  # a reshard on the same devices
        return jax.device_put(value, sharding)
    procs = _processes(value.sharding) | _processes(sharding)
    if len(procs) == 1:  # inside one process: its own copy; the others hold no part of it
        if jax.process_index() in procs:
            return jax.device_put(value, sharding)
        return jax.make_array_from_single_device_arrays(
            value.shape, sharding, [], dtype=value.dtype
        )
    source = value.sharding
    if not isinstance(source, NamedSharding) or source.mesh.size != sharding.mesh.size:
        # Not from a stage of equal size (`check_stages`): a global array the caller made
        # on other devices. Each process gets it whole and places its shards.
        return move(_gather_leaf(value, meshes), sharding, meshes)
    return send(value, sharding)


def send(x: jax.Array, target: NamedSharding) -> jax.Array:
    """`x` on `target`'s devices, which other processes hold: a point-to-point send.

    The sender's and the receiver's devices form one "pair" mesh [2, *sender's mesh]
    (the receiver's devices in row-major order), `x` is read as the sender's half of an
    array on it (the receiver's half: fresh buffers, the receive buffers), and one
    collective-permute moves each device's shard to its partner (`send_program`). The
    receiver then holds `x` in the sender's layout, resharded on its own devices when
    `target` differs."""
    source = x.sharding  # a NamedSharding on a mesh of target's size (`move`)
    pair, arrival = _pair(source, target.mesh)
    program = send_program(source, target.mesh, x.shape, x.dtype)
    out = program(_lift(x, pair, (2, *x.shape)))
    mine = arrival.device_set
    arrived = jax.make_array_from_single_device_arrays(
        x.shape,
        arrival,
        [s.data[0] for s in out.addressable_shards if s.device in mine],
        dtype=x.dtype,
    )
    return jax.device_put(arrived, target)  # the same array when the layouts agree


@functools.cache
def send_program(
    source: NamedSharding, receiver: Mesh, shape: tuple[int, ...], dtype: Any
) -> jax.stages.Compiled:
    """The compiled send of a `shape` array laid out as `source` to `receiver`'s devices:
    index 0 of the pair axis to index 1, each device's shard to its partner."""
    pair, _ = _pair(source, receiver)

    def permute(block: Any) -> Any:
        return jax.lax.ppermute(block, _PAIR, [(0, 1)])

    program = jax.jit(
        jax.shard_map(permute, mesh=pair.mesh, in_specs=pair.spec, out_specs=pair.spec)
    )
    return program.lower(jax.ShapeDtypeStruct((2, *shape), dtype, sharding=pair)).compile()


def _pair(source: NamedSharding, receiver: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """The send's layout on the pair mesh, and the sender's layout on the receiver's
    devices (arranged as the sender's mesh), where the shards arrive."""
    a = source.mesh
    partner = Mesh(np.array(list(receiver.devices.flat)).reshape(a.devices.shape), a.axis_names)
    pair = Mesh(np.stack([a.devices, partner.devices]), (_PAIR, *a.axis_names))
    return (
        NamedSharding(pair, PartitionSpec(_PAIR, *source.spec)),
        NamedSharding(partner, source.spec),
    )


def _lift(x: jax.Array, sharding: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """An array of `shape` on `sharding`, whose every device holds a block [1, *a shard of
    x]: a device of x's its own shard, any other device zeros (a receive buffer). Each
    process makes the blocks of its devices; nothing moves."""
    mine = {s.device: s.data for s in x.addressable_shards}
    block = (1, *x.sharding.shard_shape(x.shape))
    blocks = [
        mine[d][None] if d in mine else jnp.zeros(block, x.dtype, device=d)
        for d in sharding.addressable_devices
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, blocks, dtype=x.dtype)


def gather(tree: Any, meshes: Sequence[Mesh]) -> Any:
    """Every leaf of `tree` whole, as numpy, on every process (every process calls it)."""
    return jax.tree.map(lambda x: _gather_leaf(x, meshes), tree)


def _gather_leaf(x: Any, meshes: Sequence[Mesh]) -> np.ndarray:
    if jax.process_count() == 1 or not is_global(x, meshes):
        return np.asarray(x)
    if len(_processes(x.sharding)) == jax.process_count():
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    # On some processes only: device k's shard as row k of a [devices, *shard] array on
    # every device (zeros where it holds none), gathered, then each shard put in place.
    everywhere = Mesh(np.array(jax.devices()), ("_devices",))
    shape = (everywhere.size, *x.sharding.shard_shape(x.shape))
    rows = _lift(x, NamedSharding(everywhere, PartitionSpec("_devices")), shape)
    rows = np.asarray(multihost_utils.process_allgather(rows, tiled=True))
    row_of = {d: k for k, d in enumerate(everywhere.devices.flat)}
    out = np.empty(x.shape, x.dtype)
    for d, index in x.sharding.devices_indices_map(x.shape).items():
        out[index] = rows[row_of[d]]
    return out


def _processes(sharding: Sharding) -> set[int]:
    return {d.process_index for d in sharding.device_set}
