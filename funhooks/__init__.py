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

from importlib import metadata as _metadata

from . import testing
from .errors import (
    FrozenError,
    HookError,
    RecordError,
    SelectorError,
    SpecError,
    StaleTensorError,
    TransformError,
)
from .functional import capture, functional
from . import distributed
from .distributed import merge_across_ranks
from .grads import activation_grads
from .functional import capture, functional
from .grads import activation_grads
from . import plot, progress
from .errors import ExtraError, LoopError, ReducerError
from .fold import Reducer, fit, fold, fold_all, running
from .loop import Step, evaluate, train
from .stats import ActivationStats, ActivationStatsResult, HookCallback
from .record import Record, RecordNode
from .run import Run, with_hooks
from .select import Selector, select
from .spec import EVENTS, Hook, Hooks, Spec, edit, grads, hook_output, hook_outputs, inputs, observe, outputs
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

try:
    __version__ = _metadata.version("funhooks")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # training loop and reducers
    "ActivationStats",
    "ActivationStatsResult",
    "ExtraError",
    "HookCallback",
    "LoopError",
    "Reducer",
    "ReducerError",
    "Step",
    "evaluate",
    "fit",
    "fold",
    "fold_all",
    "plot",
    "progress",
    "running",
    "train",
    "EVENTS",
    "FrozenError",
    "Hook",
    "HookError",
    "Hooks",
    "Record",
    "RecordError",
    "RecordNode",
    "Run",
    "SelectorError",
    "Selector",
    "Spec",
    "SpecError",
    "StaleTensorError",
    "TransformError",
    "__version__",
    "edit",
    "grads",
    "hook_output",
    "hook_outputs",
    "inputs",
    "observe",
    "outputs",
    "select",
    "testing",
    "with_hooks",
    # distributed
    "distributed",
    "merge_across_ranks",
    # functional
    "activation_grads",
    "capture",
    "functional",
    # functional
    "activation_grads",
    "capture",
    "functional",
    # summary
    "LayerRow",
    "ModuleSummary",
    "dummy_batch",
    "dummy_eval",
    "has_params",
    "layer_info",
    "model_sizes",
    "module_summary",
    "num_features_model",
    "total_params",
]
