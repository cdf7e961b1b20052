"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1): 1F1B with
each backward split into B, the gradient sent upstream, and W, the weight gradients,
and W deferred into what would be 1F1B's bubble.

Stage s runs 1F1B's order of forwards and B's (S - s - 1 warm-up forwards, then one
forward and one B in turn, then the B's left), and after the B of microbatch j the W of
microbatch j - s: the first stage runs each W at once, the last defers its W's by S - 1
microbatches, and every W left runs at the end. The B's, no longer waiting on W's, reach
the first stage sooner, and the deferred W's fill the drain.

What it holds: stage s keeps at most min(m, S - s) microbatches between forward and B,
as 1F1B (`in_flight`), and besides them microbatches between B and W, each holding what
its W reads (the layers' inputs and output gradients: less than a forward's residuals):
s of them beside S - s after a forward, s + 1 beside S - s - 1 after a B (`live_counts`).
So no stage holds more than S microbatches, 1F1B's first stage's count: the paper's
"same peak memory as 1F1B", which is per stage 1F1B's plus what the deferred W's hold.

Its bubble (`idle_slots`): counted, as for the other schedules, per stage on equal stages
with free sends, in units of one microbatch's whole work (F + B + W), taking F, B and W
equal (the paper's assumption): S - 1 idle thirds when m >= S, a third of 1F1B's S - 1
wholes, (S - 1)(T_F + T_B - T_W) in the paper's terms; with fewer microbatches the last
stage's B's cannot come sooner than its forwards, and S - m more thirds are idle.
`simulate` times the real F, B and W of each stage.
"""

from __future__ import annotations

from ._phase import Phase
from ._schedule import PipelineSchedule, Task


class ZeroBubbleH1(PipelineSchedule):
    name = "zb-h1"
    splits_backward = True

    def stage_tasks(self, stages: int, microbatches: int) -> tuple[tuple[Task, ...], ...]:
        return tuple(self._stage(s, stages, microbatches) for s in range(stages))

    def _stage(self, s: int, stages: int, m: int) -> tuple[Task, ...]:
        warm = min(stages - s - 1, m)
        order = [Task(Phase.FWD, k) for k in range(warm)]
        for j in range(m):  # B j, after 1F1B's forward; then the W deferred s microbatches
            if warm + j < m:
                order.append(Task(Phase.FWD, warm + j))
            order.append(Task(Phase.BWD, j))
            if j >= s:
                order.append(Task(Phase.WGT, j - s))
        order += [Task(Phase.WGT, k) for k in range(max(0, m - s), m)]
        return tuple(order)

    def in_flight(self, stages: int, microbatches: int) -> tuple[int, ...]:
        return tuple(min(microbatches, stages - s) for s in range(stages))

    def idle_slots(self, stages: int, microbatches: int) -> float:
        return (stages - 1 + max(0, stages - microbatches)) / 3
