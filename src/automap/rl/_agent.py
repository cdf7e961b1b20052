"""A DQN agent with the Rainbow components that fit a planning problem (Dopamine JAX style).

Pure jitted functions do the work: `select_action` (masked greedy with NoisyNet noise or
epsilon-greedy exploration) and `train_step` (double-Q n-step targets, Huber loss weighted by
prioritized-replay importance weights, Adam with gradient clipping, target-network update).
`DQNAgent` is a thin stateful shell around them: it holds the parameters, the replay memory,
the random key and the step counters, and it can be saved and restored as a state dict.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, NamedTuple

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._networks import Params, init_params, masked, noise_scale, q_values
from ._replay import Batch, PrioritizedReplay


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    """Every knob of the agent and of the search loop, with defaults sized for planning."""

    hidden: tuple[int, ...] = (128, 128)
    """Widths of the MLP torso's hidden layers."""
    noisy: bool = False
    """NoisyNet heads for exploration instead of epsilon-greedy. Off by default: on the tests'
    toy planning problems (3 problems x 3 seeds, 300 episodes) epsilon-greedy reached the exact
    optimum in 6 of 9 runs, noisy heads in 2 of 9 (the noise swamps Q gaps of a few percent)."""
    sigma0: float = 0.5
    """Initial noise scale of the noisy layers (sigma = sigma0 / sqrt(fan-in))."""
    epsilon_start: float = 1.0
    """Epsilon-greedy: exploration rate at the first step (unused with noisy layers)."""
    epsilon_end: float = 0.1
    """Epsilon-greedy: exploration rate once the schedule is over. Kept high because the search
    keeps the best plan ever seen: random detours around the greedy plan are a local search."""
    epsilon_decay_steps: int = 1000
    """Epsilon-greedy: environment steps over which epsilon falls linearly to its end value."""
    gamma: float = 1.0
    """Discount. Episodes have a fixed, finite number of decisions, so discounting would only
    shrink the signal: 1 keeps Q = the plan's final reward, and keeps the potential-based
    shaping exact (its rewards telescope only undiscounted)."""
    n_step: int = 1
    """Length of the multi-step return. Rainbow's 3 helps when the reward comes only at the
    end; with shaped per-step rewards a longer return mostly adds the cost of the next
    exploratory decisions to this one's target. Tiny BERT space, 12 seeds, 480 episodes:
    n=1 reached the optimum in 12, n=2 in 2, n=3 in about a third."""
    reward_scale: float = 10.0
    """Rewards are multiplied by this before they are stored. Plans often differ by a few
    percent of the baseline time; scaling the differences up keeps them above the noise of the
    noisy layers and inside the quadratic part of the Huber loss."""
    learning_rate: float = 1e-3
    """Adam step size."""
    adam_eps: float = 1.5e-4
    """Adam epsilon (Dopamine's Rainbow value)."""
    max_grad_norm: float = 10.0
    """Gradients are clipped to this global norm."""
    huber_delta: float = 1.0
    """The Huber loss is quadratic within this distance of the target and linear beyond."""
    batch_size: int = 64
    """Transitions per training step. On the tiny BERT space (12 seeds) 64 every second step
    reached the optimum as often and as soon (in episodes) as 128 every step, at a quarter
    of the cost: a training step is most of an episode's time."""
    replay_capacity: int = 100_000
    """Transitions the replay memory holds before the oldest are overwritten."""
    warmup_steps: int = 256
    """Transitions held before training starts."""
    train_every: int = 2
    """Environment steps between training steps (see batch_size)."""
    target_update_period: int = 100
    """Training steps between hard copies of the online network into the target (tau == 1)."""
    tau: float = 1.0
    """1 = hard target updates every `target_update_period` steps; below 1 = Polyak averaging
    target <- tau * online + (1 - tau) * target at every training step."""
    priority_alpha: float = 0.5
    """How strongly priorities shape sampling (0 = uniform)."""
    priority_beta_start: float = 0.4
    """Importance-weight exponent at the first training step."""
    priority_beta_end: float = 1.0
    """Importance-weight exponent once annealing is over (1 = fully corrected)."""
    priority_beta_steps: int = 5000
    """Training steps over which beta rises linearly to its end value."""
    priority_eps: float = 1e-3
    """Added to |td| so that no transition's priority falls to zero."""
    shaped_rewards: bool = True
    """Reward each decision by how much it lowers the partial plan's cost (potential-based
    shaping, see PlanningEnv) when the process can price partial plans."""
    log_rewards: bool = True
    """Score a plan by -log(time / baseline) rather than -time / baseline. Plans span two
    orders of magnitude (12x the baseline on the tiny BERT space) while the ones that matter
    differ by percents: the log keeps the bad ones from dominating the loss and scores a
    10% gain the same at any distance from the baseline."""
    explore_from_best: float = 0.5
    """Share of episodes that follow the best plan so far up to a random step, take another
    action there and let the agent finish (Go-Explore's return-then-explore)."""
    max_episodes: int | None = None
    """Stop the search after this many episodes even if time remains (None = time budget only)."""


class TrainState(NamedTuple):
    """What `train_step` reads and writes."""

    params: Params
    target_params: Params
    opt_state: optax.OptState
    step: jax.Array  # [] int32: training steps done
    rng: jax.Array  # the key for the noise of the next training step


def make_optimizer(config: DQNConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adam(config.learning_rate, eps=config.adam_eps),
    )


@jax.jit
def select_action(
    params: Params, obs: jax.Array, mask: jax.Array, key: jax.Array, epsilon: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(next key, action) for obs [D] under mask [A]: greedy on noisy Q, or uniform over the
    valid actions with probability epsilon. A masked action is never returned.

    The key is split inside (as Dopamine does) so that acting costs one dispatch, not three.
    """
    key, k_noise, k_explore, k_uniform = jax.random.split(key, 4)
    q = masked(q_values(params, obs[None], mask[None], k_noise)[0], mask)  # [A]
    greedy = jnp.argmax(q)
    uniform = jax.random.categorical(k_uniform, jnp.where(mask, 0.0, -jnp.inf))
    explore = jax.random.uniform(k_explore) < epsilon
    return key, jnp.where(explore, uniform, greedy).astype(jnp.int32)


@jax.jit
def greedy_action(params: Params, obs: jax.Array, mask: jax.Array) -> jax.Array:
    """The best valid action for obs [D] under the mean (noise-free) weights."""
    return jnp.argmax(masked(q_values(params, obs[None], mask[None])[0], mask)).astype(jnp.int32)


@functools.cache
def _learner_config(config: DQNConfig) -> DQNConfig:
    """The config with the fields train_step never reads set to their defaults.

    train_step is compiled once per distinct config; a search that only changes its episode
    count or exploration schedule must reuse the compiled step rather than pay seconds again.
    """
    default = DQNConfig()
    unread = (
        "noisy", "sigma0", "epsilon_start", "epsilon_end", "epsilon_decay_steps", "n_step",
        "reward_scale", "gamma", "replay_capacity", "warmup_steps", "train_every", "priority_alpha",
        "priority_beta_start", "priority_beta_end", "priority_beta_steps", "priority_eps",
        "max_episodes", "shaped_rewards", "log_rewards", "explore_from_best",
    )  # fmt: skip
    return dataclasses.replace(config, **{name: getattr(default, name) for name in unread})


def double_q_targets(
    online_next_q: jax.Array,
    target_next_q: jax.Array,
    next_mask: jax.Array,
    ret: jax.Array,
    discount: jax.Array,
) -> jax.Array:
    """ret + discount * Q_target(s', argmax_a' Q_online(s', a')), the max over valid a' only.

    q's [B, A], next_mask [B, A], ret/discount [B] -> [B]. The target network is read at the
    online argmax without a mask, so a terminal state (no valid action, discount 0) adds 0.
    """
    best = jnp.argmax(masked(online_next_q, next_mask), axis=-1)  # [B]
    next_value = jnp.take_along_axis(target_next_q, best[:, None], axis=-1)[:, 0]  # [B]
    return ret + discount * next_value


def train_step(
    state: TrainState, batch: Batch, config: DQNConfig
) -> tuple[TrainState, jax.Array, jax.Array]:
    """One gradient step on a batch; returns (state, loss, td_errors [B])."""
    return _train_step(state, batch, _learner_config(config))


@functools.partial(jax.jit, static_argnames="config")
def _train_step(
    state: TrainState, batch: Batch, config: DQNConfig
) -> tuple[TrainState, jax.Array, jax.Array]:
    rng, k_online, k_next, k_target = jax.random.split(state.rng, 4)
    online_next = q_values(state.params, batch.next_obs, batch.next_mask, k_next)  # [B, A]
    target_next = q_values(state.target_params, batch.next_obs, batch.next_mask, k_target)
    target = jax.lax.stop_gradient(
        double_q_targets(online_next, target_next, batch.next_mask, batch.ret, batch.discount)
    )  # [B]

    def loss_fn(params: Params) -> tuple[jax.Array, jax.Array]:
        q = q_values(params, batch.obs, batch.mask, k_online)  # [B, A]
        q_taken = jnp.take_along_axis(q, batch.action[:, None], axis=-1)[:, 0]  # [B]
        td = target - q_taken  # [B]
        loss = optax.huber_loss(q_taken, target, delta=config.huber_delta)  # [B]
        return (batch.weight * loss).mean(), td

    (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = make_optimizer(config).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    step = state.step + 1
    if config.tau < 1.0:
        target_params = optax.incremental_update(params, state.target_params, config.tau)
    else:
        copy = step % config.target_update_period == 0
        target_params = jax.tree.map(
            lambda new, old: jnp.where(copy, new, old), params, state.target_params
        )
    return TrainState(params, target_params, opt_state, step, rng), loss, td


class DQNAgent:
    """The stateful shell: acting, remembering, learning, saving."""

    def __init__(
        self, obs_dim: int, n_actions: int, config: DQNConfig | None = None, *, seed: int = 0
    ):
        self.config = config if config is not None else DQNConfig()
        self.obs_dim, self.n_actions = obs_dim, n_actions
        c = self.config
        init_key, train_key, act_key = jax.random.split(jax.random.key(seed), 3)
        params = init_params(init_key, obs_dim, n_actions, c.hidden, noisy=c.noisy, sigma0=c.sigma0)
        opt_state = make_optimizer(c).init(params)
        self.state = TrainState(params, params, opt_state, jnp.zeros((), jnp.int32), train_key)
        self._act_key = act_key
        self.replay = PrioritizedReplay(
            c.replay_capacity,
            obs_dim,
            n_actions,
            n_step=c.n_step,
            gamma=c.gamma,
            alpha=c.priority_alpha,
            eps=c.priority_eps,
            seed=seed,
        )
        self.env_steps = 0

    @property
    def train_steps(self) -> int:
        return int(self.state.step)

    @property
    def epsilon(self) -> float:
        """The current exploration rate (0 with noisy layers, which explore by themselves)."""
        c = self.config
        if c.noisy:
            return 0.0
        frac = min(1.0, self.env_steps / max(1, c.epsilon_decay_steps))
        return c.epsilon_start + frac * (c.epsilon_end - c.epsilon_start)

    @property
    def exploration(self) -> float:
        """Epsilon, or the mean noise scale for a noisy network: one number for the curve."""
        return noise_scale(self.state.params) if self.config.noisy else self.epsilon

    def act(self, obs: np.ndarray, mask: np.ndarray, *, greedy: bool = False) -> int:
        """An action for obs [D] under mask [A]; `greedy` turns exploration (and noise) off."""
        obs, mask = np.asarray(obs, np.float32), np.asarray(mask, bool)
        if greedy:
            return int(greedy_action(self.state.params, obs, mask))
        self._act_key, action = select_action(
            self.state.params, obs, mask, self._act_key, np.float32(self.epsilon)
        )
        return int(action)

    def observe(self, obs, mask, action, reward, next_obs, next_mask, done) -> None:
        """Remember one environment step."""
        reward = reward * self.config.reward_scale
        self.replay.add(obs, mask, action, reward, next_obs, next_mask, done)
        self.env_steps += 1

    def update(self) -> float | None:
        """One training step if it is time for one; the loss, or None when none was taken."""
        c = self.config
        if len(self.replay) < c.warmup_steps or self.env_steps % c.train_every:
            return None
        frac = min(1.0, self.train_steps / max(1, c.priority_beta_steps))
        beta = c.priority_beta_start + frac * (c.priority_beta_end - c.priority_beta_start)
        batch, indices = self.replay.sample(c.batch_size, beta)
        self.state, loss, td = train_step(self.state, batch, c)
        self.replay.update_priorities(indices, np.asarray(td))
        return float(loss)

    def to_state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: networks, optimizer, replay, random keys, counters."""
        to_np = functools.partial(jax.tree.map, np.asarray)
        s = self.state
        return {
            "obs_dim": self.obs_dim,
            "n_actions": self.n_actions,
            "params": flax.serialization.to_state_dict(to_np(s.params)),
            "target_params": flax.serialization.to_state_dict(to_np(s.target_params)),
            "opt_state": flax.serialization.to_state_dict(to_np(s.opt_state)),
            "train_steps": int(s.step),
            "env_steps": self.env_steps,
            "train_key": np.asarray(jax.random.key_data(s.rng)),
            "act_key": np.asarray(jax.random.key_data(self._act_key)),
            "replay": self.replay.to_state_dict(),
        }

    def from_state_dict(self, state: dict[str, Any], *, weights_only: bool = False) -> None:
        """Restore a saved agent; `weights_only` takes just the networks (a warm start)."""
        if (int(state["obs_dim"]), int(state["n_actions"])) != (self.obs_dim, self.n_actions):
            raise ValueError(
                f"saved agent has obs_dim={state['obs_dim']}, n_actions={state['n_actions']}; "
                f"this one has obs_dim={self.obs_dim}, n_actions={self.n_actions}"
            )
        s = self.state
        restore = flax.serialization.from_state_dict
        mismatch = ValueError(
            f"the saved network does not match this agent's hidden layers {self.config.hidden}"
        )
        try:
            params = jax.tree.map(jnp.asarray, restore(s.params, state["params"]))
            target = jax.tree.map(jnp.asarray, restore(s.target_params, state["target_params"]))
        except ValueError as err:  # another depth, or noisy against plain layers
            raise mismatch from err
        # from_state_dict matches names, not shapes: a network of other widths must not slip in.
        if [x.shape for x in jax.tree.leaves(params)] != [
            x.shape for x in jax.tree.leaves(s.params)
        ]:
            raise mismatch
        if weights_only:
            opt_state = make_optimizer(self.config).init(params)
            self.state = TrainState(params, target, opt_state, s.step, s.rng)
            return
        opt_state = jax.tree.map(jnp.asarray, restore(s.opt_state, state["opt_state"]))
        step = jnp.asarray(int(state["train_steps"]), jnp.int32)
        rng = jax.random.wrap_key_data(jnp.asarray(state["train_key"]))
        self.state = TrainState(params, target, opt_state, step, rng)
        self._act_key = jax.random.wrap_key_data(jnp.asarray(state["act_key"]))
        self.env_steps = int(state["env_steps"])
        self.replay.from_state_dict(state["replay"])

    def save(self, path: str | Path) -> None:
        """Write the state dict as msgpack."""
        Path(path).write_bytes(flax.serialization.msgpack_serialize(self.to_state_dict()))

    @classmethod
    def load(cls, path: str | Path, config: DQNConfig | None = None, *, seed: int = 0) -> DQNAgent:
        """An agent restored from `save`'s file (its sizes are read from the file)."""
        state = flax.serialization.msgpack_restore(Path(path).read_bytes())
        agent = cls(int(state["obs_dim"]), int(state["n_actions"]), config, seed=seed)
        agent.from_state_dict(state)
        return agent
