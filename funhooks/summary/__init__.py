"""fastai's model utilities (``total_params``, ``model_sizes``, ``layer_info``,
``module_summary``, ...) and the tables they return.

Modules: ``utilities`` (the functions), ``table`` (``Shape``, ``LayerRow``, ``SummaryRow``,
``ModuleSummary``), private ``_shapes`` (the one pass that finds each module's input and output
shapes and FLOPs: for real while small, else on the meta device where it can). May import: ``errors``, ``_torch``,
``_frozen``, ``_modes``, ``records``, ``specs``, ``runs``.
"""

from .table import NO_WEIGHT, LayerRow, ModuleSummary, Shape, SummaryRow
from .utilities import (
    dummy_batch,
    dummy_eval,
    has_params,
    layer_info,
    model_sizes,
    module_summary,
    num_features_model,
    total_params,
)

__all__ = [
    "NO_WEIGHT", "LayerRow", "ModuleSummary", "Shape", "SummaryRow", "dummy_batch", "dummy_eval", "has_params",
    "layer_info", "model_sizes", "module_summary", "num_features_model", "total_params",
]
