"""funhooks: functional, immutable hooks for PyTorch.

Hooks are values: frozen specs say where, when and what; ``with_hooks`` runs them for the
duration of a block and always removes them; what they stored comes back as an immutable
``Record``.

Example:
    >>> import torch, funhooks as fh
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> with fh.with_hooks(model, fh.outputs(nn.Linear)) as run:
    ...     y = model(torch.randn(3, 4))
    >>> [tuple(t.shape) for t in run.record.stored()]
    [(3, 8), (3, 2)]
"""

import sys as _sys
from importlib import metadata as _metadata

from . import activation, distributed, plot, progress, pure, selector, testing
from ._fastai import Hook, Hooks, hook_output, hook_outputs
from .activation import activation_grads
from .callback import HookCallback
from .collect import collect
from .dataset import ActivationDataset
from .dead import DeadUnits, DeadUnitsResult
from .distributed import merge_across_ranks
from .errors import (
    ExtraError,
    FrozenError,
    HookError,
    InterventionError,
    LoopError,
    RecordError,
    RecordKeyError,
    ReducerError,
    SelectorError,
    SpecError,
    StaleTensorError,
    StoreError,
    TransformError,
)
from .fold import Reducer, fit, fold, fold_all, running
from .folding import Folding, folding
from .gradient import GradientStats, GradientStatsResult
from .intervene import Arg, ablate, arg, patch, scale, steer
from .loop import evaluate, train
from .loss import LossCurve, LossCurveResult
from .mean import OutputMeans
from .ops import Op, op, op_edit, op_inputs, op_outputs
from .pure import capture, functional
from .record import Record, RecordNode
from .run import Run, with_hooks
from .selector import Selector, select
from .spec import EVENTS, Spec, edit, grads, inputs, observe, outputs
from .stats import ActivationStats, ActivationStatsResult
from .step import Step
from .store import ActivationWriter, WriterState
from .summary import (
    LayerRow,
    ModuleSummary,
    dummy_batch,
    dummy_eval,
    has_params,
    layer_info,
    model_sizes,
    module_summary,
    num_features_model,
    total_params,
)
from .update import UpdateRatio, UpdateRatioResult
from .watch import OptimizerWatch

# The modules `select`, `functional` and `grads` were renamed (`selector`, `pure`,
# `activation`) so that no module shares a name with a function exported here; their old
# import paths keep working, and pickles that name them still load.
for _old, _new in (("select", selector), ("functional", pure), ("grads", activation)):
    _sys.modules[f"{__name__}.{_old}"] = _new


def __getattr__(name: str) -> object:
    """``fh.lightning`` and ``fh.hf``, imported when first used (they import their frameworks)."""
    if name in _INTEGRATIONS:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_INTEGRATIONS = ("lightning", "hf")

try:
    __version__ = _metadata.version("funhooks")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "ablate",
    "activation_grads",
    "ActivationDataset",
    "ActivationStats",
    "ActivationStatsResult",
    "ActivationWriter",
    "Arg",
    "arg",
    "capture",
    "collect",
    "distributed",
    "dummy_batch",
    "dummy_eval",
    "edit",
    "evaluate",
    "EVENTS",
    "ExtraError",
    "fit",
    "fold",
    "fold_all",
    "Folding",
    "folding",
    "FrozenError",
    "functional",
    "grads",
    "has_params",
    "Hook",
    "hook_output",
    "hook_outputs",
    "HookCallback",
    "HookError",
    "Hooks",
    "inputs",
    "InterventionError",
    "layer_info",
    "LayerRow",
    "LoopError",
    "merge_across_ranks",
    "model_sizes",
    "module_summary",
    "ModuleSummary",
    "num_features_model",
    "observe",
    "Op",
    "op",
    "op_edit",
    "op_inputs",
    "op_outputs",
    "OutputMeans",
    "OptimizerWatch",
    "outputs",
    "patch",
    "plot",
    "progress",
    "Record",
    "RecordError",
    "RecordKeyError",
    "RecordNode",
    "Reducer",
    "ReducerError",
    "Run",
    "running",
    "scale",
    "select",
    "Selector",
    "SelectorError",
    "Spec",
    "SpecError",
    "StaleTensorError",
    "steer",
    "Step",
    "StoreError",
    "testing",
    "total_params",
    "train",
    "TransformError",
    "with_hooks",
    "WriterState",
    "DeadUnits",
    "DeadUnitsResult",
    "GradientStats",
    "GradientStatsResult",
    "LossCurve",
    "LossCurveResult",
    "UpdateRatio",
    "UpdateRatioResult",
    "__version__",
]
