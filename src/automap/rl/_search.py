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
    agent = _search_agent(process, seed, config, agent, resume)
    config = agent.config
    env = PlanningEnv(
        process,
        shaping=config.shaped_rewards and isinstance(process, ShapedProcess),
        log_scale=config.log_rewards,
    )
    run = _Run.fresh(seed, agent) if resume is None else _Run.resumed(resume)
    interrupted = mid_episode = False
    ctrl_c = _CtrlC()
    try:
        while True:
            if ctrl_c.pressed:
                if not run.best_decisions:
                    raise KeyboardInterrupt
                interrupted = True
                break
            if run.out_of_budget(budget_s, config.max_episodes, len(seed_episodes)):
                break
            forced = list(seed_episodes[run.episode]) if run.episode < len(seed_episodes) else None
            branch = run.branch_point(forced, config.explore_from_best)
            mid_episode = True
            info, losses = _play_episode(env, agent, run, forced, branch, seed)
            run.keep_best(info)
            mid_episode = False
            row = run.log(info, losses, agent.exploration)
            if on_episode is not None:
                on_episode(
                    run.episode, run.best[0], row["current_time"], row["exploration"], row["loss"]
                )
            if stop_at is not None and run.best[1] and run.best[0] <= stop_at:
                break
            if exhausted is not None and exhausted(info["decisions"]):
                break
    except KeyboardInterrupt:
        # Ctrl-C keeps the best plan so far rather than throwing the search away; before
        # the first finished episode there is no plan, so the interrupt goes on.
        if not run.best_decisions:
            raise
        interrupted = True
        if mid_episode:
            # The unfinished episode's steps are in the replay already (a resume then differs
            # from an unbroken search); the ones still waiting for their n-step return would
            # be joined to the next episode's: drop them.
            agent.replay.discard_pending()
    finally:
        ctrl_c.restore()
    return run.result(agent, interrupted)


def _search_agent(
    process: DecisionProcess,
    seed: int,
    config: DQNConfig | None,
    agent: DQNAgent | None,
    resume: SearchCheckpoint | None,
) -> DQNAgent:
    """The agent that searches: the one given, or a fresh one (restored from `resume`)."""
    if agent is not None and config is not None and config != agent.config:
        raise ValueError("pass either an agent or a config: the agent brings its own config")
    if agent is not None and resume is not None:
        raise ValueError("a resumed search brings its own agent: pass agent or resume, not both")
    if agent is None:
        agent = DQNAgent(process.obs_dim, process.n_actions, config, seed=seed)
        if resume is not None:
            agent.from_state_dict(resume.agent)
    return agent


@dataclasses.dataclass
class _Run:
    """The search loop's own state between episodes: what a `SearchCheckpoint` saves, less
    the agent. Mutable, since the loop updates it after every episode; `checkpoint` takes
    its frozen snapshot."""

    best: tuple[float, bool, float]
    """(step time s, feasible, over-ratio) of the best plan so far."""
    best_decisions: tuple[int, ...]
    time_to_best: float
    before: float
    """Search seconds spent by earlier runs of this search (a resume goes on counting)."""
    episode: int
    curve: list[dict[str, Any]]
    rng: np.random.Generator
    """Draws the explore-from-best branch points."""
    start: float = dataclasses.field(default_factory=time.perf_counter)

    @classmethod
    def fresh(cls, seed: int, agent: DQNAgent) -> _Run:
        # Seeded by the agent's progress too, so that a search continuing a given agent
        # does not replay the branch points of the one that trained it.
        rng = np.random.default_rng([seed, agent.env_steps])
        return cls((float("inf"), False, float("inf")), (), 0.0, 0.0, 0, [], rng)

    @classmethod
    def resumed(cls, resume: SearchCheckpoint) -> _Run:
        return cls(
            best=resume.best,
            best_decisions=resume.best_decisions,
            time_to_best=resume.time_to_best_s,
            before=resume.elapsed_s,
            episode=resume.episode,
            curve=list(resume.curve),
            rng=rng_from_state(resume.rng_state),
        )

    def elapsed(self) -> float:
        """Search seconds so far, over every run of this search."""
        return self.before + time.perf_counter() - self.start

    def out_of_budget(self, budget_s: float, max_episodes: int | None, n_seeds: int) -> bool:
        # Seed episodes always run: an expert plan must be a candidate even on a tiny budget.
        if self.episode < n_seeds:
            return False
        over_episodes = max_episodes is not None and self.episode >= max_episodes
        return time.perf_counter() - self.start >= budget_s or over_episodes

    def branch_point(self, forced: list[int] | None, explore_from_best: float) -> int:
        """The step at which this episode leaves the best plan so far, or -1 for none.

        Go-Explore style: some episodes return to the best plan so far along its own
        decisions, leave it at one random step, and let the agent finish from there. The
        greedy policy alone revisits its own plan; this explores around the best one."""
        if forced is None and self.best_decisions and self.rng.random() < explore_from_best:
            return int(self.rng.integers(len(self.best_decisions)))
        return -1

    def keep_best(self, info: dict[str, Any]) -> None:
        """Count the finished episode, keeping its plan if it is the best so far."""
        time_s, feasible, over = info["step_time_s"], info["feasible"], info["over_ratio"]
        if _better(time_s, feasible, over, self.best):
            self.best = (time_s, feasible, over)
            self.best_decisions = info["decisions"]
            self.time_to_best = self.elapsed()
        self.episode += 1

    def log(self, info: dict[str, Any], losses: list[float], exploration: float) -> dict[str, Any]:
        """The finished episode's row of the learning curve (appended to it)."""
        row = {
            "episode": self.episode,
            "elapsed_s": self.elapsed(),
            "best_time": self.best[0],
            "current_time": info["step_time_s"],
            "feasible": info["feasible"],
            "exploration": exploration,
            "loss": sum(losses) / len(losses) if losses else None,
        }
        self.curve.append(row)
        return row

    def result(self, agent: DQNAgent, interrupted: bool) -> SearchResult:
        checkpoint = SearchCheckpoint(
            agent=agent.to_state_dict(),
            episode=self.episode,
            best=self.best,
            best_decisions=self.best_decisions,
            time_to_best_s=self.time_to_best,
            elapsed_s=self.elapsed(),
            rng_state=self.rng.bit_generator.state,
            curve=self.curve,
        )
        return SearchResult(
            best_decisions=self.best_decisions,
            best_time=self.best[0],
            best_feasible=self.best[1],
            episodes=self.episode,
            time_to_best_s=self.time_to_best,
            curve=self.curve,
            interrupted=interrupted,
            checkpoint=checkpoint,
            agent=agent,
        )


def _play_episode(
    env: PlanningEnv,
    agent: DQNAgent,
    run: _Run,
    forced: list[int] | None,
    branch: int,
    seed: int,
) -> tuple[dict[str, Any], list[float]]:
    """Play one episode, learning at every step: (the last step's info, the losses)."""
    episode = run.episode
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
            action = run.best_decisions[t]
        elif t == branch:
            others = np.flatnonzero(mask)
            others = others[others != run.best_decisions[t]]
            action = int(run.rng.choice(others)) if len(others) else run.best_decisions[t]
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
        raise ValueError(f"seed episode {episode} has {len(forced)} decisions, the plan took {t}")
    return info, losses


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
