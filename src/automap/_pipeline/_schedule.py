"""GPipe and 1F1B: the order each stage runs its microbatches in, and when.

One source for the three places that need a schedule: the runtime executes `global_order`,
the cost model times `simulate`, and the report draws it. Keeping them one function is
what lets a test hold the runtime's order of work against the one the cost model assumes.
"""

from __future__ import annotations

from collections.abc import Sequence

SCHEDULES = ("gpipe", "1f1b")

#: One unit of pipeline work: (stage, "F" or "B", microbatch).
Work = tuple[int, str, int]


def stage_orders(stages: int, microbatches: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Per stage, its ("F"/"B", microbatch) items in the order it runs them.

    GPipe: every forward, then every backward (last microbatch first, as its activations
    are the newest). 1F1B: stage s warms up with S - s - 1 forwards, then alternates one
    forward and one backward, so it holds at most S - s microbatches' activations.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    orders = []
    for s in range(stages):
        if schedule == "gpipe":
            order = [("F", m) for m in range(microbatches)]
            order += [("B", m) for m in reversed(range(microbatches))]
        else:
            warm = min(stages - s - 1, microbatches)
            order = [("F", m) for m in range(warm)]
            for i in range(microbatches - warm):
                order += [("F", warm + i), ("B", i)]
            order += [("B", m) for m in range(microbatches - warm, microbatches)]
        orders.append(order)
    return orders


def simulate(
    stages: int,
    microbatches: int,
    schedule: str,
    times: Sequence[tuple[float, float]],
    send_s: Sequence[float] | None = None,
    reduce_s: Sequence[float] | None = None,
) -> list[tuple[int, str, int, float, float]]:
    """Run the schedule in time: (stage, "F"/"B", microbatch, start, end) per unit of work.

    `times[s]` is stage s's (forward, backward) seconds per microbatch; `send_s[s]` the
    point-to-point time to pass a microbatch's activations (or their gradients) across the
    cut between stage s and s + 1 (0 when not given). A unit starts when its stage is free
    and its input has arrived: forward after the previous stage's forward, backward after
    the next stage's backward (the last stage: after its own forward).

    `reduce_s[s]`, where given and positive, is stage s's once-per-step work after its last
    backward (its gradients' data-parallel reduction): one more unit (s, "R", -1, ...),
    listed after all the F and B units.
    """
    orders = stage_orders(stages, microbatches, schedule)
    sends = list(send_s) if send_s is not None else [0.0] * stages
    done: dict[Work, float] = {}
    free, ptr, out = [0.0] * stages, [0] * stages, []
    while any(ptr[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while ptr[s] < len(orders[s]):
                kind, m = orders[s][ptr[s]]
                if kind == "F":
                    dep, lag = ((s - 1, "F", m), sends[s - 1]) if s > 0 else (None, 0.0)
                elif s < stages - 1:
                    dep, lag = (s + 1, "B", m), sends[s]
                else:
                    dep, lag = (s, "F", m), 0.0
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + lag
                start = max(free[s], ready)
                end = start + times[s][0 if kind == "F" else 1]
                done[(s, kind, m)], free[s] = end, end
                out.append((s, kind, m, start, end))
                ptr[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - both schedules are deadlock-free
            raise RuntimeError("pipeline schedule deadlocked")
    for s, seconds in enumerate(() if reduce_s is None else reduce_s):
        if seconds > 0:
            out.append((s, "R", -1, free[s], free[s] + float(seconds)))
    return out


def global_order(stages: int, microbatches: int, schedule: str) -> list[Work]:
    """One sequence of all the work that respects every dependency and every stage's own
    order: the order a single controller dispatches it in (stages then run concurrently,
    as JAX dispatch is asynchronous). Units are ordered by their start time in a
    simulation with unit times, ties by stage."""
    ops = simulate(stages, microbatches, schedule, [(1.0, 2.0)] * stages)
    return [(s, k, m) for s, k, m, _, _ in sorted(ops, key=lambda o: (o[3], o[0]))]
