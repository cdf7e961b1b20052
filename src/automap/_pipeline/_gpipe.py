"""GPipe (Huang et al., 2019): every stage runs all its forwards, then all its backwards.

The backwards run last microbatch first, as its activations are the newest. A stage holds
every microbatch's activations at its peak (between its last forward and first backward);
its bubble is S - 1 slots of one microbatch's forward + backward, as 1F1B's.
"""

from __future__ import annotations

from ._phase import Phase
from ._schedule import PipelineSchedule, Task


class GPipe(PipelineSchedule):
    name = "gpipe"

    def stage_tasks(self, stages: int, microbatches: int) -> tuple[tuple[Task, ...], ...]:
        order = [Task(Phase.FWD, m) for m in range(microbatches)]
        order += [Task(Phase.BWD, m) for m in reversed(range(microbatches))]
        return (tuple(order),) * stages

    def in_flight(self, stages: int, microbatches: int) -> tuple[int, ...]:
        return (microbatches,) * stages

    def idle_slots(self, stages: int, microbatches: int) -> float:
        return stages - 1
