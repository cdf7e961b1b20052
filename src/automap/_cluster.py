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

GB = 1e9


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
    """Fraction of peak that large matmuls and convolutions reach."""
    memory_efficiency: float = 0.8
    """Fraction of HBM bandwidth that memory-bound ops reach."""
    comm_efficiency: float = 0.8
    """Fraction of link bandwidth that collectives reach (bus bandwidth / link bandwidth)."""
    memory_reserve: float = 0.1
    """Fraction of HBM kept free for the runtime, workspace and fragmentation."""
    lowering: Lowering = dataclasses.field(default_factory=Lowering.gpu)
    """How XLA compiles for these devices (`Lowering`): the GPU pipeline's on every GPU and
    TPU preset, the CPU's on `cpu`. A cluster file names it (`lowering: cpu`), gives its
    fields (`lowering: {reduce_scatter: false}`), or, as files before it did, gives those
    fields at the top level."""

    # ---- construction -----------------------------------------------------------------

    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str, devices: int = 8, **overrides: Any) -> Cluster:
        key = name.lower()
        if key not in _PRESETS:
            raise ClusterError(
                f"unknown cluster preset {name!r}; choose one of {', '.join(_PRESETS)} "
                "or load a cluster file with Cluster.from_file."
            )
        fields = dict(_PRESETS[key])
        base = fields.pop("lowering", Lowering.gpu())
        fields.update(overrides)
        fields["lowering"] = _lowering_from(fields, base, f"cluster preset {key}")
        per_node = _field_value("devices_per_node", fields.pop("devices_per_node", 8))
        devices = _field_value("devices", devices)
        return cls(
            name=key, devices=devices, devices_per_node=min(per_node, devices), **fields
        )._checked()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "cluster") -> Cluster:
        d = dict(d)
        base = d.pop("preset", None)
        try:
            if base is not None:
                preset_lowering = _PRESETS.get(str(base).lower(), {}).get("lowering")
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
    if name in _PRESETS["a100"]:
        return f"{_PRESETS['a100'][name]:g}"
    fields = (*dataclasses.fields(Cluster), *dataclasses.fields(Lowering))
    default = next(f.default for f in fields if f.name == name)
    return 8 if default is dataclasses.MISSING else default


# Public figures from the brief; per-direction link bandwidths are half the
# both-directions NVLink figure; network per device is the node's NICs / 8 GPUs.
_PRESETS: dict[str, dict[str, Any]] = {
    "v100": dict(
        peak_flops=125e12,
        hbm_bytes=32 * GB,
        hbm_bandwidth=0.9e12,
        intra_bandwidth=150 * GB,
        inter_bandwidth=4 * 100e9 / 8 / 8,
    ),
    "a100": dict(
        peak_flops=312e12,
        hbm_bytes=80 * GB,
        hbm_bandwidth=2.0e12,
        intra_bandwidth=300 * GB,
        inter_bandwidth=8 * 200e9 / 8 / 8,
    ),
    "h100": dict(
        peak_flops=989e12,
        hbm_bytes=80 * GB,
        hbm_bandwidth=3.35e12,
        intra_bandwidth=450 * GB,
        inter_bandwidth=8 * 400e9 / 8 / 8,
    ),
    "h200": dict(
        peak_flops=989e12,
        hbm_bytes=141 * GB,
        hbm_bandwidth=4.8e12,
        intra_bandwidth=450 * GB,
        inter_bandwidth=8 * 400e9 / 8 / 8,
    ),
    # TPU v4: 275 TFLOP/s bf16, 32 GiB HBM at 1.2 TB/s; ICI links inside a slice are
    # treated as one "node" (a 3D torus has no slow tier inside a slice). Compiled as a
    # GPU is (the default `Lowering.gpu()`) until a TPU lowering is measured.
    "tpu-v4": dict(
        peak_flops=275e12,
        hbm_bytes=32 * 2**30,
        hbm_bandwidth=1.2e12,
        intra_bandwidth=135 * GB,
        inter_bandwidth=25 * GB,
        devices_per_node=4096,
    ),
    # The local CPU (virtual devices): modest figures, recalibrate with `automap calibrate`.
    "cpu": dict(
        peak_flops=50e9,
        hbm_bytes=4 * GB,
        hbm_bandwidth=10 * GB,
        intra_bandwidth=5 * GB,
        inter_bandwidth=5 * GB,
        devices_per_node=4096,
        matmul_efficiency=0.5,
        memory_efficiency=0.5,
        comm_efficiency=0.5,
        lowering=Lowering.cpu(),
    ),
}
