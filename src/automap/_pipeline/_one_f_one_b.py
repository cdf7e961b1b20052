"""1F1B (PipeDream-Flush, Megatron-LM's default): one forward, one backward, in turn.

Stage s warms up with S - s - 1 forwards, then alternates one forward and one backward,
then drains the backwards left. It runs the same units as GPipe with the same bubble
(S - 1 slots), but starts each backward as soon as it can, so stage s holds at most
min(m, S - s) microbatches' activations instead of m (Narayanan et al., 2021).
"""

from __future__ import annotations

from ._phase import Phase
from ._schedule import PipelineSchedule, Task


class OneFOneB(PipelineSchedule):
    name = "1f1b"
    split_as = "zb-h1"
    chunked_as = "interleaved"

    def stage_tasks(self, stages: int, microbatches: int) -> tuple[tuple[Task, ...], ...]:
        return tuple(self._stage(s, stages, microbatches) for s in range(stages))

    def _stage(self, s: int, stages: int, microbatches: int) -> tuple[Task, ...]:
        warm = min(stages - s - 1, microbatches)
        order = [Task(Phase.FWD, m) for m in range(warm)]
        for i in range(microbatches - warm):
            order += [Task(Phase.FWD, warm + i), Task(Phase.BWD, i)]
        order += [Task(Phase.BWD, m) for m in range(microbatches - warm, microbatches)]
        return tuple(order)

    def in_flight(self, stages: int, microbatches: int) -> tuple[int, ...]:
        return tuple(min(microbatches, stages - s) for s in range(stages))

    def idle_slots(self, stages: int, microbatches: int) -> float:
        return stages - 1
