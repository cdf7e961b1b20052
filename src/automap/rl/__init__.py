"""Reinforcement learning for planning: the Gymnasium environment, the DQN agent, the search."""

from ._agent import DQNAgent as DQNAgent
from ._agent import DQNConfig as DQNConfig
from ._agent import TrainState as TrainState
from ._agent import double_q_targets as double_q_targets
from ._agent import greedy_action as greedy_action
from ._agent import select_action as select_action
from ._agent import train_step as train_step
from ._checkpoint import CheckpointError as CheckpointError
from ._checkpoint import SearchCheckpoint as SearchCheckpoint
from ._checkpoint import load_agent_state as load_agent_state
from ._env import DecisionProcess as DecisionProcess
from ._env import PlanningEnv as PlanningEnv
from ._env import ShapedProcess as ShapedProcess
from ._env import plan_reward as plan_reward
from ._networks import dueling as dueling
from ._networks import init_params as init_params
from ._networks import q_values as q_values
from ._replay import Batch as Batch
from ._replay import PrioritizedReplay as PrioritizedReplay
from ._replay import Sampler as Sampler
from ._replay import SumTree as SumTree
from ._search import SearchResult as SearchResult
from ._search import search as search
from ._search import write_curve as write_curve
