"""What a pipeline schedule is: per stage, its microbatches' work in order, and when it runs.

`PipelineSchedule` is the one object the runtime, the cost model, the stage DP and the
report read (`_registry.pipeline_schedule` finds it by the name a Plan stores): the runtime
dispatches `global_order`, the cost model times `simulate` and holds `in_flight`
microbatches of activations per stage, the stage DP sizes stages by `in_flight`, the DQN
sees `bubble`, and the report draws `simulate`. Keeping them one object is what lets a
test hold the runtime's order of work against the one the cost model assumes.

A schedule says three things; the rest is shared here:

- `stage_tasks`: per stage, its `Task`s (phase, microbatch, chunk) in the order it runs
  them (the clock-tick list of alpa's `pipeline_parallel/schedules.py`, written per stage).
- `in_flight`: per stage, the most microbatches whose activations it holds at once (a
  forward done, its backward not yet): what its memory must hold. A closed form, held
  against the task lists by the tests.
- `idle_slots`: per stage, the idle time of a step with equal stages and free sends, in
  units of one microbatch's forward + backward (S - 1 for GPipe and 1F1B); `bubble` is
  that as a share of the step.

Model chunks: a task names its `chunk`, the model chunk of its device it runs.
Interleaved 1F1B (`_interleaved.py`) holds `chunks` = v > 1 per device: its virtual
stages. A plan then lists S * v stages (`Plan.stages`), virtual stage p = chunk * S + s on
device group s, so every reader that walks a plan's stages walks virtual stages: `stages`
below is always the device groups S, while `simulate`'s times and sends, and the units of
`simulate` and `global_order`, are per virtual stage (the same thing when v = 1). A
schedule may split each backward in two (`splits_backward`: ZB-H1, `_zero_bubble.py`): its
tasks then hold a WGT task per microbatch besides FWD and BWD, which reads its stage's
BWD of the same microbatch, and `simulate` times it apart.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

from .._errors import PlanError
from ._phase import Phase

#: What a schedule's tasks alone determine (`PipelineSchedule._memo`), by (what, class,
#: chunks, stages, microbatches); a few dozen are kept (a search prices a handful of stage
#: and microbatch counts at a time, each many times).
_MEMO: dict[tuple, tuple] = {}
_MEMO_KEPT = 64


class Task(NamedTuple):
    """One unit of a stage's work: a phase of one microbatch on one of its model chunks."""

    phase: Phase
    microbatch: int
    chunk: int = 0  # which of the device's `chunks` model chunks (0 with one per device)


class Unit(NamedTuple):
    """A task placed on its stage: what the runtime dispatches and records in its trace.
    `stage` is the virtual stage (chunk * S + device group; the stage when v = 1)."""

    stage: int
    phase: Phase
    microbatch: int


class Timed(NamedTuple):
    """A unit in time (`simulate`). A stage's once-per-step reduction after its last
    backward is (stage, Phase.REDUCE, -1, start, end)."""

    stage: int
    phase: Phase
    microbatch: int
    start: float
    end: float


class PipelineSchedule(abc.ABC):
    """A microbatch schedule; subclasses name themselves and list their tasks."""

    #: The name a Plan stores and the CLI takes (`Plan.schedule`, `--schedule`).
    name: ClassVar[str]
    #: Model chunks each device holds (interleaved schedules: its virtual stages); an
    #: instance's own (`with_chunks`).
    chunks: int = 1
    #: Runs each microbatch's weight gradients (WGT) apart from the rest of its backward
    #: (BWD): the runtime and the cost model split the partition (`_split.split_backward`).
    splits_backward: ClassVar[bool] = False
    #: What a search asked for this schedule also tries, by registered name
    #: (`_registry.split_variant`, `chunked_variant`): the schedule that runs the same
    #: stages with each backward split into B and W (ZB-H1 for 1F1B), and the one that
    #: runs them as several model chunks per device group (interleaved 1F1B for 1F1B).
    #: None: the search tries no such variant.
    split_as: ClassVar[str | None] = None
    chunked_as: ClassVar[str | None] = None

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The per-microbatch phases its tasks run: FWD and BWD, and WGT if it splits."""
        return (Phase.FWD, Phase.BWD, Phase.WGT) if self.splits_backward else (Phase.FWD, Phase.BWD)

    def with_chunks(self, chunks: int) -> PipelineSchedule:
        """This schedule run with `chunks` model chunks per device (a plan's
        `virtual_stages`); a PlanError where it cannot."""
        if chunks == self.chunks:
            return self
        raise PlanError(
            f"pipeline schedule {self.name!r} runs one model chunk per device, not "
            f"{chunks}; use schedule 'interleaved' for virtual stages, or list one stage "
            "per device group."
        )

    def check(self, stages: int, microbatches: int) -> None:
        """A PlanError where this schedule cannot run `microbatches` on `stages` device
        groups (every count runs, unless a schedule says otherwise)."""
        return None

    def virtual_stage(self, stage: int, task: Task, stages: int) -> int:
        """The virtual stage (the plan's stage index) `task` on device group `stage` runs."""
        return task.chunk * stages + stage

    @abc.abstractmethod
    def stage_tasks(self, stages: int, microbatches: int) -> tuple[tuple[Task, ...], ...]:
        """Per stage, its tasks in the order it runs them: every microbatch's forward and
        backward on every chunk, once each."""

    @abc.abstractmethod
    def in_flight(self, stages: int, microbatches: int) -> tuple[int, ...]:
        """Per stage, the most microbatches whose activations it holds at once."""

    @abc.abstractmethod
    def idle_slots(self, stages: int, microbatches: int) -> float:
        """Idle time per stage of a step on equal stages with free sends, in units of one
        microbatch's forward + backward."""

    def stage_in_flight(self, stages: int, microbatches: int) -> tuple[int, ...]:
        """Per virtual stage, its microbatches live at its device's busiest moment (the
        first task after which `in_flight` (microbatch, chunk) pairs are live): what a
        device holds of each of its chunks' activations at its peak. Read off the task
        lists; `in_flight` when one chunk per device."""
        return self._memo("in flight", stages, microbatches, self._stage_in_flight)

    def _stage_in_flight(self, stages: int, microbatches: int) -> tuple[int, ...]:
        out = [0] * (stages * self.chunks)
        for s, tasks in enumerate(self.stage_tasks(stages, microbatches)):
            live: set[Task] = set()
            best: list[Task] = []
            for task in tasks:
                key = Task(Phase.FWD, task.microbatch, task.chunk)
                (live.add if task.phase is Phase.FWD else live.discard)(key)
                if len(live) > len(best):
                    best = list(live)
            for task in best:
                out[self.virtual_stage(s, task, stages)] += 1
        return tuple(out)

    def live_counts(
        self, stages: int, microbatches: int
    ) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per stage, after each of its tasks: (microbatches whose forward is done and
        backward not, those whose backward is done and weight gradients not). The second
        is always 0 unless the schedule splits the backward: what a deferred W holds."""
        return self._memo("live", stages, microbatches, self._live_counts)

    def _live_counts(
        self, stages: int, microbatches: int
    ) -> tuple[tuple[tuple[int, int], ...], ...]:
        out = []
        for tasks in self.stage_tasks(stages, microbatches):
            fwd: set[tuple[int, int]] = set()
            bwd: set[tuple[int, int]] = set()
            counts = []
            for task in tasks:
                key = (task.microbatch, task.chunk)
                if task.phase is Phase.FWD:
                    fwd.add(key)
                elif task.phase is Phase.BWD:
                    fwd.discard(key)
                    if self.splits_backward:
                        bwd.add(key)
                else:
                    bwd.discard(key)
                counts.append((len(fwd), len(bwd)))
            out.append(tuple(counts))
        return tuple(out)

    def bubble(self, stages: int, microbatches):
        """The share of a step a stage idles on equal stages with free sends: the textbook
        (S - 1) / (m + S - 1) for GPipe and 1F1B. `microbatches` may be a numpy array."""
        idle = self.idle_slots(stages, microbatches)
        return idle / (microbatches + idle)

    def depends_on(self, stage: int, task: Task, stages: int) -> Unit | None:
        """The unit whose result `task` on device group `stage` reads across stages (None:
        none), by virtual stage p: a forward reads virtual stage p - 1's forward, a
        backward p + 1's backward, and the last virtual stage's backward its own forward;
        a weight-gradient task (WGT) its own stage's backward of the microbatch."""
        p, last = self.virtual_stage(stage, task, stages), stages * self.chunks - 1
        if task.phase is Phase.WGT:
            return Unit(p, Phase.BWD, task.microbatch)
        if task.phase is Phase.FWD:
            return Unit(p - 1, Phase.FWD, task.microbatch) if p > 0 else None
        if p < last:
            return Unit(p + 1, Phase.BWD, task.microbatch)
        return Unit(p, Phase.FWD, task.microbatch)

    def simulate(
        self,
        stages: int,
        microbatches: int,
        times: Sequence[tuple[float, ...]],
        send_s: Sequence[float] | None = None,
        reduce_s: Sequence[float] | None = None,
    ) -> list[Timed]:
        """Run the schedule in time: one `Timed` per unit of work.

        `stages` is the device groups S; the rest is per virtual stage p (= stage s when
        one chunk per device): `times[p]` is its (forward, backward) seconds per
        microbatch, or (forward, backward, weight gradients) where the backward is split:
        a schedule that splits runs the third as its WGT units (0 when not given), one
        that does not adds it to its backward; `send_s[p]` the point-to-point time to pass a microbatch's activations
        (or their gradients) across the cut between virtual stage p and p + 1 (0 when not
        given). A unit starts when its device group is free and the unit it `depends_on`
        has ended, plus the send across the cut between them. Units name virtual stages.

        `reduce_s[p]`, where given and positive, is virtual stage p's once-per-step work
        after its device's last backward (its gradients' data-parallel reduction): one
        more unit (p, Phase.REDUCE, -1, ...), run right after p's last unit (as the runtime
        dispatches it) and listed after all the forward and backward units, by stage.
        """
        pieces = stages * self.chunks
        if len(times) != pieces:
            raise ValueError(
                f"{self.name!r} on {stages} stages x {self.chunks} chunks needs {pieces} "
                f"(forward, backward) times, one per virtual stage; got {len(times)}."
            )
        sends = list(send_s) if send_s is not None else [0.0] * pieces
        reduce = [0.0] * pieces if reduce_s is None else [float(x) for x in reduce_s]
        seconds = [[self._unit_s(t, phase) for phase in Phase] for t in times]
        ends: list[float] = []
        reductions: list[Timed] = []
        free, out = [0.0] * stages, []
        for s, p, phase, mb, dep, lag, last in self._walk(stages, microbatches):
            ready = 0.0 if dep < 0 else ends[dep] + (0.0 if lag < 0 else sends[lag])
            start = max(free[s], ready)
            end = start + seconds[p][phase]
            ends.append(end)
            free[s] = end
            out.append(Timed(p, phase, mb, start, end))
            if last and reduce[p] > 0:
                reductions.append(Timed(p, Phase.REDUCE, -1, end, end + reduce[p]))
                free[s] = end + reduce[p]
        return out + sorted(reductions, key=lambda u: u.stage)

    def _walk(self, stages: int, microbatches: int) -> tuple[tuple, ...]:
        """`simulate`'s units in the order it runs them, each (device group, virtual
        stage, phase, microbatch, the index of the unit it waits on or -1, the cut whose
        send that wait crosses or -1, whether it is its virtual stage's last). The order
        depends on the tasks alone, not their times, so it is found once per schedule,
        stage and microbatch count (a 1T GPT's experts time 64 stages x 512 microbatches
        some twenty times)."""
        return self._memo("walk", stages, microbatches, self._walk_uncached)

    def _memo(self, what: str, stages: int, microbatches: int, make) -> tuple:
        """`make(stages, microbatches)`, once per schedule (its class and chunks: a
        schedule's tasks are a function of those), stage and microbatch count."""
        key = (what, type(self), self.chunks, stages, microbatches)
        if key not in _MEMO:
            if len(_MEMO) >= _MEMO_KEPT:
                _MEMO.clear()
            _MEMO[key] = make(stages, microbatches)
        return _MEMO[key]

    def _walk_uncached(self, stages: int, microbatches: int) -> tuple[tuple, ...]:
        orders = self.stage_tasks(stages, microbatches)
        # Each virtual stage's last task on its device: its reduction runs right after it,
        # as the runtime dispatches it (with one chunk per device: after the last unit).
        last = {
            self.virtual_stage(s, task, stages): (s, k)
            for s, tasks in enumerate(orders)
            for k, task in enumerate(tasks)
        }
        index: dict[Unit, int] = {}
        ptr, out = [0] * stages, []
        while any(ptr[s] < len(orders[s]) for s in range(stages)):
            progressed = False
            for s in range(stages):
                while ptr[s] < len(orders[s]):
                    task = orders[s][ptr[s]]
                    dep = self.depends_on(s, task, stages)
                    if dep is not None and dep not in index:
                        break
                    p = self.virtual_stage(s, task, stages)
                    lag = -1 if dep is None or dep.stage == p else min(p, dep.stage)
                    at = -1 if dep is None else index[dep]
                    index[Unit(p, task.phase, task.microbatch)] = len(out)
                    out.append((s, p, task.phase, task.microbatch, at, lag, last[p] == (s, ptr[s])))
                    ptr[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(
                    f"pipeline schedule {self.name!r} deadlocked: a stage waits on a unit "
                    "its neighbour runs later. Reorder its `stage_tasks`."
                )
        return tuple(out)

    def _unit_s(self, t: Sequence[float], phase: Phase) -> float:
        """A unit's seconds from its virtual stage's `simulate` times."""
        w = float(t[2]) if len(t) > 2 else 0.0
        if phase is Phase.FWD:
            return float(t[0])
        if phase is Phase.WGT:
            return w
        return float(t[1]) + (0.0 if self.splits_backward else w)

    def global_order(self, stages: int, microbatches: int) -> list[Unit]:
        """One sequence of all the work that respects every dependency and every stage's
        own order: the order a single controller dispatches it in (stages then run
        concurrently, as JAX dispatch is asynchronous). Units are ordered by their start
        time in a simulation with unit times, ties by stage; they name virtual stages. (A
        backward twice a forward, half of it weight gradients where the schedule splits it.)"""
        timed = self.simulate(stages, microbatches, [(1.0, 1.0, 1.0)] * (stages * self.chunks))
        return [Unit(*u[:3]) for u in sorted(timed, key=lambda u: (u.start, u.stage))]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}()"
            if self.chunks == 1
            else f"{type(self).__name__}({self.chunks})"
        )
