"""Auto-MAP: find, check and apply fast distributed execution plans for JAX training steps."""

from ._api import estimate as estimate
from ._api import expert_plans as expert_plans
from ._api import plan as plan
from ._api import plan_recipe as plan_recipe
from ._capture import capture as capture
from ._cluster import Cluster as Cluster
from ._cluster import Link as Link
from ._errors import ApplyError as ApplyError
from ._errors import AutomapError as AutomapError
from ._errors import CaptureError as CaptureError
from ._errors import ClusterError as ClusterError
from ._errors import InfeasibleError as InfeasibleError
from ._errors import ModelError as ModelError
from ._errors import PlanError as PlanError
from ._errors import PriceWarning as PriceWarning
from ._graph import Graph as Graph
from ._graph import Role as Role
from ._plan import Collective as Collective
from ._plan import Cost as Cost
from ._plan import Plan as Plan
from ._plan import Stage as Stage
from ._run import apply as apply
from ._space import Recipe as Recipe
from ._verify import VerifyReport as VerifyReport
from ._verify import verify as verify
from ._version import __version__ as __version__
