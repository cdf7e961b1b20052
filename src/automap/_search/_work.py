"""Work done against a search budget, counted rather than timed: the same budget gives
the same plan on any machine (the dp searcher and its polish steps share one)."""

from __future__ import annotations

import dataclasses
import time as _time

from ._classic import SAFETY

#: The budget counts work, not wall time, so that the same budget gives the same plan on
#: any machine (wall time is only a safety stop, at SAFETY x the budget): ops priced per
#: second of budget_s. Pricing every op of the program once (an `op_costs` pass, or a
#: partition's `stage_costs`) is len(graph.ops) of work; an intra-stage MILP is its
#: joint options at the ILP searcher's nominal rate. Measured on a shared 2-core machine:
#: 26,000 to 31,000 per second on mlp, vgg19, bert-large (6 layers, 16 devices) and
#: gpt2-xl (8 layers), whole searches of 1 to 23 s; the rate leaves a margin.
OPS_PER_SECOND = 20_000


@dataclasses.dataclass
class Work:
    """Work done against a budget: counted, and a wall-clock safety stop."""

    budget_s: float
    done: float = 0.0
    start: float = dataclasses.field(default_factory=_time.perf_counter)

    @property
    def limit(self) -> float:
        return self.budget_s * OPS_PER_SECOND

    def add(self, ops: float) -> None:
        self.done += ops

    def spent(self) -> bool:
        wall = _time.perf_counter() - self.start
        return self.done >= self.limit or wall > SAFETY * self.budget_s

    def wall_left(self) -> float:
        """Seconds to the safety stop (for a solver's own time limit)."""
        return SAFETY * self.budget_s - (_time.perf_counter() - self.start)
