"""Training statistics as frozen, mergeable reducers, and their plots.

Modules: ``activation_stats`` (``ActivationStats``, fastai's statistics, exact),
``hook_callback`` (``HookCallback``), ``param_grads`` (``GradientStats``), ``update_ratio``
(``UpdateRatio``), ``dead_units`` (``DeadUnits``), ``loss_curve`` (``LossCurve``),
``output_means`` (``OutputMeans``, for mean-ablation), ``layers`` (the default layer selectors),
``plot`` (matplotlib figures, an optional extra), and private ``_exact`` (batched exact
reductions), ``_shared`` (argument checks, the ``every`` rule, step lists), ``_layered``
(per-layer rows keyed by path) and ``_params`` (parameter-sized tensors summed by layer).
May import: ``errors``, ``_torch``, ``_frozen``, ``distributed``, ``records``, ``specs``,
``runs``, ``training``.
"""

from . import plot
from .activation_stats import ActivationStats, ActivationStatsResult
from .dead_units import DeadUnits, DeadUnitsResult
from .hook_callback import HookCallback
from .layers import LeafModules, OwnParams
from .loss_curve import LossCurve, LossCurveResult
from .output_means import OutputMeans
from .param_grads import GradientStats, GradientStatsResult
from .update_ratio import UpdateRatio, UpdateRatioResult

__all__ = [
    "ActivationStats", "ActivationStatsResult", "DeadUnits", "DeadUnitsResult", "GradientStats",
    "GradientStatsResult", "HookCallback", "LeafModules", "LossCurve", "LossCurveResult", "OutputMeans", "OwnParams", "UpdateRatio",
    "UpdateRatioResult", "plot",
]
