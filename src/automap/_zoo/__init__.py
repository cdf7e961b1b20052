"""Built-in benchmark models: configs with random weights and an Adam training step each."""

from ._moe import route as route
from ._registry import ModelInfo as ModelInfo
from ._registry import get_model as get_model
from ._registry import list_models as list_models
from ._train import ModelSpec as ModelSpec
from ._transformer import fused_softmax as fused_softmax
