"""Per-layer health invariants: the scale of activations at initialisation, and dead units.

Both observe the selected layers' outputs with an ``fh.observe`` spec that stores a small
summary (mean and standard deviation, or the largest magnitude of each unit over the
batch), never the activations themselves, and report a table of the layers that fail.

``check_init_scale`` judges each drawn input on its own (a failure is shrunk to one input);
``check_dead_units`` is a property of all drawn inputs together (a unit is dead when it is
near zero on every one of them), so it reports the table without a single counterexample.

Cost: one forward pass per drawn input, without gradients, plus one float per layer
(init scale) or per unit (dead units) kept between draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from funhooks.errors import SpecError
from funhooks.runs.run import with_hooks
from funhooks.specs.selector import Where
from funhooks.specs.spec import observe

from . import _invariant

if TYPE_CHECKING:  # pragma: no cover - types only
    import hypothesis

__all__ = ["check_dead_units", "check_init_scale"]

_STD_RANGE = (0.5, 2.0)
"""fastai's idea of a healthy layer at initialisation: activations with a standard
deviation near 1 (here within a factor of two), so the signal neither vanishes nor explodes
from layer to layer."""
_NEAR_ZERO = 1e-6
"""A unit is dead when its magnitude stays at or below this on every drawn example."""
_MAX_DEAD = 0.5
"""A layer fails ``check_dead_units`` when more than this share of its units are dead."""
_SEED = 0


def _is_layer(path: str, module: nn.Module) -> bool:
    """fastai's default layers: leaf modules that hold parameters."""
    return not any(True for _ in module.children()) and any(True for _ in module.parameters(recurse=False))


def _is_leaf(path: str, module: nn.Module) -> bool:
    """Modules without submodules."""
    return not any(True for _ in module.children())


def _first_float(output: object) -> torch.Tensor | None:
    return next((t for t in _invariant.tensor_leaves(output) if t.is_floating_point()), None)


def _moments(module: nn.Module, args: tuple, output: object) -> torch.Tensor:
    """Mean and standard deviation of the output (of its first float tensor)."""
    t = _first_float(output)
    if t is None or t.numel() < 2:
        return torch.full((2,), float("nan"))
    t = t.detach().float()
    return torch.stack((t.mean(), t.std()))


def _unit_peaks(module: nn.Module, args: tuple, output: object) -> torch.Tensor | None:
    """The largest magnitude of each unit (element of one example) over the batch."""
    t = _first_float(output)
    if t is None or t.dim() < 1:
        return None
    return t.detach().abs().float().amax(0)


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def check_init_scale(model: nn.Module, inputs: _invariant.Inputs, *, where: Where = _is_layer,
                     std_range: tuple[float, float] = _STD_RANGE, settings: hypothesis.settings | None = None,
                     seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check that every layer's activations have a standard deviation within `std_range`.

    The classic check of an initialisation: feed unit-variance data and look at each
    layer's output. By default the layers are fastai's (leaf modules with parameters) and
    the range is ``[0.5, 2]``: a healthy layer keeps the standard deviation near 1.

    Args:
        model: the freshly initialised model, in the mode to check.
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors)
            standing for standard-normal inputs of its shape; use a batch large enough
            for a stable standard deviation (e.g. 64 examples).
        where: the layers to check (any selector); default: leaf modules with parameters.
        std_range: ``(low, high)``, inclusive.
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_init_scale: ...`` naming the number of layers
            outside the range and the first one; then a table of them and the shrunk input.
        SpecError: for a range that is not ``0 <= low <= high``.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 100))
        >>> for m in model:
        ...     if isinstance(m, nn.Linear):
        ...         _ = nn.init.kaiming_normal_(m.weight, nonlinearity="relu"), nn.init.zeros_(m.bias)
        >>> fh.testing.check_init_scale(model, torch.randn(64, 100))
    """
    caller = "check_init_scale"
    low, high = (float(v) for v in std_range)
    if not 0 <= low <= high:
        raise SpecError(f"{caller}: `std_range` is `(low, high)` with 0 <= low <= high, got {std_range!r}. "
                        "Pass e.g. `(0.5, 2.0)`.")
    spec = observe(where, _moments, name="moments")

    with _invariant.preserved(model) as reset:
        def outside(draw: object) -> list[tuple[str, float, float]]:
            reset()
            torch.manual_seed(_SEED)
            with torch.no_grad(), with_hooks(model, spec) as run:
                model(*_invariant.as_args(draw))
            rows = []
            for path, node in run.record.items():
                for mean, std in (m.tolist() for m in node.calls("moments")):
                    if not low <= std <= high:
                        rows.append((path, mean, std))
                        break
            return rows

        draw = _invariant.search(_invariant.as_strategy(inputs, caller, normal=True), lambda d: bool(outside(d)),
                                 settings, seed)
        if draw is None:
            return
        rows = outside(draw)
    path, _, std = rows[0]
    table = _table(("layer", "mean", "std"),
                   [(_invariant.module_name(model, p), f"{m:.3g}", f"{s:.3g}") for p, m, s in rows])
    raise AssertionError(
        f"{caller}: every layer's activation std at init is within [{low:g}, {high:g}], got "
        f"{len(rows)} layer(s) outside it, first {_invariant.module_name(model, path)} with std {std:.3g}. "
        f"Rescale its initialisation (e.g. `nn.init.kaiming_normal_` before a ReLU).\n{table}\n"
        f"input: {_invariant.show(draw)}"
    )


def check_dead_units(model: nn.Module, inputs: _invariant.Inputs, *, where: Where = _is_leaf,
                     near_zero: float = _NEAR_ZERO, max_dead: float = _MAX_DEAD, settings: hypothesis.settings | None = None,
                     seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check that no layer has more than `max_dead` of its units near zero on every drawn input.

    A unit is one element of a layer's output for one example (a feature, or a channel at
    one position); it is dead when its magnitude is at most `near_zero` for every example
    of every drawn input: a ReLU whose bias pushed it negative for good, a gate stuck shut.
    The check draws all its inputs first and judges them together, so the failure is a
    table, not one shrunk input.

    Args:
        model: the model, in the mode to check.
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors)
            standing for standard-normal inputs of its shape.
        where: the layers to check (any selector); default: every leaf module.
        near_zero: the magnitude at or below which a unit's activation counts as zero.
        max_dead: the share of dead units a layer may have (``0`` allows none).
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_dead_units: ...`` naming the number of layers
            over `max_dead` and the first one; then a table of every layer with dead units.
        SpecError: for a `max_dead` outside ``[0, 1]``, or drawn inputs whose examples
            differ in shape.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
        >>> fh.testing.check_dead_units(model, torch.randn(8, 3))
    """
    caller = "check_dead_units"
    if not 0 <= max_dead <= 1:
        raise SpecError(f"{caller}: `max_dead` is a share in [0, 1], got {max_dead!r}. Pass e.g. `0.5`.")
    spec = observe(where, _unit_peaks, name="peaks")
    peaks: dict[tuple[str, int], torch.Tensor] = {}
    drawn = [0]

    with _invariant.preserved(model) as reset:
        def collect(draw: object) -> bool:
            reset()
            torch.manual_seed(_SEED)
            with torch.no_grad(), with_hooks(model, spec) as run:
                model(*_invariant.as_args(draw))
            for path, node in run.record.items():
                for call, peak in enumerate(node.calls("peaks")):
                    if peak is None:
                        continue
                    seen = peaks.setdefault((path, call), peak)
                    if seen.shape != peak.shape:
                        raise SpecError(
                            f"{caller}: every drawn input gives each layer outputs of one shape, got "
                            f"{tuple(seen.shape)} and {tuple(peak.shape)} per example from module "
                            f"{_invariant.module_name(model, path)}. Draw inputs of one shape."
                        )
                    peaks[path, call] = torch.maximum(seen, peak)
            drawn[0] += 1
            return False

        _invariant.search(_invariant.as_strategy(inputs, caller, normal=True), collect, settings, seed)
    rows, failing = [], []
    for (path, call), peak in peaks.items():
        dead, total = int((peak <= near_zero).sum()), peak.numel()
        if dead:
            name = _invariant.module_name(model, path) + (f" call {call + 1}" if call else "")
            rows.append((name, f"{dead}/{total}", f"{dead / total:.0%}"))
            if dead > max_dead * total:
                failing.append((name, dead, total))
    if not failing:
        return
    name, dead, total = failing[0]
    raise AssertionError(
        f"{caller}: no layer has more than {max_dead:.0%} of its units near zero (|a| <= {near_zero:g}) on "
        f"every drawn input, got {len(failing)} layer(s), first {name} with {dead} of {total} units dead. "
        "Check its initialisation (a bias that keeps a ReLU negative) and what feeds it.\n"
        f"{_table(('layer', 'dead units', 'share'), rows)}\n"
        f"over {drawn[0]} drawn inputs; no single input is a counterexample"
    )
