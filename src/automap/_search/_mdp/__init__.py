"""The DQN's decision processes: each exploration task as a sequence of decisions.

Input: a space (`automap._space`) and its cost model. Output: a `DecisionProcess`
(`automap.rl`) whose episodes build plans of that space. DESIGN.md, "Searchers".
"""

from ._factory import baseline_time as baseline_time
from ._factory import make_process as make_process
from ._factory import planning_env as planning_env
from ._hybrid import HybridProcess as HybridProcess
from ._hybrid import make_pipeline_process as make_pipeline_process
from ._shard_process import ShardProcess as ShardProcess
from ._staged import SPLIT_ACTION as SPLIT_ACTION
from ._staged import PipelineProcess as PipelineProcess
