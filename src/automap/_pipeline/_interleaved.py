"""Interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2; Megatron-LM's virtual
pipeline): each device group holds v model chunks, virtual stage p = chunk * S + s on
group s, so a microbatch crosses every group v times.

Each group runs Megatron-LM's order (`forward_backward_pipelining_with_interleaving`):
its m * v forwards go in rounds of S microbatches per chunk (chunk 0 of microbatches
0..S-1, then chunk 1 of the same, ...), backwards likewise with the chunks reversed;
group s warms up with 2 (S - s - 1) + (v - 1) S forwards, then alternates one forward and
one backward, then drains. Each unit is 1/v of a device's work per microbatch, so the
bubble is (S - 1) / v slots of a microbatch's forward + backward, v times smaller than
1F1B's, for v times the point-to-point sends; and group s holds
min(2 (S - s - 1) + (v - 1) S + 1, m v) (microbatch, chunk) activations at its peak,
more than 1F1B's S - s microbatches of v chunks each when m > S (the paper's trade).
Megatron-LM's order needs the microbatches to come in whole rounds: m a multiple of S.
"""

from __future__ import annotations

from .._errors import PlanError
from ._phase import Phase
from ._schedule import PipelineSchedule, Task


class Interleaved(PipelineSchedule):
    name = "interleaved"

    def __init__(self, chunks: int = 2) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
            raise PlanError(
                f"interleaved 1F1B needs 2 or more virtual stages per device, not {chunks!r}; "
                "give --virtual-stages 2 or more, or use schedule '1f1b' for one."
            )
        self.chunks = chunks

    def with_chunks(self, chunks: int) -> PipelineSchedule:
        return self if chunks == self.chunks else Interleaved(chunks)

    def check(self, stages: int, microbatches: int) -> None:
        """Megatron-LM's rounds: S microbatches at a time through each chunk."""
        if stages > 1 and microbatches % stages:
            raise PlanError(
                f"interleaved 1F1B runs microbatches in rounds of one per device group: "
                f"{microbatches} microbatches do not divide into rounds of {stages}; use a "
                f"multiple of {stages} microbatches."
            )

    def stage_tasks(self, stages: int, microbatches: int) -> tuple[tuple[Task, ...], ...]:
        self.check(stages, microbatches)
        return tuple(self._stage(s, stages, microbatches) for s in range(stages))

    def _warm_up(self, s: int, stages: int, microbatches: int) -> int:
        return min(2 * (stages - s - 1) + (self.chunks - 1) * stages, microbatches * self.chunks)

    def _task(self, k: int, phase: Phase, stages: int) -> Task:
        """The k-th forward (or backward) of a group: its round of S microbatches and
        its chunk within the round (backwards walk the chunks last first)."""
        v = self.chunks
        chunk = (k % (stages * v)) // stages
        if phase is Phase.BWD:
            chunk = v - 1 - chunk
        return Task(phase, (k // (stages * v)) * stages + k % stages, chunk)

    def _stage(self, s: int, stages: int, microbatches: int) -> tuple[Task, ...]:
        total, warm = microbatches * self.chunks, self._warm_up(s, stages, microbatches)
        order = [self._task(k, Phase.FWD, stages) for k in range(warm)]
        for k in range(total - warm):
            order += [self._task(warm + k, Phase.FWD, stages), self._task(k, Phase.BWD, stages)]
        order += [self._task(k, Phase.BWD, stages) for k in range(total - warm, total)]
        return tuple(order)

    def in_flight(self, stages: int, microbatches: int) -> tuple[int, ...]:
        """Per group, the most (microbatch, chunk) activations live: its warm-up and the
        forward of its first steady pair."""
        self.check(stages, microbatches)
        total = microbatches * self.chunks
        return tuple(min(self._warm_up(s, stages, microbatches) + 1, total) for s in range(stages))

    def idle_slots(self, stages: int, microbatches: int) -> float:
        return (stages - 1) / self.chunks
