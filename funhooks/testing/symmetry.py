"""Symmetry invariants: the output does not change (or changes as prescribed) under a
change that should not matter: a transform of the input (equivariance, invariance), the
random seed in eval mode (determinism), train versus eval mode (consistency).

Each check runs the model twice per drawn input (from the same buffers) and compares the
outputs. On failure it blames the innermost module whose inputs still agree but whose
output does not (see ``_pair``), and raises ``AssertionError`` whose first line names the
invariant and that module, followed by the shrunk input. Afterwards buffers, train/eval
modes and the random state are as before; no hook is left.

Cost: two forward passes per drawn input, without gradients; on failure, shrinking and two
recorded passes that keep a copy of every module's inputs and outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from funhooks.errors import SpecError

from . import _invariant
from . import _pair

if TYPE_CHECKING:  # pragma: no cover - types only
    import hypothesis

__all__ = ["check_determinism", "check_equivariance", "check_train_eval_consistency"]


def check_equivariance(model: nn.Module, inputs: _invariant.Inputs, transform: Callable[[torch.Tensor], torch.Tensor], *,
                       output_transform: Callable[[Any], Any] | None = None, rtol: float = _pair.RTOL,
                       atol: float = _pair.ATOL, settings: hypothesis.settings | None = None,
                       seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check ``model(transform(x)) == output_transform(model(x))`` on drawn inputs.

    With ``output_transform=lambda y: y`` it checks invariance (a set model's pooled
    output under a permutation of the set); by default ``output_transform`` is `transform`
    itself (equivariance: a convolution under a circular shift). The transforms are fixed
    functions (reverse the set, roll by one), applied to each tensor argument. To blame a
    module, each intermediate tensor is expected to transform like the input or like the
    output: it is accepted when it equals the first run's tensor under `transform` or under
    `output_transform` (where they apply to its shape), and the innermost module whose
    inputs are accepted but whose output is not breaks the symmetry.

    Args:
        model: the model (``model.eval()`` first: dropout masks do not follow the transform).
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors).
        transform: ``tensor -> tensor``, applied to the inputs.
        output_transform: applied to the first run's output; default `transform`.
        rtol, atol: tolerances of the comparison.
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_equivariance: ...`` naming the innermost module
            that first breaks the symmetry; then the shrunk input.
        SpecError: when a transform is not callable.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 8), nn.ReLU())  # acts on each set element alone
        >>> reverse = lambda x: x.flip(1)                   # (batch, elements, features)
        >>> fh.testing.check_equivariance(model, torch.randn(2, 5, 3), reverse)
    """
    caller = "check_equivariance"
    for name, fn in (("transform", transform), ("output_transform", output_transform)):
        if fn is not None and not callable(fn):
            raise SpecError(
                f"{caller}: `{name}` is a function `tensor -> tensor`, got {fn!r}. "
                "Pass one such as `lambda x: x.flip(1)`."
            )
    after: Callable[[Any], Any] = transform if output_transform is None else output_transform

    def apply(fn: Callable, t: torch.Tensor) -> torch.Tensor | None:
        try:
            out = fn(t)
        except Exception:  # noqa: BLE001 - a transform of the inputs need not apply to every intermediate tensor
            return None
        return out if isinstance(out, torch.Tensor) and out.shape == t.shape else None

    def runs(draw: object) -> tuple[_pair.Run, _pair.Run]:
        args = _invariant.as_args(draw)
        moved = tuple(transform(a) if isinstance(a, torch.Tensor) else a for a in args)
        return _pair.Run(args, _pair.SEED, None), _pair.Run(moved, _pair.SEED, None)

    def breaks(draw: object, first: object, second: object) -> bool:
        return _pair.broken(after(first), second, lambda a, b: _pair.close(a, b, rtol, atol))

    def same(a: torch.Tensor, b: torch.Tensor) -> bool | None:
        options = [o for o in (apply(transform, a), apply(after, a)) if o is not None and o.shape == b.shape]
        return any(_pair.close(o, b, rtol, atol) for o in options) if options else None

    _pair.compare(caller, model, _invariant.as_strategy(inputs, caller), runs, lambda draw: same, breaks=breaks,
                  settings=settings, seed=seed, rule="model(transform(x)) equals output_transform(model(x))",
                  fix="Look for positions the module treats differently (position embeddings, zero padding, flattening)")


def check_determinism(model: nn.Module, inputs: _invariant.Inputs, *, rtol: float = 0.0, atol: float = 0.0,
                      settings: hypothesis.settings | None = None, seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check that the model in eval mode gives the same output twice on the same input.

    The two runs start from different random seeds, so randomness left in eval mode shows:
    ``F.dropout(x, training=True)``, noise from ``torch.rand``, sampling. Equality is exact
    by default; give `atol` for kernels that are not deterministic (some CUDA ones).

    Args:
        model: the model; it runs in eval mode and is put back in its modes afterwards.
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors).
        rtol, atol: tolerances of the comparison (exact by default).
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_determinism: ...`` naming the innermost module
            whose output first differs; then the shrunk input.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1)).train()
        >>> fh.testing.check_determinism(model, torch.randn(2, 3))  # dropout is off in eval mode
        >>> model.training
        True
    """
    caller = "check_determinism"

    def runs(draw: object) -> tuple[_pair.Run, _pair.Run]:
        args = _invariant.as_args(draw)
        return _pair.Run(args, _pair.SEED, False), _pair.Run(args, _pair.SEED + 1, False)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return _pair.close(a, b, rtol, atol)

    _pair.compare(caller, model, _invariant.as_strategy(inputs, caller), runs, lambda draw: same, settings=settings,
                  seed=seed, rule="two runs in eval mode on the same input give the same output",
                  fix="Remove randomness from eval mode (dropout with `training=True`, `torch.rand`, sampling)")


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _mode_dependent(module: nn.Module) -> bool:
    """Layers whose output differs between train and eval mode by design."""
    if isinstance(module, _DROPOUTS):
        return module.p > 0
    return isinstance(module, nn.RReLU) or bool(getattr(module, "track_running_stats", False))


def check_train_eval_consistency(model: nn.Module, inputs: _invariant.Inputs, *, rtol: float = _pair.RTOL,
                                 atol: float = _pair.ATOL, settings: hypothesis.settings | None = None,
                                 seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check that a model without dropout or batch norm gives the same output in train and
    eval mode.

    Such a model has no reason to behave differently in the two modes; a difference is a
    ``self.training`` branch that should not be there (a custom layer that rescales, skips
    a step or uses another code path while training).

    Args:
        model: the model; it runs in train and in eval mode and is put back afterwards.
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors).
        rtol, atol: tolerances of the comparison.
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        SpecError: when the model has dropout (``p > 0``), batch norm or instance norm with
            running statistics, or ``RReLU``, which differ between the modes by design.
        AssertionError: first line ``check_train_eval_consistency: ...`` naming the
            innermost module whose output first differs; then the shrunk input.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Dropout(0.0))
        >>> fh.testing.check_train_eval_consistency(model, torch.randn(2, 3))
    """
    caller = "check_train_eval_consistency"
    differ = [(p, m) for p, m in _invariant.named_modules(model) if _mode_dependent(m)]
    if differ:
        path, module = differ[0]
        raise SpecError(
            f"{caller}: the model has no dropout or batch norm (they differ between train and eval "
            f"mode by design), got {module!r} at {path!r}. Check `check_determinism` instead, or "
            "build the model without them."
        )

    def runs(draw: object) -> tuple[_pair.Run, _pair.Run]:
        args = _invariant.as_args(draw)
        return _pair.Run(args, _pair.SEED, True), _pair.Run(args, _pair.SEED, False)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return _pair.close(a, b, rtol, atol)

    _pair.compare(caller, model, _invariant.as_strategy(inputs, caller), runs, lambda draw: same, settings=settings,
                  seed=seed, rule="a model without dropout or batch norm gives the same output in train and eval mode",
                  fix="Look for a `self.training` branch")
