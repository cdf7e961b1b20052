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

Room for more (issue 26): a task names its `chunk`, the model chunk of its device it runs
(interleaved 1F1B holds `chunks` > 1 per device: its virtual stages), and a schedule with
other phases (ZB-H1's weight-gradient pass) overrides `depends_on`. `simulate` refuses
`chunks` > 1 until the runtime and the cost model run chunks.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

from ._phase import Phase


class Task(NamedTuple):
    """One unit of a stage's work: a phase of one microbatch on one of its model chunks."""

    phase: Phase
    microbatch: int
    chunk: int = 0  # which of the device's `chunks` model chunks (0 with one per device)


class Unit(NamedTuple):
    """A task placed on its stage: what the runtime dispatches and records in its trace."""

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
    #: Model chunks each device holds (interleaved schedules: its virtual stages).
    chunks: ClassVar[int] = 1

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

    def bubble(self, stages: int, microbatches):
        """The share of a step a stage idles on equal stages with free sends: the textbook
        (S - 1) / (m + S - 1) for GPipe and 1F1B. `microbatches` may be a numpy array."""
        idle = self.idle_slots(stages, microbatches)
        return idle / (microbatches + idle)

    def depends_on(self, stage: int, task: Task, stages: int) -> Unit | None:
        """The unit whose result `task` on `stage` reads across stages (None: none): a
        forward reads the previous stage's forward, a backward the next stage's backward,
        and the last stage's backward its own forward."""
        if task.phase is Phase.FWD:
            return Unit(stage - 1, Phase.FWD, task.microbatch) if stage > 0 else None
        if stage < stages - 1:
            return Unit(stage + 1, Phase.BWD, task.microbatch)
        return Unit(stage, Phase.FWD, task.microbatch)

    def simulate(
        self,
        stages: int,
        microbatches: int,
        times: Sequence[tuple[float, float]],
        send_s: Sequence[float] | None = None,
        reduce_s: Sequence[float] | None = None,
    ) -> list[Timed]:
        """Run the schedule in time: one `Timed` per unit of work.

        `times[s]` is stage s's (forward, backward) seconds per microbatch; `send_s[s]`
        the point-to-point time to pass a microbatch's activations (or their gradients)
        across the cut between stage s and s + 1 (0 when not given). A unit starts when
        its stage is free and the unit it `depends_on` has ended, plus the send across the
        cut between them.

        `reduce_s[s]`, where given and positive, is stage s's once-per-step work after its
        last backward (its gradients' data-parallel reduction): one more unit
        (s, Phase.REDUCE, -1, ...), listed after all the forward and backward units.
        """
        if self.chunks != 1:
            raise NotImplementedError(
                f"pipeline schedule {self.name!r} holds {self.chunks} model chunks per "
                "device; the runtime and the cost model run one chunk per device."
            )
        orders = self.stage_tasks(stages, microbatches)
        sends = list(send_s) if send_s is not None else [0.0] * stages
        done: dict[Unit, float] = {}
        free, ptr, out = [0.0] * stages, [0] * stages, []
        while any(ptr[s] < len(orders[s]) for s in range(stages)):
            progressed = False
            for s in range(stages):
                while ptr[s] < len(orders[s]):
                    task = orders[s][ptr[s]]
                    dep = self.depends_on(s, task, stages)
                    if dep is not None and dep not in done:
                        break
                    lag = 0.0 if dep is None or dep.stage == s else sends[min(s, dep.stage)]
                    ready = 0.0 if dep is None else done[dep] + lag
                    start = max(free[s], ready)
                    end = start + times[s][0 if task.phase is Phase.FWD else 1]
                    done[Unit(s, task.phase, task.microbatch)], free[s] = end, end
                    out.append(Timed(s, task.phase, task.microbatch, start, end))
                    ptr[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(
                    f"pipeline schedule {self.name!r} deadlocked: a stage waits on a unit "
                    "its neighbour runs later. Reorder its `stage_tasks`."
                )
        for s, seconds in enumerate(() if reduce_s is None else reduce_s):
            if seconds > 0:
                out.append(Timed(s, Phase.REDUCE, -1, free[s], free[s] + float(seconds)))
        return out

    def global_order(self, stages: int, microbatches: int) -> list[Unit]:
        """One sequence of all the work that respects every dependency and every stage's
        own order: the order a single controller dispatches it in (stages then run
        concurrently, as JAX dispatch is asynchronous). Units are ordered by their start
        time in a simulation with unit times, ties by stage."""
        timed = self.simulate(stages, microbatches, [(1.0, 2.0)] * stages)
        return [Unit(*u[:3]) for u in sorted(timed, key=lambda u: (u.start, u.stage))]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
