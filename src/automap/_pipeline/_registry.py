"""The pipeline schedules by name: the one place a schedule's name is read.

A Plan stores its schedule's name (`Plan.schedule`, plain JSON), the CLI and recipes take
one; everything else looks the object up here (`pipeline_schedule`) and reads it
(`_schedule.PipelineSchedule`), never comparing names.

Adding a schedule is one new module and one entry: a `PipelineSchedule` subclass in its
own module of this folder (`_gpipe.py` is the smallest example: a name, its tasks per
stage, its in-flight microbatches per stage, its idle slots), and an instance of it in
`_BUILT_IN` below. tests/pipeline/test_schedules.py then checks that its task lists are a
valid dependency order and that its in-flight counts are the most microbatches live in
them; tests/pipeline/test_runtime.py shows the runtime's trace following a schedule
registered in a test alone (`register_schedule`).
"""

from __future__ import annotations

from .._errors import PlanError
from .._plan import Plan
from ._gpipe import GPipe
from ._interleaved import Interleaved
from ._one_f_one_b import OneFOneB
from ._schedule import PipelineSchedule
from ._zero_bubble import ZeroBubbleH1

_BUILT_IN: tuple[PipelineSchedule, ...] = (GPipe(), OneFOneB(), Interleaved(), ZeroBubbleH1())
_SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in _BUILT_IN}


def schedule_names() -> tuple[str, ...]:
    """The registered schedules' names, built-in ones first."""
    return tuple(_SCHEDULES)


def pipeline_schedule(name: str, chunks: int | None = None) -> PipelineSchedule:
    """The schedule registered as `name`, run with `chunks` model chunks per device where
    given (a plan's `virtual_stages`; the registered one's otherwise); a PlanError listing
    the names, or saying why it cannot hold `chunks`, otherwise."""
    try:
        schedule = _SCHEDULES[name]
    except (KeyError, TypeError):
        raise PlanError(
            f"unknown pipeline schedule {name!r}; use one of {', '.join(_SCHEDULES)}."
        ) from None
    return schedule if chunks is None else schedule.with_chunks(chunks)


def split_variant(schedule: PipelineSchedule) -> PipelineSchedule | None:
    """The schedule a search asked for `schedule` also tries on the same cuts with each
    backward split (its `split_as`: ZB-H1 for 1F1B), or None where it names none."""
    if schedule.split_as is None or schedule.chunks != 1:
        return None
    return pipeline_schedule(schedule.split_as)


def chunked_variant(schedule: PipelineSchedule, chunks: int) -> PipelineSchedule | None:
    """The schedule a search asked for `schedule` also tries with `chunks` model chunks
    per device group (its `chunked_as`: interleaved 1F1B for 1F1B), or None."""
    if schedule.chunked_as is None or schedule.chunks != 1:
        return None
    return pipeline_schedule(schedule.chunked_as, chunks)


def plan_schedule(plan: Plan) -> PipelineSchedule:
    """The schedule a plan runs: its name, with the plan's virtual stages per device (a
    PlanError where the schedule cannot run the plan's recomputation)."""
    schedule = pipeline_schedule(plan.schedule, plan.virtual_stages)
    check_remat(schedule, plan.remat)
    return schedule


def check_remat(schedule: PipelineSchedule, remat: bool) -> None:
    """A one-line PlanError where `schedule` splits the backward and `remat` recomputes:
    a recomputed layer's values would have to outlive its B program for its W (not built)."""
    if remat and schedule.splits_backward:
        raise PlanError(
            f"pipeline schedule {schedule.name!r} splits each backward into B and W programs, "
            "which recomputation does not run yet; use remat none with it, or schedule "
            "'1f1b' to recompute."
        )


def register_schedule(schedule: PipelineSchedule) -> PipelineSchedule:
    """Add a schedule under its name (refusing a name already taken) and return it."""
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"{schedule!r} is not a PipelineSchedule.")
    if schedule.name in _SCHEDULES:
        raise PlanError(f"a pipeline schedule named {schedule.name!r} is already registered.")
    _SCHEDULES[schedule.name] = schedule
    return schedule


def unregister_schedule(name: str) -> None:
    """Remove a schedule added by `register_schedule` (the built-in ones stay)."""
    if any(s.name == name for s in _BUILT_IN):
        raise PlanError(f"pipeline schedule {name!r} is built in and cannot be removed.")
    _SCHEDULES.pop(name, None)
