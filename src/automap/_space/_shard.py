"""The plan space a searcher explores, with the pruning that makes it small.

The operator-partitioning space is a mesh choice followed by one decision per unit (a
linkage group, or with layer grouping one class of groups repeated across layers): keep it
whole, or split it on the "data" or the "model" axis. A ZeRO stage closes the episode
when the data axis exists (the replication task). Every pruning is a switch so that a
benchmark can measure the space with it off:

- linkage groups: one decision per group instead of per tensor dimension;
- layer grouping: one decision per class of repeated layers;
- action masks: an axis that does not divide a group, or an axis already used by a group
  that shares a tensor with this one (one axis twice in one tensor), is masked;
- mesh symmetry: the model axis is the inner (intra-node) one, never the outer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .._axes import DATA, MODEL
from .._cluster import Cluster
from .._cost import CostModel
from .._graph import Graph
from .._groups import Groups, group_partners, plan_from_assignment
from .._plan import Cost, Plan

OPTIONS = (None, DATA, MODEL)
ZERO_STAGES = (0, 1, 2, 3)
SPACE_TASKS = ("shard", "replicate")


@dataclasses.dataclass(frozen=True)
class Pruning:
    """Which prunings are on; all on by default."""

    layer_grouping: bool = True
    """One decision per class of repeated layers instead of one per group."""
    masks: bool = True
    """Mask axes that do not divide a group or that a co-occurring group already took."""
    symmetry: bool = True
    """Consider each (data, model) factorization once, model axis inside the node."""
    zero: bool = True
    """Offer ZeRO stages 1-3 as the last decision when there is a data axis."""


@dataclasses.dataclass(frozen=True)
class Unit:
    """One decision: the groups it sets together, and its features."""

    groups: tuple[int, ...]
    divisor: int  # gcd of the groups' divisors
    bytes: float
    flops: float
    params: bool  # holds parameter dimensions
    batch: bool  # holds the batch dimension
    position: float  # where in the program it first appears, 0..1


def candidate_meshes(devices: int, symmetry: bool = True) -> list[dict[str, int]]:
    """Two-axis meshes data x model (axes of size 1 left out), model inner by default."""
    meshes: list[dict[str, int]] = []
    for model in range(1, devices + 1):
        if devices % model:
            continue
        data = devices // model
        mesh = {DATA: data, MODEL: model}
        meshes.append({k: v for k, v in mesh.items() if v > 1} or {DATA: 1})
        if not symmetry and data > 1 and model > 1:
            meshes.append({MODEL: model, DATA: data})  # model axis outer: across nodes
    return meshes


def build_units(graph: Graph, groups: Groups, layer_grouping: bool) -> list[Unit]:
    """Decision units in program order (a CNN's convolution batch first); groups that can
    never be split are left out."""
    first_tensor = {g.id: min(t for t, _ in g.members) for g in groups.groups}
    key_of = {}
    for g in groups.groups:
        if g.conflicted or g.divisor <= 1:
            continue
        key_of[g.id] = g.layer_class if layer_grouping else -1 - g.id
    by_class: dict[int, list[int]] = {}
    for gid, key in key_of.items():
        by_class.setdefault(key, []).append(gid)
    partners = group_partners(groups, set(key_of))
    n_tensors = max(1, len(graph.tensors))
    units = []
    for gids in (
        b for members in by_class.values() for b in _colour(members, partners, first_tensor)
    ):
        gs = [groups.groups[i] for i in sorted(gids)]
        units.append(
            Unit(
                groups=tuple(g.id for g in gs),
                divisor=math.gcd(*[g.divisor for g in gs]),
                bytes=float(sum(g.bytes for g in gs)),
                flops=float(sum(g.flops for g in gs)),
                params=any(g.param_dims for g in gs),
                batch=any(g.batch for g in gs),
                position=min(first_tensor[g.id] for g in gs) / n_tensors,
            )
        )
    # The convolutions' batch goes first: a seam's dense side is then decided after it and
    # always has an option (none), whatever order a searcher decides units in.
    conv = {c for c, _ in groups.seam_pairs()}
    units.sort(key=lambda u: (not conv.intersection(u.groups), u.position, u.groups))
    return units


def _colour(
    members: list[int], partners: dict[int, set[int]], first: dict[int, int]
) -> list[list[int]]:
    """Split one layer class into buckets whose groups never share a tensor.

    Consecutive layers of one width (an MLP chain, a VGG block) fall in one class, but a
    weight between them holds both their groups: one decision for both would put one axis
    twice on that weight. Greedy colouring in program order keeps every other layer
    together, which is also Megatron's column/row alternation.
    """
    buckets: list[list[int]] = []
    for gid in sorted(members, key=lambda g: (first[g], g)):
        for bucket in buckets:
            if not partners[gid].intersection(bucket):
                bucket.append(gid)
                break
        else:
            buckets.append([gid])
    return buckets


def _cooccurrence(groups: Groups, units: Sequence[Unit]) -> list[set[int]]:
    """For each unit, the other units whose groups share a tensor with it."""
    unit_of = {gid: i for i, u in enumerate(units) for gid in u.groups}
    out: list[set[int]] = [set() for _ in units]
    for tensor_groups in groups.tensor_groups:
        present = {unit_of[g] for g in tensor_groups if g in unit_of}
        for u in present:
            out[u] |= present - {u}
    return out


class ShardSpace:
    """Mesh, then one option per unit, then (optionally) a ZeRO stage; see module doc."""

    def __init__(
        self,
        graph: Graph,
        groups: Groups,
        cluster: Cluster,
        cost_model: CostModel,
        pruning: Pruning = Pruning(),
        task: str = "shard",
    ):
        self.graph, self.groups, self.cluster, self.cost_model = graph, groups, cluster, cost_model
        self.pruning = pruning
        if task not in SPACE_TASKS:
            raise ValueError(f"unknown space task {task!r}; this space serves {SPACE_TASKS}")
        self.task = task
        # The replication task is data parallelism alone: which dimensions go on the data
        # axis (the batch, found by the search) and which ZeRO stage.
        self.meshes = (
            candidate_meshes(cluster.devices, pruning.symmetry)
            if task == "shard"
            else [{DATA: cluster.devices}]
        )
        self.units = build_units(graph, groups, pruning.layer_grouping)
        self.neighbours = _cooccurrence(groups, self.units)
        unit_of = {g: u for u, unit in enumerate(self.units) for g in unit.groups}
        # (convolutions' batch unit, the dense side's) of each seam: the dense side splits
        # only on the convolutions' axis, or not at all. The rest (convolutions whole or on
        # another axis) is never faster, and there XLA carries the dense split back into
        # the convolutions' backward pass, which the cost model does not price.
        self.seam_units = tuple(
            (unit_of[c], unit_of[o])
            for c, o in groups.seam_pairs()
            if c in unit_of and o in unit_of and unit_of[c] != unit_of[o]
        )
        # The unit of the step's batch (its first batch group's): ZeRO needs it on data.
        first = groups.batch_groups[0] if groups.batch_groups else None
        self.batch_unit = unit_of.get(first) if first is not None else None

    # ---- the space ----------------------------------------------------------------------

    def allowed(self, mesh: dict[str, int], unit: int, taken: Sequence[int | None]) -> np.ndarray:
        """Bool mask over OPTIONS for `unit`, given the options of units decided before."""
        ok = np.ones(len(OPTIONS), bool)
        for k, axis in enumerate(OPTIONS):
            if axis is None:
                continue
            size = mesh.get(axis, 1)
            if size <= 1:
                ok[k] = False  # an axis the mesh does not have
            elif self.pruning.masks and self._masked(unit, k, size, taken):
                ok[k] = False
        if self.pruning.masks:
            codes = np.arange(len(OPTIONS))
            for conv, dense in self.seam_units:
                if unit == dense and conv < len(taken) and taken[conv] is not None:
                    ok &= (codes == 0) | (codes == taken[conv])
                elif unit == conv and dense < len(taken) and taken[dense]:
                    ok &= codes == taken[dense]
        return ok

    def _masked(self, unit: int, option: int, size: int, taken: Sequence[int | None]) -> bool:
        if self.units[unit].divisor % size:
            return True  # the axis does not divide every dimension of the unit
        # One mesh axis twice in one tensor: a co-occurring unit already took it.
        return any(v < len(taken) and taken[v] == option for v in self.neighbours[unit])

    def zero_options(
        self, mesh: dict[str, int], options: Sequence[int | None] | None = None
    ) -> tuple[int, ...]:
        """The ZeRO stages a point on `mesh` may take (with its `options`, per unit, when
        known): 1-3 only where the mesh has a data axis and the batch is on it. ZeRO
        shards over the data-parallel axis; pinned to a data split the batch does not
        take, XLA compiles other collectives than the cost model prices (3-5x its bytes
        on `benchmarks/bench_memory.py`'s plans), so those points are not searched."""
        size = mesh.get(DATA, 1)
        if not self.pruning.zero or size <= 1:
            return (0,)
        u = self.batch_unit
        if u is not None and self.units[u].divisor % size:
            return (0,)  # the batch cannot take the data axis on this mesh
        if options is not None and not self.batch_on_data(options):
            return (0,)
        return ZERO_STAGES

    def batch_on_data(self, options: Sequence[int | None]) -> bool:
        """Whether the point's options put the step's batch on the data axis (True for a
        step without a batch unit)."""
        u = self.batch_unit
        return u is None or (
            u < len(options) and options[u] is not None and OPTIONS[options[u]] == DATA
        )

    def size(self) -> int:
        """Number of complete decision sequences, counting masks exactly (by DFS for small
        spaces, an upper bound past ~1e6 per mesh)."""
        return sum(self._count(mesh, [], cap=10**6) for mesh in self.meshes)

    def exact_size(self, cap: int) -> int | None:
        """The number of points when every mesh has at most `cap` option sequences to count
        (a small space), else None. A search that has seen this many distinct points
        (`contains`) has seen them all."""
        total = 0
        for mesh in self.meshes:
            per_unit = [int(self.allowed(mesh, u, []).sum()) for u in range(len(self.units))]
            if math.prod(per_unit) > cap or not self.pruning.masks:
                return None
            total += self._count(mesh, [], cap)
        return total

    def contains(self, point: tuple[int, Sequence[int], int]) -> bool:
        """Whether (mesh index, options, ZeRO stage) is one of the points `size` counts."""
        mesh_index, options, zero = point
        mesh = self.meshes[mesh_index]
        return (
            len(options) == len(self.units)
            and all(self.allowed(mesh, u, list(options[:u]))[k] for u, k in enumerate(options))
            and zero in self.zero_options(mesh, options)
        )

    def _count(self, mesh: dict[str, int], taken: list[int | None], cap: int) -> int:
        """Points of the mesh: option sequences times the ZeRO stages each may take."""
        per_unit = [int(self.allowed(mesh, u, []).sum()) for u in range(len(self.units))]
        if math.prod(per_unit) > cap or not self.pruning.masks:
            return math.prod(per_unit) * len(self.zero_options(mesh))
        count = 0
        stack = [(0, [])]
        while stack:
            depth, chosen = stack.pop()
            if depth == len(self.units):
                count += len(self.zero_options(mesh, chosen))
                continue
            mask = self.allowed(mesh, depth, chosen)
            stack.extend((depth + 1, [*chosen, k]) for k in np.flatnonzero(mask))
        return count

    # ---- from decisions to plans and costs ------------------------------------------------

    def assignment(self, options: Sequence[int]) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        for unit, k in zip(self.units, options, strict=True):
            for gid in unit.groups:
                out[gid] = OPTIONS[k]
        return out

    def evaluate(self, mesh_index: int, options: Sequence[int], zero_stage: int = 0) -> Cost:
        mesh = self.meshes[mesh_index]
        return self.cost_model.evaluate(self.assignment(options), mesh, zero_stage=zero_stage)

    def to_plan(self, mesh_index: int, options: Sequence[int], zero_stage: int, name: str) -> Plan:
        mesh = self.meshes[mesh_index]
        plan = plan_from_assignment(
            self.graph,
            self.groups,
            mesh,
            self.assignment(options),
            name=name,
            zero_stage=zero_stage,
        )
        return dataclasses.replace(plan, predicted=self.cost_model.estimate(plan))
