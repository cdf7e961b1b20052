"""Clusters: device figures, node hierarchy, and how mesh axes map onto links.

The presets carry public figures (peak, HBM, bandwidths) from the brief's table; the
efficiency factors are ours, calibrated by `automap calibrate` where devices are at hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._errors import ClusterError
from ._lowering import Lowering
from ._presets import PRESETS
from ._slices import default_shape, generation, parse_topology, sub_slice


@dataclasses.dataclass(frozen=True)
class Link:
    """One mesh axis's collective link, per device and per direction."""

    bandwidth: float  # bytes/s each device can send on this axis (one direction)
    latency: float  # seconds per collective step (alpha)
    kind: str  # "intra" (NVLink/ICI), "inter" (network), "mixed" (spans both: the slower)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster of accelerators grouped into nodes."""

    name: str
    devices: int
    devices_per_node: int
    """Devices sharing the fast intra-node link (8 GPUs per node; the whole slice on TPU)."""
    peak_flops: float
    """Dense bf16 (v100: fp16) peak per device, FLOP/s."""
    hbm_bytes: float
    """Device memory, bytes."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_bandwidth: float
    """Per-device, per-direction intra-node link bandwidth, bytes/s (NVLink: half the
    both-directions figure)."""
    inter_bandwidth: float
    """Per-device, per-direction network bandwidth, bytes/s (the node's NICs shared by its
    devices)."""
    intra_latency: float = 5e-6
    """Seconds per step of a collective on the intra-node link."""
    inter_latency: float = 15e-6
    """Seconds per step of a collective across nodes."""
    matmul_efficiency: float = 0.6
    """Fraction of peak that the largest well-shaped matmuls reach (a measured maximum
    where the preset cites one); a product's shape can only lower it (`matmul_tile`)."""
    matmul_tile: int = 1
    """Elements a matmul's M, N and K are tiled by on the matrix units: a product runs as
    if each were rounded up to it (`_cost/_gemm.py`); 1: no tiling."""
    memory_efficiency: float = 0.8
    """Fraction of HBM bandwidth that memory-bound ops reach."""
    comm_efficiency: float = 0.8
    """Fraction of link bandwidth that collectives reach (bus bandwidth / link bandwidth)."""
    memory_reserve: float = 0.1
    """Fraction of HBM kept free for the runtime, workspace and fragmentation."""
    ici_link_bandwidth: float = 0.0
    """TPUs: bytes/s one ICI link carries in one direction (0: no torus, axes priced flat)."""
    ici_ports: int = 0
    """TPUs: ICI links per chip (4 on a 2-D torus, 6 on a 3-D one)."""
    topology: tuple[int, ...] = ()
    """TPUs: chips per torus dimension of one slice ((4, 4, 4): v5p-128); () for none.
    With it a slice is a node (`devices_per_node`), mesh axes are laid on the torus as
    JAX lays them and priced by the dimensions they span (`_cost/_torus.py`)."""
    slices: int = 1
    """TPUs: slices joined by the data-centre network (`inter_bandwidth` per chip)."""
    lowering: Lowering = dataclasses.field(default_factory=Lowering.gpu)
    """How XLA compiles for these devices (`Lowering`): the GPU pipeline's on every GPU
    preset, the TPU's on the TPU ones, the CPU's on `cpu`. A cluster file names it (`lowering: cpu`), gives its
    fields (`lowering: {reduce_scatter: false}`), or, as files before it did, gives those
    fields at the top level."""

    # ---- construction -----------------------------------------------------------------

    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(PRESETS)

    @classmethod
    def preset(cls, name: str, devices: int | None = None, **overrides: Any) -> Cluster:
        """The preset `name` for `devices` (default 8). A TPU preset takes `topology` (chips
        per torus dimension, "4x4x4", or a slice name, "v5p-128") and `slices` (joined by
        DCN); without a topology, a power-of-two count of chips per slice is laid as
        Google's slice of that size (`_slices.default_shape`)."""
        key = name.lower()
        if key not in PRESETS:
            raise ClusterError(
                f"unknown cluster preset {name!r}; choose one of {', '.join(PRESETS)} "
                "or load a cluster file with Cluster.from_file."
            )
        fields = dict(PRESETS[key])
        base = fields.pop("lowering", Lowering.gpu())
        fields.update(overrides)
        fields["lowering"] = _lowering_from(fields, base, f"cluster preset {key}")
        per_node = _field_value("devices_per_node", fields.pop("devices_per_node", 8))
        if gen := generation(key):
            devices, per_node, fields = _on_slices(gen, devices, per_node, fields)
        elif fields.get("topology") or fields.get("slices", 1) != 1:
            raise ClusterError(
                f"cluster preset {key} is no TPU: a topology and slices are for "
                f"{', '.join(p for p in PRESETS if generation(p))}."
            )
        devices = _field_value("devices", 8 if devices is None else devices)
        return cls(
            name=key, devices=devices, devices_per_node=min(per_node, devices), **fields
        )._checked()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "cluster") -> Cluster:
        d = dict(d)
        base = d.pop("preset", None)
        try:
            if base is not None:
                preset_lowering = PRESETS.get(str(base).lower(), {}).get("lowering")
                d["lowering"] = _lowering_from(d, preset_lowering or Lowering.gpu(), source)
                return cls.preset(str(base), **d)
            names = {f.name for f in dataclasses.fields(cls)}
            # A lowering's fields at the top level: files from before `lowering` give them so.
            unknown = set(d) - names - set(Lowering.field_names())
            if unknown:
                raise ClusterError(
                    f"{source}: unknown field(s) {sorted(unknown)}; known: {sorted(names)} "
                    f"and the lowering's {sorted(Lowering.field_names())}."
                )
            d["lowering"] = _lowering_from(d, Lowering.gpu(), source)
            return cls(**d)._checked()
        except TypeError as e:
            raise ClusterError(f"{source} is not a valid cluster description: {e}.") from None

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """A cluster from a YAML or JSON file of fields (and an optional `preset` to start
        from). Numbers are plain numbers in the field's unit (bytes, FLOP/s, seconds); a
        string that reads as one is taken as that number, since PyYAML reads `312e12`
        (no dot) as a string; anything else, or a value out of range, is a ClusterError
        naming the field, the type and the range. The compiler's behaviour is `lowering:`, a
        name (gpu, cpu) or a mapping of `Lowering` fields; those fields at the top level (as
        files were written before `lowering`) are set on it."""
        path = Path(path)
        if not path.exists():
            raise ClusterError(f"no cluster file at {path}: check the path.")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                raw = yaml.safe_load(text)
            else:
                raw = json.loads(text)
        except Exception as e:  # any parse error means the same to the user
            raise ClusterError(f"{path} could not be parsed ({e}).") from None
        if not isinstance(raw, Mapping):
            raise ClusterError(f"{path} must hold a mapping of cluster fields.")
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_devices(self, devices: int) -> Cluster:
        """This cluster cut to `devices` (a pipeline stage's share): on a TPU torus whole
        slices, or a sub-slice of one (`_slices.sub_slice`)."""
        if self.topology and devices != self.devices:
            gen = generation(self.name) or ("v5p" if len(self.topology) == 3 else "v5e")
            chips = self.devices_per_node
            dims = self.topology if devices >= chips else sub_slice(self.topology, devices, gen)
            return dataclasses.replace(
                self,
                devices=devices,
                devices_per_node=math.prod(dims),
                topology=dims,
                slices=max(1, devices // chips),
            )._checked()
        return dataclasses.replace(
            self, devices=devices, devices_per_node=min(self.devices_per_node, devices)
        )._checked()

    def with_lowering(self, **changes: Any) -> Cluster:
        """This cluster with some of its lowering's fields changed: a what-if, the price of
        one compiler rule (`with_lowering(reduce_scatter=False)`)."""
        unknown = set(changes) - set(Lowering.field_names())
        if unknown:
            raise ClusterError(
                f"unknown lowering field(s) {sorted(unknown)}; known: "
                f"{sorted(Lowering.field_names())}."
            )
        return dataclasses.replace(
            self, lowering=dataclasses.replace(self.lowering, **changes)
        )._checked()

    def _checked(self) -> Cluster:
        checked = {r.name: _field_value(r.name, getattr(self, r.name)) for r in _FIELD_RULES}
        lowering = _checked_lowering(self.lowering)
        if lowering is not self.lowering or any(
            checked[k] is not getattr(self, k) for k in checked
        ):
            # A number written as a string ("312e12": YAML reads 312e12 without a dot so).
            return dataclasses.replace(self, lowering=lowering, **checked)._checked()
        topology = _checked_topology(self) if self.topology else ()
        if topology != self.topology:  # a list (JSON) or "4x4x4" (YAML)
            return dataclasses.replace(self, topology=topology)._checked()
        if not isinstance(self.name, str) or not self.name:
            raise ClusterError(f"cluster field name must be a non-empty string, got {self.name!r}.")
        if self.devices < 1:
            raise ClusterError(f"a cluster needs at least one device, got {self.devices}.")
        if self.devices > self.devices_per_node and self.devices % self.devices_per_node:
            raise ClusterError(
                f"{self.devices} devices do not fill whole nodes of {self.devices_per_node}; "
                f"use a multiple of {self.devices_per_node}."
            )
        return self

    # ---- derived figures --------------------------------------------------------------

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.devices_per_node)

    @property
    def memory_limit(self) -> float:
        """Usable bytes per device."""
        return self.hbm_bytes * (1.0 - self.memory_reserve)

    def axis_links(self, mesh: Mapping[str, int]) -> dict[str, Link]:
        """The link each mesh axis runs on.

        Devices are laid out in row-major mesh order (the last axis varies fastest), the
        order `jax.make_mesh` uses: an axis whose devices all sit in one node runs on the
        intra-node link, an axis whose stride is a whole node runs on the network, and an
        axis that spans both is as slow as its slowest hop.
        """
        sizes = list(mesh.values())
        if math.prod(sizes) > self.devices:
            raise ClusterError(
                f"mesh {dict(mesh)} needs {math.prod(sizes)} devices; the cluster has "
                f"{self.devices}."
            )
        links: dict[str, Link] = {}
        stride = 1
        for name, size in reversed(list(mesh.items())):
            span = stride * size
            if size == 1 or span <= self.devices_per_node:
                links[name] = Link(self.intra_bandwidth, self.intra_latency, "intra")
            elif stride >= self.devices_per_node:
                links[name] = Link(self.inter_bandwidth, self.inter_latency, "inter")
            else:
                links[name] = Link(self.inter_bandwidth, self.inter_latency, "mixed")
            stride = span
        return {name: links[name] for name in mesh}


@dataclasses.dataclass(frozen=True)
class _Rule:
    """The type and range a cluster field must have, for a message that names both."""

    name: str
    kind: type  # int or float
    low: float  # the least allowed value
    low_open: bool = False  # True: the value must be greater than `low`
    high: float = math.inf
    unit: str = ""

    def text(self) -> str:
        low = f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        high = "" if math.isinf(self.high) else f" and <= {self.high:g}"
        unit = f" ({self.unit})" if self.unit else ""
        return f"{'an integer' if self.kind is int else 'a number'}{unit} {low}{high}"


_FIELD_RULES = (
    _Rule("devices", int, 1),
    _Rule("devices_per_node", int, 1),
    _Rule("peak_flops", float, 0.0, low_open=True, unit="FLOP/s"),
    _Rule("hbm_bytes", float, 0.0, low_open=True, unit="bytes"),
    *(
        _Rule(name, float, 0.0, low_open=True, unit="bytes/s")
        for name in ("hbm_bandwidth", "intra_bandwidth", "inter_bandwidth")
    ),
    _Rule("intra_latency", float, 0.0, unit="seconds"),
    _Rule("inter_latency", float, 0.0, unit="seconds"),
    *(
        _Rule(name, float, 0.0, low_open=True, high=1.0)
        for name in ("matmul_efficiency", "memory_efficiency", "comm_efficiency")
    ),
    _Rule("memory_reserve", float, 0.0, high=0.99),
    _Rule("ici_link_bandwidth", float, 0.0, unit="bytes/s"),
    _Rule("ici_ports", int, 0),
    _Rule("matmul_tile", int, 1),
    _Rule("slices", int, 1),
)
# The lowering's numbers (its other fields are true or false).
_LOWERING_RULES = (
    _Rule("collective_float_bytes", int, 0, high=8),
    _Rule("all_reduce_combine_bytes", float, 0.0, unit="bytes"),
)


def _lowering_from(fields: dict[str, Any], base: Lowering, source: str) -> Lowering:
    """The lowering `fields` describe, its entries taken out of `fields`: `lowering` a
    `Lowering`, a preset name (`cpu`) or a mapping of fields set on `base` (the cluster
    preset's), then any lowering field given at the top level (as files before `lowering`
    were written) set on that."""
    value = fields.pop("lowering", base)
    flat = {k: fields.pop(k) for k in Lowering.field_names() if k in fields}
    if isinstance(value, str):
        try:
            lowering = Lowering.preset(value)
        except ClusterError as e:
            raise ClusterError(f"{source}: {e}") from None
    elif isinstance(value, Lowering):
        lowering = value
    elif isinstance(value, Mapping):
        unknown = set(value) - set(Lowering.field_names())
        if unknown:
            raise ClusterError(
                f"{source}: unknown lowering field(s) {sorted(unknown)}; known: "
                f"{sorted(Lowering.field_names())}."
            )
        lowering = dataclasses.replace(base, **value)
    else:
        raise ClusterError(
            f"{source}: lowering must be one of {', '.join(Lowering.presets())} or a mapping "
            f"of its fields, got {value!r}; e.g. lowering: cpu."
        )
    return dataclasses.replace(lowering, **flat) if flat else lowering


def _on_slices(
    gen: str, devices: int | None, per_node: int, fields: dict[str, Any]
) -> tuple[int | None, int, dict[str, Any]]:
    """A TPU preset's devices, chips per slice and fields: the slice's torus from
    `topology` (or, for a power-of-two count of chips per slice, Google's slice of that
    size), `slices` of it."""
    slices = _field_value("slices", fields.pop("slices", 1))
    topology = fields.pop("topology", None)
    if topology is None or topology == ():
        count = 8 if devices is None else _field_value("devices", devices)
        chips = count // slices
        if count % slices or chips < 1 or chips & (chips - 1):
            return devices, per_node, fields  # no standard slice: priced flat
        dims = default_shape(chips, gen)
    else:
        dims = parse_topology(topology, gen)
        want = slices * math.prod(dims)
        if devices is not None and _field_value("devices", devices) != want:
            raise ClusterError(
                f"{slices} slice(s) of {'x'.join(map(str, dims))} are {want} chips, not "
                f"{devices}: give --devices {want}, or leave it out."
            )
        devices = want
    return devices, math.prod(dims), {**fields, "topology": dims, "slices": slices}


def _checked_topology(cluster: Cluster) -> tuple[int, ...]:
    """`cluster.topology` as a tuple of chips per dimension, filling its slices exactly."""
    gen = generation(cluster.name) or {3: "v5p", 2: "v5e"}.get(len(cluster.topology), "v5p")
    dims = parse_topology(cluster.topology, gen)
    chips = math.prod(dims)
    if cluster.devices_per_node != chips or cluster.devices != chips * cluster.slices:
        raise ClusterError(
            f"topology {'x'.join(map(str, dims))} is {chips} chips per slice: a cluster of "
            f"{cluster.slices} slice(s) has devices_per_node {chips} and devices "
            f"{chips * cluster.slices}, not {cluster.devices_per_node} and {cluster.devices}."
        )
    return dims


def _checked_lowering(lowering: Any) -> Lowering:
    """`lowering` with each field checked: its switches true or false, its numbers as
    `_field_value` takes them (a new Lowering where a string became a number)."""
    if not isinstance(lowering, Lowering):
        raise ClusterError(
            f"cluster field lowering must be a Lowering (Lowering.gpu(), Lowering.cpu()), "
            f"got {lowering!r}."
        )
    for flag in Lowering.switches():
        if not isinstance(getattr(lowering, flag), bool):
            raise ClusterError(
                f"cluster field {flag} must be true or false, got {getattr(lowering, flag)!r}."
            )
    numbers = {r.name: _field_value(r.name, getattr(lowering, r.name)) for r in _LOWERING_RULES}
    if any(numbers[k] is not getattr(lowering, k) for k in numbers):
        return dataclasses.replace(lowering, **numbers)
    return lowering


def _field_value(name: str, value: Any) -> Any:
    """`value` checked against its field's rule; a numeric string (PyYAML reads `312e12`
    as one) becomes its number, anything else that is not a finite number in range is a
    ClusterError naming the field, the type and the allowed range."""
    rule = next(r for r in (*_FIELD_RULES, *_LOWERING_RULES) if r.name == name)
    number = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    bad_type = isinstance(number, bool) or not isinstance(number, (int, float))
    bad_type = bad_type or math.isnan(number)
    # An integer field takes whole numbers only; a float field may be +inf where its range
    # allows it (links that cost nothing: an idealized cluster for a what-if).
    if not bad_type and rule.kind is int:
        bad_type = not math.isfinite(number) or number != int(number)
    if bad_type:
        raise ClusterError(
            f"cluster field {name} must be {rule.text()}, got {value!r} "
            f"({type(value).__name__}); e.g. {name}: {_example(name)}"
            + (" (a plain number, no units)." if isinstance(value, str) else ".")
        )
    in_range = (number > rule.low if rule.low_open else number >= rule.low) and (
        number <= rule.high
    )
    if not in_range:
        raise ClusterError(
            f"cluster field {name} must be {rule.text()}, got {number:g}; "
            f"e.g. {name}: {_example(name)}."
        )
    if isinstance(value, str) or (rule.kind is int and not isinstance(value, int)):
        return int(number) if rule.kind is int else float(number)
    return value  # ints stay ints in float fields: the figures print as they were written


def _example(name: str) -> Any:
    """A plausible value for a field, for the error message: the a100 preset's."""
    if name in PRESETS["a100"]:
        return f"{PRESETS['a100'][name]:g}"
    fields = (*dataclasses.fields(Cluster), *dataclasses.fields(Lowering))
    default = next(f.default for f in fields if f.name == name)
    return 8 if default is dataclasses.MISSING else default
