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

from . import circuits, distributed, testing, transformer
from ._version import __version__
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
from .records import Record, RecordNode
from .reducers import (
    ActivationStats,
    ActivationStatsResult,
    DeadUnits,
    DeadUnitsResult,
    GradientStats,
    GradientStatsResult,
    HookCallback,
    LossCurve,
    LossCurveResult,
    OutputMeans,
    UpdateRatio,
    UpdateRatioResult,
    plot,
)
from .runs import (
    Attribution,
    Generation,
    GenerationStep,
    Run,
    activation_grads,
    attribution_patching,
    capture,
    functional,
    generate,
    iter_generate,
    with_hooks,
)
from .specs import (
    EVENTS,
    Arg,
    Hook,
    Hooks,
    Op,
    Selector,
    Spec,
    Steps,
    ablate,
    arg,
    attention_pattern,
    attention_scores,
    edit,
    grads,
    hook_output,
    hook_outputs,
    inputs,
    observe,
    op,
    op_edit,
    op_inputs,
    op_outputs,
    outputs,
    patch,
    scale,
    select,
    steer,
    steps,
)
from .store import (
    ActivationDataset,
    ActivationStream,
    ActivationWriter,
    ColumnStats,
    WriterState,
    collect,
    from_hf_dataset,
    to_hf_dataset,
)
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
from .training import (
    Folding,
    Logged,
    OptimizerWatch,
    Reducer,
    Scalars,
    Step,
    evaluate,
    fit,
    fold,
    fold_all,
    folding,
    progress,
    running,
    train,
)


def __getattr__(name: str) -> object:
    """``fh.lightning`` and ``fh.hf``, imported when first used (they import their frameworks)."""
    if name in _INTEGRATIONS:
        import importlib

        return importlib.import_module(f"{__name__}.integrations.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_INTEGRATIONS = ("lightning", "hf")


__all__ = [
    "generate",
    "Generation",
    "GenerationStep",
    "iter_generate",
    "steps",
    "Steps",
    "ablate",
    "activation_grads",
    "ActivationDataset",
    "ActivationStats",
    "ActivationStatsResult",
    "ActivationStream",
    "ActivationWriter",
    "Arg",
    "arg",
    "attention_pattern",
    "attention_scores",
    "Attribution",
    "attribution_patching",
    "capture",
    "circuits",
    "collect",
    "ColumnStats",
    "distributed",
    "dummy_batch",
    "dummy_eval",
    "edit",
    "evaluate",
    "from_hf_dataset",
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
    "Logged",
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
    "Scalars",
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
    "transformer",
    "total_params",
    "to_hf_dataset",
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
