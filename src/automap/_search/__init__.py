"""The searchers: one registry (`SEARCHERS`) of dqn, ilp, dp, exhaustive, expert,
random and mcmc over a built `Problem`.

Input: a Problem (program, groups, cluster, cost model) and a budget. Output: the best
plan found, priced, with its provenance and search stats. The DQN's decision processes
are in `_mdp/`. DESIGN.md, "Searchers".
"""

from ._classic import EVALS_PER_SECOND as EVALS_PER_SECOND
from ._classic import SAFETY as SAFETY
from ._classic import STOP as STOP
from ._classic import Tracker as Tracker
from ._classic import evaluate as evaluate
from ._classic import options_of as options_of
from ._classic import random_point as random_point
from ._classic import search_exhaustive as search_exhaustive
from ._classic import search_mcmc as search_mcmc
from ._classic import search_random as search_random
from ._cut_tables import fill_weight as fill_weight
from ._cut_tables import optimal_cuts as optimal_cuts
from ._cut_tables import segment_tables as segment_tables
from ._dp import MEMORY_SAVERS as MEMORY_SAVERS
from ._dp import fitting_savers as fitting_savers
from ._dp import polish_cuts as polish_cuts
from ._dp import priced_cuts as priced_cuts
from ._dp import search_dp as search_dp
from ._dp import search_shapes as search_shapes
from ._leanest import Leanest as Leanest
from ._leanest import search_leanest as search_leanest
from ._mdp import SPLIT_ACTION as SPLIT_ACTION
from ._mdp import HybridProcess as HybridProcess
from ._mdp import PipelineProcess as PipelineProcess
from ._mdp import ShardProcess as ShardProcess
from ._mdp import baseline_time as baseline_time
from ._mdp import make_pipeline_process as make_pipeline_process
from ._mdp import make_process as make_process
from ._mdp import planning_env as planning_env
from ._mesh_terms import COLUMNS_PER_SECOND as COLUMNS_PER_SECOND
from ._mesh_terms import MIN_COLUMNS as MIN_COLUMNS
from ._mesh_terms import MeshTerms as MeshTerms
from ._one_stage import OneStagePoint as OneStagePoint
from ._one_stage import OneStagePolish as OneStagePolish
from ._pricer import PipelinePricer as PipelinePricer
from ._problem import Problem as Problem
from ._problem import arg_roles as arg_roles
from ._problem import best_expert as best_expert
from ._problem import priced_experts as priced_experts
from ._registry import PROOF_SHARE as PROOF_SHARE
from ._registry import SEARCHERS as SEARCHERS
from ._registry import TASKS as TASKS
from ._registry import Request as Request
from ._registry import Searcher as Searcher
from ._registry import check_budget as check_budget
from ._registry import check_searcher as check_searcher
from ._registry import check_seed as check_seed
from ._registry import check_tasks as check_tasks
from ._registry import run_searcher as run_searcher
from ._runner import EPISODES_PER_SECOND as EPISODES_PER_SECOND
from ._runner import DQNFiles as DQNFiles
from ._runner import SearchProgress as SearchProgress
from ._runner import expert_seeds as expert_seeds
from ._runner import expert_start as expert_start
from ._runner import leanest_point as leanest_point
from ._runner import one_stage_ilp as one_stage_ilp
from ._runner import recipe_seeds as recipe_seeds
from ._runner import run_space_searcher as run_space_searcher
from ._runner import search_dqn as search_dqn
from ._runner import space_of as space_of
from ._runner import with_stats as with_stats
from ._shard_ilp import SOLVES_PER_MESH as SOLVES_PER_MESH
from ._shard_ilp import fine_space as fine_space
from ._shard_ilp import search_ilp as search_ilp
from ._techniques import REMATS as REMATS
from ._techniques import VARIANT_WORK as VARIANT_WORK
from ._techniques import technique_options as technique_options
from ._work import OPS_PER_SECOND as OPS_PER_SECOND
from ._work import Work as Work
