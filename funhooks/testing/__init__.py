"""Property-testing kit: Hypothesis strategies and invariant checks for your own models.

The same kit proves funhooks' own invariants in its test suite.

- :func:`models_and_inputs` draws small random models (linear, conv, norm and activation
  layers, nested containers, in-place activations, a module instance used twice, a module
  returning a tuple, a module called with keyword arguments) with a matching input;
- :func:`specs` draws valid specs for a model, with selectors taken from its real paths
  and types;
- :func:`assert_transparent` checks that observers change no output, gradient or buffer;
- :func:`assert_no_hooks` checks that nothing is left attached to a model;
- :func:`check_invariant` runs a model on drawn inputs and a predicate over every stored
  tensor (or over the whole Record), and reports the shrunk input with the module path
  that broke it;
- ready-made invariants, each blaming the innermost module where it first breaks:
  :func:`check_batch_independence`, :func:`check_causality` (``independence.py``),
  :func:`check_equivariance`, :func:`check_determinism`,
  :func:`check_train_eval_consistency` (``symmetry.py``),
  :func:`check_finite`, :func:`check_gradients_reach` (``flow.py``),
  :func:`check_init_scale`, :func:`check_dead_units` (``health.py``).

Hypothesis is an optional dependency (the ``test`` extra): it is imported when a strategy
or :func:`check_invariant` is called, never by ``import funhooks``.

Cost: :func:`assert_transparent` runs the model twice (forward and backward) and keeps a
copy of its gradients and buffers; strategies draw tiny models (a few hundred parameters).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from funhooks.errors import SpecError
from funhooks.records.record import Record
from funhooks.runs.run import Run, as_specs, with_hooks
from funhooks.specs import Spec, outputs
from funhooks.specs.selector import path_label

from . import _invariant
from .flow import check_finite, check_gradients_reach
from .health import check_dead_units, check_init_scale
from .independence import check_batch_independence, check_causality
from .leftovers import assert_no_hooks
from .strategies import models_and_inputs, specs, tensors
from .symmetry import check_determinism, check_equivariance, check_train_eval_consistency
from .transparency import assert_transparent, backward_all, tensor_leaves

if TYPE_CHECKING:  # pragma: no cover - types only
    import hypothesis
    from hypothesis import strategies as st

__all__ = [
    "assert_no_hooks",
    "assert_transparent",
    "check_batch_independence",
    "check_causality",
    "check_dead_units",
    "check_determinism",
    "check_equivariance",
    "check_finite",
    "check_gradients_reach",
    "check_init_scale",
    "check_invariant",
    "check_train_eval_consistency",
    "models_and_inputs",
    "specs",
    "tensors",
]


# -- invariants ----------------------------------------------------------------------------

_MAX_REPORTED = 5


def _failures(predicate: Callable[..., object], rec: Record) -> list[tuple[str, str]]:
    """Every ``(path, where)`` for which `predicate` fails, innermost modules first: a
    container fails because a submodule did, so the submodule is the one to report."""
    found = []
    for path, node in rec.items():
        for name in node:
            calls = node.calls(name)
            for i, value in enumerate(calls):
                leaves = tensor_leaves(value)
                for j, t in enumerate(leaves):
                    if not bool(predicate(path, name, t)):
                        part = f" (tensor {j + 1} of {len(leaves)})" if len(leaves) > 1 else ""
                        found.append((path, f"the {name!r} of module {path_label(path)}{part}, call {i + 1} of {len(calls)}"))
                        break
    paths = {p for p, _ in found}

    def is_outer(path: str) -> bool:
        return any(q != path and (not path or q.startswith(path + ".")) for q in paths)

    return sorted(found, key=lambda f: is_outer(f[0]))


def _takes_record(predicate: Callable[..., object]) -> bool:
    """Whether `predicate` takes one argument (a Record) rather than ``(path, name, tensor)``."""
    try:
        params = inspect.signature(predicate).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: the per-tensor form
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len([p for p in positional if p.default is p.empty]) == 1


def _record_failure(predicate: Callable[[Record], object], rec: Record) -> str | None:
    """Where a Record predicate fails: the innermost module, first in module order, whose
    record alone makes it false; the whole Record when none does; None when it holds."""
    if bool(predicate(rec)):
        return None
    alone = []
    for path, node in rec.items():
        try:
            holds = bool(predicate(Record({path: {name: node.calls(name) for name in node}})))
        except Exception:  # noqa: BLE001, S112 - a predicate about several modules need not accept one alone
            continue
        if not holds:
            alone.append(path)
    inner = _invariant.innermost(alone)
    if inner is None:
        return "the whole Record (no module's record alone makes it false)"
    return f"the record of module {path_label(inner)} alone"


def check_invariant(
    model: nn.Module,
    predicate: Callable[[str, str, torch.Tensor], object] | Callable[[Record], object],
    inputs_strategy: st.SearchStrategy[object],
    *,
    specs: Spec | Iterable[Spec] = outputs("**"),
    settings: hypothesis.settings | None = None,
    seed: int | None = _invariant.DRAW_SEED,
) -> None:
    """Check that `predicate` holds for what `model` stores on every drawn input.

    For each input drawn from `inputs_strategy` (a tuple is spread as positional
    arguments), the model runs inside ``with_hooks(model, specs)`` (and, when a spec has a
    backward event, a backward pass of the sum of its outputs). A predicate of three
    arguments, ``predicate(path, name, tensor)``, is called for every stored tensor of the
    Record: every call, every tensor of a tuple output or an ``(args, kwargs)`` input. A
    predicate of one argument, ``predicate(record)``, is called with the whole Record, for
    invariants across modules. A falsy result is a failure: Hypothesis shrinks the input and
    the error names the module path (for a Record predicate: the innermost module whose
    record alone makes it false, if any), with the shrunk input. Call it from a plain test,
    not a ``@given`` one.

    Args:
        model: the model (its train/eval mode is used as it is).
        predicate: ``(path, name, tensor) -> bool`` or ``(record) -> bool``.
        inputs_strategy: a Hypothesis strategy of inputs.
        specs: what to store; every module's output by default.
        settings: Hypothesis settings; default: the loaded profile without a deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_invariant: ...`` naming the module path, then
            the shrunk input.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        >>> in_range = lambda path, name, out: bool((out.abs() <= 1).all())
        >>> fh.testing.check_invariant(model, in_range, fh.testing.tensors((3, 2)), specs=fh.outputs(nn.Tanh))
        >>> shrinks = lambda rec: rec["1"]["output"].abs().sum() <= rec["0"]["output"].abs().sum()
        >>> fh.testing.check_invariant(model, shrinks, fh.testing.tensors((3, 2)))
    """
    hyp = _invariant.hypothesis()
    spec_tuple = as_specs(specs, "check_invariant")
    if not callable(predicate):
        raise SpecError(
            "check_invariant: `predicate` is a callable `(path, name, tensor) -> bool` or `(record) -> bool`, "
            f"got {predicate!r}. Pass a function such as `lambda path, name, out: bool(out.isfinite().all())`."
        )
    on_record = _takes_record(predicate)
    needs_backward = any(s.needs_backward for s in spec_tuple)
    if settings is None:
        settings = hyp.settings(hyp.settings.default, deadline=None)

    @settings
    @hyp.given(inputs_strategy)
    def holds(drawn: object) -> None:
        args = drawn if isinstance(drawn, tuple) else (drawn,)
        with torch.set_grad_enabled(needs_backward), with_hooks(model, spec_tuple) as run:
            out = model(*args)
            if needs_backward:
                backward_all(out)
        if on_record:
            where = _record_failure(predicate, run.record)  # type: ignore[arg-type]
            if where is not None:
                raise AssertionError(
                    f"check_invariant: `predicate` must hold for the Record, got False for {where}. "
                    f"Fix the model or the invariant.\ninput: {drawn!r}"
                )
            return
        failures = _failures(predicate, run.record)
        if failures:
            also = "".join(f"\nalso false for {where}" for _, where in failures[1:_MAX_REPORTED])
            more = len(failures) - _MAX_REPORTED
            raise AssertionError(
                f"check_invariant: `predicate` must hold for every stored tensor, got False for "
                f"{failures[0][1]}. Fix the model or the invariant.{also}"
                + (f"\n... and {more} more" if more > 0 else "")
                + f"\ninput: {drawn!r}"
            )

    _invariant.seeded(holds, seed)()
