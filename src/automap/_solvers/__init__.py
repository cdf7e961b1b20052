"""Exact solvers on factored plan spaces: exhaustive, ILP (HiGHS), pipeline-partition DP.

Pure numpy kernels with thin drivers: the cost model fills `FactorProblem` tables and
pipeline cost arrays; nothing here knows about graphs, meshes or JAX.
"""

from ._exhaustive import solve_exhaustive as solve_exhaustive
from ._factor import MEMORY_RTOL as MEMORY_RTOL
from ._factor import Factor as Factor
from ._factor import FactorProblem as FactorProblem
from ._factor import Overlap as Overlap
from ._factor import Solution as Solution
from ._factor import evaluate as evaluate
from ._factor import evaluate_batch as evaluate_batch
from ._factor import leanest_problem as leanest_problem
from ._factor import memory_by_point as memory_by_point
from ._factor import merge_factors as merge_factors
from ._factor import random_problem as random_problem
from ._factor import space_size as space_size
from ._ilp import solve_ilp as solve_ilp
from ._pipeline_dp import PipelineSolution as PipelineSolution
from ._pipeline_dp import optimal_partition as optimal_partition
from ._pipeline_dp import optimal_pipeline as optimal_pipeline
from ._pipeline_dp import optimal_two_level as optimal_two_level
from ._pipeline_dp import pipeline_step_time as pipeline_step_time
from ._pipeline_dp import stage_tables as stage_tables
