"""Searchers over the shard space that need no learning: exhaustive, random and MCMC.

They share a `Tracker` that keeps the best feasible point, the time it was found and a
learning curve, so that every searcher reports the same figures side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ._errors import AutomapError
from ._plan import Cost
from ._space import ShardSpace

Point = tuple[int, tuple[int, ...], int]  # (mesh index, option per unit, ZeRO stage)


# A time budget is turned into a number of cost-model evaluations at this nominal rate, so
# that the same seed gives the same plan on a fast machine and a slow one. Wall time is
# only a safety stop at SAFETY x the budget.
EVALS_PER_SECOND = 200
SAFETY = 5.0

#: Searchers that end on their own (a proof, a whole enumeration, a fixed list): for them a
#: budget of inf means "no time limit, run to the end". dqn, random and mcmc (and "auto",
#: which samples) go on until the budget is spent, so inf would never end and is refused.
RUN_TO_THE_END = ("ilp", "exhaustive", "dp", "expert")


def check_budget(
    budget_s: object, searchers: Sequence[str] | None = None, option: str = "budget_s"
) -> float:
    """The one rule for a search budget, shared by `am.plan`, `compare` and the CLI's
    `--budget`: seconds > 0 (not 0, negative or NaN); inf only when every searcher in
    `searchers` ends on its own (None: any searcher may run, so inf is refused)."""
    example = "--budget 30" if option.startswith("-") else f"{option}=30"
    real = isinstance(budget_s, numbers.Real) and not isinstance(budget_s, bool)
    if not real or not budget_s > 0:  # `not >` also catches NaN
        shown = f"{budget_s:g}" if real else repr(budget_s)
        raise AutomapError(
            f"{option} is seconds of search and must be a positive number, got {shown} "
            f"(e.g. {example})."
        )
    if math.isinf(budget_s):
        endless = [s for s in (searchers or ("dqn",)) if s not in RUN_TO_THE_END]
        if endless:
            raise AutomapError(
                f"{option} inf means 'run until the search ends', and the {endless[0]} "
                f"searcher samples until its budget is spent: give seconds (e.g. {example}), "
                f"or use one that ends on its own ({', '.join(RUN_TO_THE_END)})."
            )
    return float(budget_s)


@dataclasses.dataclass
class Tracker:
    """Best feasible point so far, with the time it took to find it and a curve."""

    budget_s: float
    max_evals: int = 0  # 0: derived from budget_s
    start: float = dataclasses.field(default_factory=time.perf_counter)
    best: Point | None = None
    best_time: float = math.inf
    time_to_best_s: float = 0.0
    evaluated: int = 0
    curve: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
    # Called after each evaluation with (point, cost, best time so far): progress bars.
    on_offer: Callable[[Point, Cost, float], None] | None = None
    # Set when Ctrl-C ended the search early: `best` is the best so far, not the budget's.
    interrupted: bool = False
    # False when an exhaustive enumeration ran out of budget before the end: no proof.
    complete: bool = True

    def offer(self, point: Point, cost: Cost) -> None:
        self.evaluated += 1
        if cost.feasible and cost.step_time_s < self.best_time:
            self.best, self.best_time = point, cost.step_time_s
            self.time_to_best_s = self.elapsed
        self.curve.append((self.evaluated, self.best_time, cost.step_time_s))
        if self.on_offer is not None:
            self.on_offer(point, cost, self.best_time)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __post_init__(self) -> None:
        if self.max_evals <= 0:
            # An infinite budget (searchers that end on their own) counts no evaluations.
            evals = self.budget_s * EVALS_PER_SECOND
            self.max_evals = max(1, int(evals)) if math.isfinite(evals) else sys.maxsize

    def out_of_time(self) -> bool:
        return self.evaluated >= self.max_evals or self.elapsed >= SAFETY * self.budget_s

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Ctrl-C inside ends the search and keeps the best point so far, marked
        `interrupted`: a long search a user stops is not wasted. With no feasible point yet
        there is nothing worth keeping, so the interrupt goes on to the caller."""
        try:
            yield
        except KeyboardInterrupt:
            if self.best is None:
                raise
            self.interrupted = True


def _options_of(space: ShardSpace, mesh_index: int, rng: np.random.Generator) -> tuple[int, ...]:
    mesh = space.meshes[mesh_index]
    chosen: list[int] = []
    for unit in range(len(space.units)):
        allowed = np.flatnonzero(space.allowed(mesh, unit, chosen))
        chosen.append(int(rng.choice(allowed)))
    return tuple(chosen)


def random_point(space: ShardSpace, rng: np.random.Generator) -> Point:
    mesh_index = int(rng.integers(len(space.meshes)))
    options = _options_of(space, mesh_index, rng)
    zero = int(rng.choice(space.zero_options(space.meshes[mesh_index])))
    return mesh_index, options, zero


def evaluate(space: ShardSpace, point: Point) -> Cost:
    return space.evaluate(point[0], point[1], zero_stage=point[2])


def search_random(space: ShardSpace, tracker: Tracker, seed: int) -> Tracker:
    """Uniform random valid points until the budget runs out."""
    rng = np.random.default_rng(seed)
    with tracker.interruptible():
        while not tracker.out_of_time():
            point = random_point(space, rng)
            tracker.offer(point, evaluate(space, point))
    return tracker


def search_exhaustive(space: ShardSpace, tracker: Tracker, max_points: int = 200_000) -> Tracker:
    """Every valid point, in a fixed order: the optimum of the space under the cost model.

    The budget is wall time here (the enumeration order is fixed, so only where it stops
    depends on the machine): past it the search stops with `tracker.complete` False and
    its best point so far, which proves nothing. Give it the time the space needs."""
    size = space.size()
    if size > max_points:
        raise ValueError(
            f"the space has {size:,} points, more than the exhaustive limit {max_points:,}; "
            "use searcher='ilp' or a smaller model."
        )
    with tracker.interruptible():
        for mesh_index, mesh in enumerate(space.meshes):
            stack: list[tuple[int, ...]] = [()]
            while stack:
                chosen = stack.pop()
                if tracker.elapsed >= tracker.budget_s:
                    tracker.complete = False
                    return tracker
                if len(chosen) == len(space.units):
                    for zero in space.zero_options(mesh):
                        point = (mesh_index, chosen, zero)
                        tracker.offer(point, evaluate(space, point))
                    continue
                mask = space.allowed(mesh, len(chosen), chosen)
                stack.extend((*chosen, int(k)) for k in np.flatnonzero(mask)[::-1])
    return tracker


def search_mcmc(
    space: ShardSpace,
    tracker: Tracker,
    seed: int,
    start: Point | None = None,
    temperature: float = 0.05,
    cooling: float = 0.999,
) -> Tracker:
    """Simulated annealing (FlexFlow-style): change one decision, accept by Metropolis on
    the step time relative to the current one; restarts from the best on a new mesh."""
    rng = np.random.default_rng(seed)
    with tracker.interruptible():
        current = start or random_point(space, rng)
        current_cost = evaluate(space, current)
        tracker.offer(current, current_cost)
        temp = temperature
        while not tracker.out_of_time():
            proposal = _neighbour(space, current, rng)
            cost = evaluate(space, proposal)
            tracker.offer(proposal, cost)
            old = _energy(current_cost)
            new = _energy(cost)
            if new <= old or rng.random() < math.exp(-(new - old) / max(temp * old, 1e-12)):
                current, current_cost = proposal, cost
            temp *= cooling
    return tracker


def _energy(cost: Cost) -> float:
    # Infeasible plans are allowed as stepping stones but cost more the further over memory.
    if cost.feasible:
        return cost.step_time_s
    over = cost.memory_bytes / max(cost.memory_limit_bytes, 1.0)
    return cost.step_time_s * (10.0 + over)


def _neighbour(space: ShardSpace, point: Point, rng: np.random.Generator) -> Point:
    mesh_index, options, zero = point
    roll = rng.random()
    if roll < 0.1 and len(space.meshes) > 1:
        mesh_index = int(rng.integers(len(space.meshes)))
        return mesh_index, _options_of(space, mesh_index, rng), 0
    if roll < 0.2:
        zeros = space.zero_options(space.meshes[mesh_index])
        return mesh_index, options, int(rng.choice(zeros))
    if not options:
        return point
    unit = int(rng.integers(len(options)))
    mesh = space.meshes[mesh_index]
    chosen = list(options)
    # The mask for this unit against every other decided unit, not just earlier ones.
    mask = space.allowed(mesh, unit, _with_hole(chosen, unit))
    mask[chosen[unit]] = False
    if not mask.any():
        return point
    chosen[unit] = int(rng.choice(np.flatnonzero(mask)))
    return mesh_index, _repair(space, mesh, chosen, unit), zero


def _repair(
    space: ShardSpace, mesh: dict[str, int], chosen: list[int], fixed: int
) -> tuple[int, ...]:
    """Undo later conflicts with the changed unit so the point stays valid."""
    for unit in range(len(chosen)):
        if unit == fixed:
            continue
        if not space.allowed(mesh, unit, _with_hole(chosen, unit))[chosen[unit]]:
            chosen[unit] = 0
    return tuple(chosen)


def _with_hole(chosen: list[int], unit: int) -> list[int | None]:
    return [None if i == unit else c for i, c in enumerate(chosen)]
