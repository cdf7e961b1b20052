"""Searchers over the shard space that need no learning: exhaustive, random and MCMC.

They share a `Tracker` that keeps the best feasible point, the time it was found and a
learning curve, so that every searcher reports the same figures side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from .._plan import Cost
from .._space import ShardSpace

ShardPoint = tuple[int, tuple[int, ...], int]  # (mesh index, option per unit, ZeRO stage)


# A time budget is turned into a number of cost-model evaluations at this nominal rate, so
# that the same seed gives the same plan on a fast machine and a slow one. Wall time is
# only a safety stop at SAFETY x the budget.
EVALS_PER_SECOND = 200
SAFETY = 5.0
#: A space with at most this many option sequences per mesh is counted exactly, so that a
#: sampling search stops once it has seen every point (more samples can find nothing).
COUNTED = 10_000

#: Set by a signal handler (the CLI's SIGTERM) to stop a search as Ctrl-C does. Polled, so
#: that the stop still happens when the KeyboardInterrupt the handler raises lands where
#: Python ignores exceptions (a garbage-collector callback, say).
STOP = threading.Event()


@dataclasses.dataclass
class Tracker:
    """Best feasible point so far, with the time it took to find it and a curve."""

    budget_s: float
    max_evals: int = 0  # 0: derived from budget_s
    start: float = dataclasses.field(default_factory=time.perf_counter)
    best: ShardPoint | None = None
    best_time: float = math.inf
    time_to_best_s: float = 0.0
    evaluated: int = 0
    curve: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
    # Called after each evaluation with (point, cost, best time so far): progress bars.
    on_offer: Callable[[ShardPoint, Cost, float], None] | None = None
    # Set when Ctrl-C ended the search early: `best` is the best so far, not the budget's.
    interrupted: bool = False
    # False when an exhaustive enumeration ran out of budget before the end: no proof.
    complete: bool = True
    # Set by `cover`: the space's exact size, and the distinct points of it seen so far.
    space_size: int | None = None
    seen: set[ShardPoint] = dataclasses.field(default_factory=set)
    contains: Callable[[ShardPoint], bool] | None = None

    def cover(self, space: ShardSpace) -> None:
        """Count the points of a small space, so that the search ends when it has seen every
        one (`exhausted`): a sampling search would otherwise draw them again until its
        budget, hundreds of thousands of times on a space of one point."""
        self.space_size = space.exact_size(cap=COUNTED)
        self.contains = space.contains

    @property
    def exhausted(self) -> bool:
        return self.space_size is not None and len(self.seen) >= self.space_size

    def offer(self, point: ShardPoint, cost: Cost) -> None:
        self.evaluated += 1
        if self.space_size is not None and self.contains is not None and self.contains(point):
            self.seen.add(point)
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
        if self.stop_requested():
            return True
        if self.exhausted:
            return True
        return self.evaluated >= self.max_evals or self.elapsed >= SAFETY * self.budget_s

    def stop_requested(self) -> bool:
        """True when `STOP` asks the search to end, with the best point kept (marked
        `interrupted`); before any feasible point it is a KeyboardInterrupt, as Ctrl-C."""
        if not STOP.is_set():
            return False
        if self.best is None:
            raise KeyboardInterrupt
        self.interrupted = True
        return True

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


def options_of(space: ShardSpace, mesh_index: int, rng: np.random.Generator) -> tuple[int, ...]:
    mesh = space.meshes[mesh_index]
    chosen: list[int] = []
    for unit in range(len(space.units)):
        allowed = np.flatnonzero(space.allowed(mesh, unit, chosen))
        chosen.append(int(rng.choice(allowed)))
    return tuple(chosen)


def random_point(space: ShardSpace, rng: np.random.Generator) -> ShardPoint:
    mesh_index = int(rng.integers(len(space.meshes)))
    options = options_of(space, mesh_index, rng)
    zero = int(rng.choice(space.zero_options(space.meshes[mesh_index], options)))
    return mesh_index, options, zero


def evaluate(space: ShardSpace, point: ShardPoint) -> Cost:
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

    def out_of_budget() -> bool:
        # Checked before every point and every branch: a stop proves nothing.
        if tracker.elapsed >= tracker.budget_s or tracker.stop_requested():
            tracker.complete = False
            return True
        return False

    with tracker.interruptible():
        for mesh_index, mesh in enumerate(space.meshes):
            stack: list[tuple[int, ...]] = [()]
            while stack:
                chosen = stack.pop()
                if len(chosen) == len(space.units):
                    for zero in space.zero_options(mesh, chosen):
                        if out_of_budget():
                            return tracker
                        point = (mesh_index, chosen, zero)
                        tracker.offer(point, evaluate(space, point))
                    continue
                if out_of_budget():
                    return tracker
                mask = space.allowed(mesh, len(chosen), chosen)
                stack.extend((*chosen, int(k)) for k in np.flatnonzero(mask)[::-1])
    return tracker


def search_mcmc(
    space: ShardSpace,
    tracker: Tracker,
    seed: int,
    start: ShardPoint | None = None,
    temperature: float = 0.05,
    cooling: float = 0.999,
) -> Tracker:
    """Simulated annealing (FlexFlow-style): change one decision, accept by Metropolis on
    the step time relative to the current one; restarts from the best on a new mesh.

    On a counted space (`Tracker.cover`) a chain that proposes only points it has seen, as
    many times in a row as the space has points, restarts at the first point it has not
    seen: a cold chain keeps to its neighbourhood, and would otherwise never see the whole
    space, so never stop before its budget."""
    rng = np.random.default_rng(seed)
    with tracker.interruptible():
        current = start or random_point(space, rng)
        current_cost = evaluate(space, current)
        tracker.offer(current, current_cost)
        temp, stalled, unseen = temperature, 0, _points(space)
        while not tracker.out_of_time():
            proposal = _neighbour(space, current, rng)
            restart = False
            if tracker.space_size is not None:
                stalled = stalled + 1 if proposal in tracker.seen else 0
                if stalled >= tracker.space_size:
                    proposal = next(p for p in unseen if p not in tracker.seen)
                    restart, stalled = True, 0
            cost = evaluate(space, proposal)
            tracker.offer(proposal, cost)
            old = _energy(current_cost)
            new = _energy(cost)
            if (
                restart
                or new <= old
                or rng.random() < math.exp(-(new - old) / max(temp * old, 1e-12))
            ):
                current, current_cost = proposal, cost
            temp *= cooling
    return tracker


def _points(space: ShardSpace) -> Iterator[ShardPoint]:
    """Every point of the space, in the exhaustive search's order."""
    for mesh_index, mesh in enumerate(space.meshes):
        stack: list[tuple[int, ...]] = [()]
        while stack:
            chosen = stack.pop()
            if len(chosen) == len(space.units):
                for zero in space.zero_options(mesh, chosen):
                    yield mesh_index, chosen, int(zero)
                continue
            mask = space.allowed(mesh, len(chosen), chosen)
            stack.extend((*chosen, int(k)) for k in np.flatnonzero(mask)[::-1])


def _energy(cost: Cost) -> float:
    # Infeasible plans are allowed as stepping stones but cost more the further over memory.
    if cost.feasible:
        return cost.step_time_s
    over = cost.memory_bytes / max(cost.memory_limit_bytes, 1.0)
    return cost.step_time_s * (10.0 + over)


def _neighbour(space: ShardSpace, point: ShardPoint, rng: np.random.Generator) -> ShardPoint:
    mesh_index, options, zero = point
    roll = rng.random()
    if roll < 0.1 and len(space.meshes) > 1:
        mesh_index = int(rng.integers(len(space.meshes)))
        return mesh_index, options_of(space, mesh_index, rng), 0
    if roll < 0.2:
        zeros = space.zero_options(space.meshes[mesh_index], options)
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
    options = _repair(space, mesh, chosen, unit)
    # The batch moved off the data axis: no ZeRO there (`ShardSpace.zero_options`).
    return mesh_index, options, zero if zero in space.zero_options(mesh, options) else 0


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
