"""The plan and its predicted cost: plain frozen data, saved as JSON.

A plan says *what* to do (mesh, a PartitionSpec per input leaf, constraints at internal
tensors, pipeline stages, microbatches, ZeRO stage); `apply` says *how*. Keeping them
apart lets every searcher produce the same thing and lets a plan travel as a file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from ._axes import PIPE
from ._errors import PlanError
from ._version import PLAN_SCHEMA_VERSION, READABLE_PLAN_SCHEMAS, __version__

# One entry per tensor dimension: the mesh axis that splits it, several axes, or None.
SpecEntry = str | tuple[str, ...] | None
Spec = tuple[SpecEntry, ...]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective the plan implies, summed over the step."""

    kind: str  # "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
    axis: str  # mesh axis name (or "+"-joined names for a collective over several axes)
    bytes: float  # bytes per device entering the collective, summed over all its occurrences
    count: int  # how many times it happens in one step
    time_s: float  # predicted time, summed


@dataclasses.dataclass(frozen=True)
class Cost:
    """Predicted cost of one training step on one device (the slowest one)."""

    step_time_s: float
    compute_s: float
    # seconds of communication on the critical path: the collectives' `time_s`, less what
    # the backend runs beside compute (`Lowering.overlaps_prefetch`, `_cost/_overlap.py`)
    comm_s: float
    bubble_s: float
    memory_bytes: float  # peak per device
    mfu: float  # model FLOPs utilization: useful flops / (step time x peak x devices)
    feasible: bool = True
    reason: str = ""  # why not feasible, in words
    memory_limit_bytes: float = math.inf
    # Peak memory split: "params", "grads", "opt_state", "activations", "other", "outputs".
    # Where the peak is the gradients' reduction on a backend that does not reduce in
    # place (`Lowering.all_reduce_in_place`), "grads" holds both copies, "activations" none.
    # Where one-stage steps are scheduled (`Lowering.frees_at_last_use`), "activations" is
    # every buffer alive at the busiest moment (gradients in flight included) and "grads"
    # the reduced gradients held then; at the reduction, the gradients and their copy.
    # "outputs": the step's outputs held apart from its arguments at the peak (a step that
    # donates nothing writes its new state beside the old: `_cost/_outputs.py`).
    memory_breakdown: Mapping[str, float] = dataclasses.field(default_factory=dict)
    collectives: tuple[Collective, ...] = ()
    # Per-op (op index, compute seconds, communication seconds); not saved in plan files.
    per_op: tuple[tuple[int, float, float], ...] = dataclasses.field(
        default=(), compare=False, repr=False
    )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("per_op")
        # Plain JSON types even when a cost was computed with numpy scalars.
        d["feasible"] = bool(self.feasible)
        for key in ("step_time_s", "compute_s", "comm_s", "bubble_s", "memory_bytes", "mfu"):
            d[key] = float(d[key])
        d["memory_breakdown"] = {k: float(v) for k, v in self.memory_breakdown.items()}
        d["memory_limit_bytes"] = _finite_or_none(self.memory_limit_bytes)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cost:
        d = dict(d)
        d["collectives"] = tuple(Collective(**c) for c in d.get("collectives", ()))
        limit = d.get("memory_limit_bytes")
        d["memory_limit_bytes"] = math.inf if limit is None else float(limit)
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous range of the graph's ops on its own sub-mesh."""

    op_start: int  # first op index (inclusive)
    op_stop: int  # last op index (exclusive)
    devices: tuple[int, ...]  # indices into jax.devices()
    mesh: Mapping[str, int]  # the stage's sub-mesh: axis name -> size


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where a plan came from: enough to rebuild the step and to refuse a wrong program."""

    searcher: str = ""
    seed: int = 0
    search_time_s: float = 0.0
    version: str = __version__
    fingerprint: str = ""  # Graph.fingerprint of the program the plan was made for
    model: str | None = None  # zoo model name, if made for one
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fn: str | None = None  # "package.module:function" for --fn plans
    cluster: str = ""
    devices: int = 0
    batch: int | None = None  # the batch size it was made for (Graph.batch_rows), if known
    # What the search could not do on this program and why, in words (shown by `automap
    # plan` and the report): e.g. layers in one scan that no pipeline stage can cut.
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(str(n) for n in self.notes))  # JSON: a list


#: The pipeline schedule a plan runs unless it names another (1F1B, `_pipeline`'s registry).
DEFAULT_SCHEDULE = "1f1b"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A distributed execution plan for one captured training step."""

    mesh: Mapping[str, int]  # axis name -> size, in mesh order
    specs: Mapping[str, Spec]  # input leaf path (keystr) -> spec
    out_specs: Mapping[str, Spec] = dataclasses.field(default_factory=dict)  # output leaf path
    constraints: Mapping[int, Spec] = dataclasses.field(default_factory=dict)  # tensor id -> spec
    stages: tuple[Stage, ...] = ()  # empty: one program; see `pipelined`
    microbatches: int = 1
    schedule: str = DEFAULT_SCHEDULE  # a registered schedule's name (`_pipeline.pipeline_schedule`)
    zero_stage: int = 0
    # What ZeRO-1/2's data axis gathers after the update on shards (`ZERO_GATHERS`):
    # "params", the new parameters, whose float32 masters every device holds whole;
    # "compute", as DeepSpeed runs a mixed-precision step, the compute-dtype copies of the
    # parameters the step reads only through a narrowing cast (their float32 masters stay
    # on the shards, in and out of the step; `_groups.narrow_params`), the rest as
    # "params". Ignored by ZeRO-0 and ZeRO-3 (which gathers its casts already).
    zero_gather: str = "params"
    remat: bool = False  # recompute in the backward; what, by the two fields below
    # "full": each layer's forward (Megatron's full recomputation); "selective": only the
    # attention core of each layer (Korthikanti et al.); "projections": all of each layer
    # but its projections, whose outputs are kept (MaxText's `minimal`). Read only when
    # `remat` is set.
    remat_policy: str = "full"
    # Full recomputation of the first k layers of each stage (the rest keep their
    # activations), Megatron's "block" method; None: every layer.
    remat_layers: int | None = None
    # The tensor-parallel axis the residual stream is also split on, by sequence (Korthikanti
    # et al. 2022), or None. Its constraints are among `constraints`
    # (`_groups.sequence_parallel`); the cost model prices it from this field.
    sequence_parallel: str | None = None
    # "written": each layer's attention core runs as the program wrote it (scores and
    # softmax in memory); "flash": as one call to the Pallas flash kernel (`_run/_flash.py`,
    # TPU targets, and the CPU's interpret mode).
    attention: str = "written"
    name: str = ""  # e.g. "megatron_dp", or the searcher's name
    # Linkage group id -> mesh axis, for every group the plan splits: what the cost model
    # prices. None for a plan written by hand (the cost model reads it back from the specs).
    # Saved as decisions["assignment"], where plan files have always kept it.
    assignment: Mapping[int, str] | None = None
    predicted: Cost | None = None
    provenance: Provenance = dataclasses.field(default_factory=Provenance)
    # Searcher-specific decisions (e.g. group -> axis), JSON-able, for reports and resume.
    decisions: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The argument pytree structure, when known (not saved): lets in_specs be a real pytree.
    in_tree: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # A plan built in code is held to the sizes a plan file is (`_check_fields`):
        # a zero or negative size would fail deep inside apply, or draw nothing.
        _check_sizes(self.mesh, self.microbatches, "the plan")
        _check_remat(self.remat_policy, self.remat_layers, "the plan")
        _check_zero_gather(self.zero_gather, "the plan")
        _check_attention(self.attention, "the plan")
        if self.attention == "flash" and self.pipelined:
            # The staged runtime traces a core's forward and backward apart (`_run/_flash.py`).
            raise PlanError(
                "attention='flash' runs on one-stage plans without microbatches for now; "
                "use attention='written' with pipeline stages or microbatches."
            )
        # Plans built in code the old way, with the assignment among the decisions.
        if "assignment" in self.decisions:
            decisions = dict(self.decisions)
            raw = decisions.pop("assignment")
            if self.assignment is None and raw is not None:
                object.__setattr__(self, "assignment", {int(g): str(a) for g, a in raw.items()})
            object.__setattr__(self, "decisions", decisions)

    @property
    def pipelined(self) -> bool:
        """The plan runs through the staged runtime: more than one stage, or one stage
        fed microbatch by microbatch (gradient accumulation, as Megatron-LM runs PP=1)."""
        return len(self.stages) > 1 or (len(self.stages) == 1 and self.microbatches > 1)

    @property
    def remat_label(self) -> str:
        """What the plan recomputes, in words: none, selective, projections, full, or full
        over k layers per stage."""
        if not self.remat:
            return "none"
        if self.remat_layers is not None:
            return f"full, {self.remat_layers} layers per stage"
        return self.remat_policy

    @property
    def virtual_stages(self) -> int:
        """Model chunks per device group (interleaved 1F1B): a plan of S device groups
        and v chunks lists S * v stages, stage p on the devices of stage p % S (virtual
        stage p is chunk p // S of group p % S). 1 when every stage has its own devices."""
        groups = _first_repeat(self.stages)
        return len(self.stages) // groups if groups else 1

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values()) if self.mesh else 1

    @property
    def replicated(self) -> bool:
        """True when the plan splits nothing (no tensor split, no ZeRO, one stage): every
        device holds everything and runs the whole step, whatever its mesh is called."""
        specs = (*self.specs.values(), *self.out_specs.values(), *self.constraints.values())
        split = any(e is not None for spec in specs for e in spec)
        return not split and self.zero_stage == 0 and len(self.stages) <= 1

    @property
    def in_specs(self) -> Any:
        """PartitionSpecs for the step's arguments: a pytree matching them when the plan was
        made in this process, else a dict keyed by each leaf's path."""
        by_path = {path: PartitionSpec(*spec) for path, spec in self.specs.items()}
        if self.in_tree is None:
            return by_path
        import jax

        paths = [jax.tree_util.keystr(p) for p, _ in _paths_of(self.in_tree)]
        return jax.tree_util.tree_unflatten(self.in_tree, [by_path[p] for p in paths])

    # ---- JSON -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "name": self.name,
            "mesh": dict(self.mesh),
            "specs": {k: _spec_to_json(v) for k, v in self.specs.items()},
            "out_specs": {k: _spec_to_json(v) for k, v in self.out_specs.items()},
            "constraints": {str(k): _spec_to_json(v) for k, v in self.constraints.items()},
            "stages": [
                {
                    "op_start": s.op_start,
                    "op_stop": s.op_stop,
                    "devices": list(s.devices),
                    "mesh": dict(s.mesh),
                }
                for s in self.stages
            ],
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "zero_stage": self.zero_stage,
            "zero_gather": self.zero_gather,
            "remat": self.remat,
            "remat_policy": self.remat_policy,
            "remat_layers": self.remat_layers,
            "sequence_parallel": self.sequence_parallel,
            "attention": self.attention,
            "predicted": None if self.predicted is None else self.predicted.to_dict(),
            "provenance": dataclasses.asdict(self.provenance),
            "decisions": _with_assignment(self.decisions, self.assignment),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "plan") -> Plan:
        if not isinstance(d, Mapping):
            raise PlanError(f"{source} is not a plan: expected a JSON object at the top level.")
        version = d.get("schema_version")
        if version not in READABLE_PLAN_SCHEMAS:
            raise PlanError(
                f"{source} has plan schema version {version!r}; this automap ({__version__}) "
                f"reads versions {', '.join(map(str, READABLE_PLAN_SCHEMAS))}. Re-create the plan with `automap plan`."
            )
        _check_fields(d, source)
        try:
            plan = cls(
                mesh={str(k): int(v) for k, v in d["mesh"].items()},
                specs={k: _spec_from_json(v) for k, v in d["specs"].items()},
                out_specs={k: _spec_from_json(v) for k, v in d.get("out_specs", {}).items()},
                constraints={
                    int(k): _spec_from_json(v) for k, v in d.get("constraints", {}).items()
                },
                stages=tuple(
                    Stage(
                        op_start=int(s["op_start"]),
                        op_stop=int(s["op_stop"]),
                        devices=tuple(int(x) for x in s["devices"]),
                        mesh={str(k): int(v) for k, v in s["mesh"].items()},
                    )
                    for s in d.get("stages", ())
                ),
                microbatches=int(d.get("microbatches", 1)),
                schedule=str(d.get("schedule", DEFAULT_SCHEDULE)),
                zero_stage=int(d.get("zero_stage", 0)),
                # Plans saved before the field (version 1) gathered the parameters.
                zero_gather=str(d.get("zero_gather", "params")),
                remat=d.get("remat", False),
                # Plans saved before the policies recomputed every layer in full.
                remat_policy=str(d.get("remat_policy", "full")),
                remat_layers=d.get("remat_layers"),
                sequence_parallel=d.get("sequence_parallel"),
                attention=str(d.get("attention", "written")),
                name=str(d.get("name", "")),
                predicted=None if d.get("predicted") is None else Cost.from_dict(d["predicted"]),
                provenance=Provenance(**d.get("provenance", {})),
                decisions=dict(d.get("decisions", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(
                f"{source} is corrupt ({type(e).__name__}: {e}). Re-create it with `automap plan`."
            ) from None
        _check_stages(plan, source)
        return plan

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanError(f"no plan file at {path}: check the path.") from None
        except IsADirectoryError:
            raise PlanError(
                f"{path} is a directory, not a plan file: give the JSON file that "
                "`automap plan -o plan.json` wrote."
            ) from None
        except PermissionError:
            raise PlanError(f"{path} cannot be read (permission denied).") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(
                f"{path} is not valid JSON ({e}); it is not a plan file or it is corrupt. "
                "Re-create it with `automap plan`."
            ) from None
        return cls.from_dict(raw, source=str(path))


# ---- a hand-edited plan file: each field checked, one line naming it and the fix -----

_RECREATE = "or re-create the plan with `automap plan`"


def _whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_sizes(mesh: Any, microbatches: Any, source: str) -> None:
    """Mesh sizes and microbatches: whole numbers >= 1."""
    if isinstance(mesh, Mapping):
        for axis, size in mesh.items():
            if not _whole(size) or size < 1:
                raise PlanError(
                    f"{source}: mesh[{axis!r}] must be a whole number of devices >= 1, got "
                    f"{size!r}; give each axis its size (their product is the device count), "
                    f"{_RECREATE}."
                )
    if not _whole(microbatches) or microbatches < 1:
        raise PlanError(
            f"{source}: microbatches must be a whole number >= 1, got {microbatches!r}; "
            f"set it to 1 (no microbatching) or more, {_RECREATE}."
        )


def _check_fields(d: Mapping[str, Any], source: str) -> None:
    """The fields a hand edit can break without breaking the JSON: mesh sizes, microbatches,
    ZeRO stage and remat. A wrong one would fail deep inside apply or the report (a
    division by zero, a collapsed picture) or be read as something else ("false" is a
    true string)."""
    _check_sizes(d.get("mesh"), d.get("microbatches", 1), source)
    zero = d.get("zero_stage", 0)
    if not _whole(zero) or zero not in range(4):
        raise PlanError(
            f"{source}: zero_stage must be 0, 1, 2 or 3, got {zero!r}; set one of them, "
            f"{_RECREATE}."
        )
    _check_zero_gather(d.get("zero_gather", "params"), source)
    _check_attention(d.get("attention", "written"), source)
    remat = d.get("remat", False)
    if not isinstance(remat, bool):
        raise PlanError(
            f"{source}: remat must be true or false (a JSON boolean), got {remat!r}; "
            'write "remat": true or "remat": false, without quotes around the value.'
        )
    axis = d.get("sequence_parallel")
    if axis is not None and (not isinstance(axis, str) or axis not in (d.get("mesh") or {})):
        raise PlanError(
            f"{source}: sequence_parallel must be null or a mesh axis name, got {axis!r}; "
            f'write the tensor-parallel axis (e.g. "model") or null, {_RECREATE}.'
        )
    _check_remat(d.get("remat_policy", "full"), d.get("remat_layers"), source)


#: What ZeRO-1/2 may gather after the update (`Plan.zero_gather`).
ZERO_GATHERS = ("params", "compute")


ATTENTIONS = ("written", "flash")


def _check_attention(value: Any, source: str) -> None:
    if value not in ATTENTIONS:
        raise PlanError(
            f"{source}: attention must be one of {', '.join(ATTENTIONS)}, got {value!r}."
        )


def _check_zero_gather(value: Any, source: str) -> None:
    if value not in ZERO_GATHERS:
        raise PlanError(
            f"{source}: zero_gather must be "
            f'{" or ".join(repr(g) for g in ZERO_GATHERS)}, got {value!r}; write "params" '
            f'(gather the new parameters) or "compute" (their compute-dtype copies), '
            f"{_RECREATE}."
        )


#: What a remat plan may recompute (`_remat.plan_recompute` reads them).
REMAT_POLICIES = ("selective", "projections", "full")


def _check_remat(policy: Any, layers: Any, source: str) -> None:
    if policy not in REMAT_POLICIES:
        raise PlanError(
            f"{source}: remat_policy must be one of {', '.join(REMAT_POLICIES)}, got "
            f"{policy!r}; set one of them, {_RECREATE}."
        )
    if layers is None:
        return
    if not _whole(layers) or layers < 1:
        raise PlanError(
            f"{source}: remat_layers must be a whole number >= 1 (layers recomputed per "
            f"stage) or null (all of them), got {layers!r}; set one, {_RECREATE}."
        )
    if policy != "full":
        raise PlanError(
            f"{source}: remat_layers counts layers recomputed in full, but remat_policy is "
            f"{policy!r}; set remat_policy to full or remat_layers to null."
        )


def _check_stages(plan: Plan, source: str) -> None:
    """A pipeline's stages: each on its own devices of the mesh, as many as its mesh says,
    and as many stages as the mesh's pipe axis."""
    pipe = plan.mesh.get(PIPE)
    if pipe is not None and plan.stages and (pipe > len(plan.stages) or len(plan.stages) % pipe):
        raise PlanError(
            f"{source}: mesh['{PIPE}'] is {pipe} but the plan lists {len(plan.stages)} "
            f"stages; make them agree (one stage per step of the {PIPE} axis, or a multiple "
            f"of it for interleaved virtual stages), {_RECREATE}."
        )
    # Device groups: the pipe axis, else the stages before the first that repeats devices.
    groups = pipe if pipe is not None and plan.stages else _first_repeat(plan.stages)
    if pipe is not None and pipe > 1 and not plan.stages:
        raise PlanError(
            f"{source}: mesh['{PIPE}'] is {pipe} but the plan lists no stages; give its "
            f"stages, or drop the {PIPE} axis, {_RECREATE}."
        )
    _check_interleaving(plan, groups, source)
    owner: dict[int, int] = {}
    for s, stage in enumerate(plan.stages):
        need = math.prod(stage.mesh.values()) if stage.mesh else 1
        bad = [n for n in stage.mesh.values() if n < 1]
        if bad or len(stage.devices) != need or len(set(stage.devices)) != need:
            raise PlanError(
                f"{source}: stage {s} has devices {list(stage.devices)} but its mesh "
                f"{dict(stage.mesh)} needs {need} distinct ones; make them agree, {_RECREATE}."
            )
        if not 0 <= stage.op_start < stage.op_stop:
            raise PlanError(
                f"{source}: stage {s} runs ops {stage.op_start} to {stage.op_stop}, an empty "
                f"range; give op_start < op_stop, {_RECREATE}."
            )
        for device in stage.devices if s < groups else ():  # later ones: checked above
            if not 0 <= device < plan.devices:
                raise PlanError(
                    f"{source}: stage {s} names device {device}, outside the mesh's "
                    f"{plan.devices} devices (0 to {plan.devices - 1}); {_RECREATE[3:]}."
                )
            if device in owner:
                raise PlanError(
                    f"{source}: stages {owner[device]} and {s} both run on device {device}; "
                    f"each stage needs its own devices, {_RECREATE}."
                )
            owner[device] = s


def _first_repeat(stages) -> int:
    """How many stages come before the first that repeats an earlier one's devices (all
    of them when none does): the device groups of an interleaved plan."""
    seen = set()
    for s, stage in enumerate(stages):
        if tuple(stage.devices) in seen:
            return s
        seen.add(tuple(stage.devices))
    return len(stages)


def _check_interleaving(plan: Plan, groups: int, source: str) -> None:
    """Stages past the first `groups` (interleaved 1F1B's later chunks) repeat the first
    ones' devices in order: stage s on the devices of stage s % groups."""
    stages = plan.stages
    if not stages:
        return
    for s in range(groups, len(stages)):
        if tuple(stages[s].devices) != tuple(stages[s % groups].devices):
            raise PlanError(
                f"{source}: stage {s} runs on devices {list(stages[s].devices)}, but with "
                f"{groups} device groups (interleaved virtual stages) stage {s} must run on "
                f"stage {s % groups}'s devices {list(stages[s % groups].devices)} and the "
                f"stage count be a multiple of {groups}; give each stage its own devices, "
                f"or repeat the groups in order, {_RECREATE}."
            )
    if len(stages) % groups:
        raise PlanError(
            f"{source}: {len(stages)} stages on {groups} device groups: interleaved virtual "
            f"stages need a multiple of {groups} stages, {_RECREATE}."
        )


def _with_assignment(
    decisions: Mapping[str, Any], assignment: Mapping[int, str] | None
) -> dict[str, Any]:
    if assignment is None:
        return dict(decisions)
    return {"assignment": {str(g): a for g, a in sorted(assignment.items())}, **decisions}


def _finite_or_none(x: float) -> float | None:
    return None if math.isinf(x) else x


def _spec_to_json(spec: Spec) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _spec_from_json(raw: Any) -> Spec:
    if not isinstance(raw, list):
        raise TypeError(f"a spec must be a list, got {raw!r}")
    out: list[SpecEntry] = []
    for e in raw:
        if e is None or isinstance(e, str):
            out.append(e)
        elif isinstance(e, list) and all(isinstance(a, str) for a in e):
            out.append(tuple(e))
        else:
            raise TypeError(f"a spec entry must be null, an axis name or a list of them: {e!r}")
    return tuple(out)


def _paths_of(treedef: Any) -> list[tuple[Any, Any]]:
    import jax

    dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return jax.tree_util.tree_flatten_with_path(dummy)[0]
