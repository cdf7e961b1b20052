"""The DQN search loop, readable top to bottom (CleanRL style).

Episodes build plans one decision at a time; every step is stored in the replay and, after a
warm-up, followed by one training step. The best finished plan is kept: the fastest feasible
one, or while none is feasible, the one least over memory. Expert plans given as
`seed_episodes` are played first, so they seed the replay and count as candidates.

Ctrl-C ends the search at the end of the episode it is in (a second one at once), so
that the state it hands back (`SearchResult.checkpoint`) is a whole number of episodes and
resuming it plays on exactly as if the search had never stopped.
"""

from __future__ import annotations

import csv
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._agent import DQNAgent, DQNConfig
from ._checkpoint import SearchCheckpoint, rng_from_state
from ._env import DecisionProcess, PlanningEnv, ShapedProcess

OnEpisode = Callable[[int, float, float, float, "float | None"], None]
"""on_episode(episode, best_time, current_time, epsilon_or_noise, loss)."""


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What a search found and how it got there."""

    best_decisions: tuple[int, ...]
    """The decisions of the best plan (the process rebuilds the plan from them)."""
    best_time: float
    """Its predicted step time in seconds (inf if no episode finished)."""
    best_feasible: bool
    """Whether it fits in memory."""
    episodes: int
    """Episodes played, seed episodes included."""
    time_to_best_s: float
    """Seconds from the start of the search to the first time the best plan was seen."""
    curve: list[dict[str, Any]]
    """One row per episode: episode, elapsed_s, best_time, current_time, feasible,
    exploration (epsilon or noise scale), loss (mean over the episode, None before training)."""
    interrupted: bool = False
    """Whether Ctrl-C ended the search before its budget: the best plan is the best so far."""
    checkpoint: SearchCheckpoint | None = None
    """The whole state of the search when it stopped: `search(resume=...)` goes on from it."""
    agent: DQNAgent | None = None
    """The trained agent (to save for a warm start elsewhere)."""


def _better(time_s: float, feasible: bool, over: float, best: tuple[float, bool, float]) -> bool:
    best_time, best_feasible, best_over = best
    if feasible != best_feasible:
        return feasible
    if feasible:
        return time_s < best_time
    return (over, time_s) < (best_over, best_time)


def search(
    process: DecisionProcess,
    *,
    budget_s: float,
    seed: int = 0,
    config: DQNConfig | None = None,
    agent: DQNAgent | None = None,
    seed_episodes: Sequence[Sequence[int]] = (),
    on_episode: OnEpisode | None = None,
    stop_at: float | None = None,
    resume: SearchCheckpoint | None = None,
    exhausted: Callable[[tuple[int, ...]], bool] | None = None,
) -> SearchResult:
    """Search the plans of `process` with a DQN agent for `budget_s` seconds.

    `agent` continues (or warm-starts from) an existing agent; otherwise a fresh one is made
    from `config` and `seed`. The loop also stops after `config.max_episodes` episodes, and
    as soon as a feasible plan at or under `stop_at` seconds is found (for benchmarks and
    tests that know the optimum and measure the time to reach it). Ctrl-C (KeyboardInterrupt)
    ends it early with the best plan so far and `interrupted=True`.

    `resume` goes on from a stopped search's `checkpoint` (same process and seed): its
    episodes count toward `config.max_episodes`, which is the total over every run.

    `exhausted`, given each episode's decisions, says when the process has no plan left
    that the search has not played (a small space, counted): the search ends there.
    """
    if agent is not None and config is not None and config != agent.config:
        raise ValueError("pass either an agent or a config: the agent brings its own config")
    if agent is not None and resume is not None:
        raise ValueError("a resumed search brings its own agent: pass agent or resume, not both")
    if agent is None:
        agent = DQNAgent(process.obs_dim, process.n_actions, config, seed=seed)
        if resume is not None:
            agent.from_state_dict(resume.agent)
    config = agent.config
    env = PlanningEnv(
        process,
        shaping=config.shaped_rewards and isinstance(process, ShapedProcess),
        log_scale=config.log_rewards,
    )
    start = time.perf_counter()
    if resume is None:
        best = (float("inf"), False, float("inf"))  # (time, feasible, over-ratio)
        best_decisions: tuple[int, ...] = ()
        time_to_best, before, episode = 0.0, 0.0, 0
        curve: list[dict[str, Any]] = []
        # Seeded by the agent's progress too, so that a search continuing a given agent
        # does not replay the branch points of the one that trained it.
        rng = np.random.default_rng([seed, agent.env_steps])
    else:
        best, best_decisions = resume.best, resume.best_decisions
        time_to_best, before, episode = resume.time_to_best_s, resume.elapsed_s, resume.episode
        curve = list(resume.curve)
        rng = rng_from_state(resume.rng_state)

    interrupted = mid_episode = False
    ctrl_c = _CtrlC()
    try:
        while True:
            elapsed = time.perf_counter() - start
            if ctrl_c.pressed:
                if not best_decisions:
                    raise KeyboardInterrupt
                interrupted = True
                break
            # Seed episodes always run: an expert plan must be a candidate even on a tiny budget.
            if episode >= len(seed_episodes) and (
                elapsed >= budget_s
                or (config.max_episodes is not None and episode >= config.max_episodes)
            ):
                break
            forced = list(seed_episodes[episode]) if episode < len(seed_episodes) else None
            # Go-Explore style: some episodes return to the best plan so far along its own
            # decisions, leave it at one random step, and let the agent finish from there. The
            # greedy policy alone revisits its own plan; this explores around the best one.
            branch = -1
            if forced is None and best_decisions and rng.random() < config.explore_from_best:
                branch = int(rng.integers(len(best_decisions)))

            # --- play one episode, learning at every step ---
            mid_episode = True
            obs, info = env.reset(seed=seed + episode)
            mask = info["action_mask"]
            losses: list[float] = []
            t, done = 0, False
            while not done:
                if forced is not None:
                    if t >= len(forced):
                        raise ValueError(f"seed episode {episode} ends before the plan is complete")
                    action = forced[t]
                elif t < branch:
                    action = best_decisions[t]
                elif t == branch:
                    others = np.flatnonzero(mask)
                    others = others[others != best_decisions[t]]
                    action = int(rng.choice(others)) if len(others) else best_decisions[t]
                else:
                    action = agent.act(obs, mask)
                next_obs, reward, done, _, info = env.step(action)
                next_mask = info["action_mask"]
                agent.observe(obs, mask, action, reward, next_obs, next_mask, done)
                loss = agent.update()
                if loss is not None:
                    losses.append(loss)
                obs, mask, t = next_obs, next_mask, t + 1
            if forced is not None and t != len(forced):
                raise ValueError(
                    f"seed episode {episode} has {len(forced)} decisions, the plan took {t}"
                )

            # --- keep the best plan ---
            time_s, feasible, over = info["step_time_s"], info["feasible"], info["over_ratio"]
            if _better(time_s, feasible, over, best):
                best = (time_s, feasible, over)
                best_decisions = info["decisions"]
                time_to_best = before + time.perf_counter() - start
            episode += 1
            mid_episode = False

            row = {
                "episode": episode,
                "elapsed_s": before + time.perf_counter() - start,
                "best_time": best[0],
                "current_time": time_s,
                "feasible": feasible,
                "exploration": agent.exploration,
                "loss": sum(losses) / len(losses) if losses else None,
            }
            curve.append(row)
            if on_episode is not None:
                on_episode(episode, best[0], time_s, row["exploration"], row["loss"])
            if stop_at is not None and best[1] and best[0] <= stop_at:
                break
            if exhausted is not None and exhausted(info["decisions"]):
                break
    except KeyboardInterrupt:
        # Ctrl-C keeps the best plan so far rather than throwing the search away; before
        # the first finished episode there is no plan, so the interrupt goes on.
        if not best_decisions:
            raise
        interrupted = True
        if mid_episode:
            # The unfinished episode's steps are in the replay already (a resume then differs
            # from an unbroken search); the ones still waiting for their n-step return would
            # be joined to the next episode's: drop them.
            agent.replay.discard_pending()
    finally:
        ctrl_c.restore()

    checkpoint = SearchCheckpoint(
        agent=agent.to_state_dict(),
        episode=episode,
        best=best,
        best_decisions=best_decisions,
        time_to_best_s=time_to_best,
        elapsed_s=before + time.perf_counter() - start,
        rng_state=rng.bit_generator.state,
        curve=curve,
    )
    return SearchResult(
        best_decisions=best_decisions,
        best_time=best[0],
        best_feasible=best[1],
        episodes=episode,
        time_to_best_s=time_to_best,
        curve=curve,
        interrupted=interrupted,
        checkpoint=checkpoint,
        agent=agent,
    )


class _CtrlC:
    """While a search runs, the first Ctrl-C only asks it to stop after the episode it is in
    (so its state is whole episodes and resumes exactly); a second one interrupts at once.

    Signal handlers can only be set from the main thread: elsewhere Ctrl-C is left alone
    (KeyboardInterrupt, handled by `search` as before).
    """

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


CURVE_FIELDS = (
    "episode", "elapsed_s", "best_time", "current_time", "feasible", "exploration", "loss",
)  # fmt: skip


def write_curve(curve: Sequence[dict[str, Any]], path: str | Path) -> None:
    """The learning curve as CSV, one row per episode (an empty loss before training starts)."""
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CURVE_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in curve:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in CURVE_FIELDS})
