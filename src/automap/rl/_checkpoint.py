"""A DQN search's whole state on disk, so that a stopped search can go on (`--resume`).

The state is everything the next episode depends on: the agent (networks, optimizer,
replay, random keys, step counters), the episode count, the best plan so far, the search
loop's own random generator and the learning curve. Restored, a search plays exactly the
episodes the uninterrupted one would have played: resuming a search that stopped at N
episodes with a budget of M gives the plan of one search of M episodes with the same seed.

A `key` records what the search was for (program, cluster, task, seed): resuming it for
anything else is refused, since its replay and best plan would mean nothing there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import flax.serialization
import numpy as np

FORMAT = "automap-dqn-search/1"


class CheckpointError(ValueError):
    """A search-state or agent file that cannot be used here (the message names the fix)."""


@dataclasses.dataclass(frozen=True)
class SearchCheckpoint:
    """The state of a DQN search between two episodes."""

    agent: dict[str, Any]
    """`DQNAgent.to_state_dict()`."""
    episode: int
    """Episodes played so far, seed episodes included."""
    best: tuple[float, bool, float]
    """(step time s, feasible, over-ratio) of the best plan so far."""
    best_decisions: tuple[int, ...]
    """Its decisions (empty before the first finished episode)."""
    time_to_best_s: float
    """Search seconds (over every run of it) until the best plan was first seen."""
    elapsed_s: float
    """Search seconds spent so far, over every run of it."""
    rng_state: dict[str, Any]
    """The search loop's numpy bit generator state (the explore-from-best branch points)."""
    curve: list[dict[str, Any]]
    """The learning curve so far (see SearchResult.curve)."""
    key: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the search was for; a resume must present the same key."""

    def save(self, path: str | Path) -> None:
        """Write the state as msgpack, atomically: a Ctrl-C while saving keeps the old file."""
        meta = {
            "format": FORMAT,
            "episode": self.episode,
            "best": list(self.best),
            "best_decisions": list(self.best_decisions),
            "time_to_best_s": self.time_to_best_s,
            "elapsed_s": self.elapsed_s,
            "curve": self.curve,
            "key": self.key,
        }
        data = {
            # JSON keeps the curve's None losses, inf times and the bit generator's
            # integers wider than 64 bits, which msgpack would not.
            "meta": json.dumps(meta),
            "rng_state": json.dumps(self.rng_state),
            "agent": self.agent,
        }
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(flax.serialization.msgpack_serialize(data))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk must not leave half a state behind
            raise

    @classmethod
    def load(cls, path: str | Path) -> SearchCheckpoint:
        """The state saved at `path`; CheckpointError when it is not one."""
        path = Path(path)
        try:
            data = flax.serialization.msgpack_restore(path.read_bytes())
            meta = json.loads(data["meta"])
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            best = meta["best"]
            return cls(
                agent=data["agent"],
                episode=int(meta["episode"]),
                best=(float(best[0]), bool(best[1]), float(best[2])),
                best_decisions=tuple(int(d) for d in meta["best_decisions"]),
                time_to_best_s=float(meta["time_to_best_s"]),
                elapsed_s=float(meta["elapsed_s"]),
                rng_state=json.loads(data["rng_state"]),
                curve=list(meta["curve"]),
                key=dict(meta["key"]),
            )
        except FileNotFoundError:
            raise CheckpointError(
                f"no search state at {path}: run the search once without resume to make one"
            ) from None
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise CheckpointError(
                f"{path} is not a DQN search state saved by automap ({_short(err)}); "
                "delete it and search again without resume"
            ) from None

    def check_key(self, key: dict[str, Any], path: str | Path) -> None:
        """Refuse to resume a search made for another problem, naming the first difference."""
        for name, value in key.items():
            saved = self.key.get(name)
            if saved != value:
                raise CheckpointError(
                    f"the search state at {path} is for {name}={saved!r}, this search has "
                    f"{name}={value!r}: resume with the same model, cluster, task and seed, "
                    "or search again without resume"
                )


def load_agent_state(path: str | Path) -> dict[str, Any]:
    """The agent state dict in a file written by `DQNAgent.save` (or a search state's agent)."""
    path = Path(path)
    try:
        data = flax.serialization.msgpack_restore(path.read_bytes())
        if "meta" in data and "agent" in data:  # a search state holds an agent too
            data = data["agent"]
        missing = [n for n in ("obs_dim", "n_actions", "params") if n not in data]
        if missing:
            raise KeyError(f"no {missing[0]}")
        return data
    except FileNotFoundError:
        raise CheckpointError(
            f"no agent file at {path}: save one with --save-agent (agent_out=) first"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise CheckpointError(
            f"{path} is not a DQN agent saved by automap ({_short(err)}); "
            "save one with --save-agent (agent_out=), or leave the agent out"
        ) from None


def rng_from_state(state: dict[str, Any]) -> np.random.Generator:
    rng = np.random.default_rng()
    rng.bit_generator.state = state
    return rng


def _short(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text[:80]
