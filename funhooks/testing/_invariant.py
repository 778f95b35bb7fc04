"""What the ready-made invariant checks share: inputs, the search, the state they restore,
and how they name modules.

- :func:`as_strategy` turns an example input into a Hypothesis strategy of inputs of its
  shape and dtype (or takes the user's strategy as it is);
- :func:`search` draws inputs until a cheap test fails and returns the shrunk failing input;
  the check then runs the model once more with funhooks records to explain it;
- :func:`preserved` restores buffers (batch-norm statistics), train/eval modes and the
  random state after a check, whatever happened;
- :func:`innermost` picks, among modules that break an invariant, the one to blame.

Cost: :func:`preserved` keeps one copy of the buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn

from funhooks import _torch
from funhooks._modes import modes_kept
from funhooks.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover - types only
    from typing import TypeAlias

    import hypothesis as hyp
    from hypothesis.strategies import SearchStrategy

__all__ = ["DRAW_SEED", "EVERY", "Inputs", "as_args", "as_strategy", "hypothesis", "innermost", "is_inside",
           "module_name", "named_modules", "preserved", "search", "seeded", "show", "tensor_leaves"]

_EXAMPLES = 25
"""Examples a check draws unless its `settings` say otherwise: a few seconds on a small model."""
_DRAWN_ELEMENTS = 64
"""Example inputs up to this many elements are drawn element by element, so Hypothesis
shrinks every value; larger ones are drawn from a seed (shrinking a few hundred values
element by element takes seconds)."""
_FLOAT_BOUND = 3.0
"""Element-wise drawn floats lie in ``[-FLOAT_BOUND, FLOAT_BOUND]`` (three standard deviations)."""
DRAW_SEED = 0
"""The seed a check draws its inputs from unless given another: a failure reproduces."""
EVERY = ["", "**"]
"""A selector for the root and every module below it."""

Inputs: TypeAlias = "SearchStrategy[object] | torch.Tensor | tuple[torch.Tensor, ...]"
"""What a check draws its inputs from: a Hypothesis strategy of inputs (a drawn tuple is spread
as positional arguments), or an example tensor (or tuple of tensors) whose like it draws."""

_Drawn = TypeVar("_Drawn")


def hypothesis() -> ModuleType:
    try:
        import hypothesis
    except ImportError:
        raise ImportError(
            "funhooks.testing: the property-testing kit (strategies, `check_invariant`, the invariant checks) "
            "needs Hypothesis, got no module named 'hypothesis'. Install the test extra: `pip install funhooks[test]`."
        ) from None
    return hypothesis


def _settings_for(settings: hyp.settings | None) -> hyp.settings:
    """The Hypothesis settings of a check: the user's, or the loaded profile with at most
    :data:`_EXAMPLES` examples, no deadline and no example database (each check's draws are
    its own). Either way without the explain phase and with one bug reported: the check
    explains its failure itself."""
    hyp = hypothesis()
    if settings is None:
        default = hyp.settings.default
        settings = hyp.settings(
            default,
            max_examples=min(default.max_examples, _EXAMPLES),
            deadline=None,
            database=None,
            suppress_health_check=[*default.suppress_health_check, hyp.HealthCheck.too_slow],
        )
    return hyp.settings(settings, report_multiple_bugs=False,
                        phases=[p for p in settings.phases if p != hyp.Phase.explain])


# -- inputs ---------------------------------------------------------------------------------


def _is_mask(example: torch.Tensor) -> bool:
    """Whether `example` is a mask: bools, or integers that are all 0 or 1."""
    if example.dtype == torch.bool:
        return True
    if example.dtype.is_floating_point or example.dtype.is_complex:
        return False
    return example.numel() > 0 and 0 <= int(example.min()) and int(example.max()) <= 1


def _like(example: torch.Tensor, normal: bool, caller: str) -> SearchStrategy[torch.Tensor]:
    """Tensors of `example`'s shape, dtype and device; a mask as it is."""
    st = hypothesis().strategies
    shape, dtype, device = tuple(example.shape), example.dtype, example.device
    count = example.numel()
    if _is_mask(example):  # which masks are valid (a row of padding only, one key per row) is the model's rule
        return st.just(example).map(torch.clone)
    if dtype.is_floating_point:
        elements: SearchStrategy[float] = st.floats(-_FLOAT_BOUND, _FLOAT_BOUND)

        def seeded(g: torch.Generator) -> torch.Tensor:
            return torch.randn(shape, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    elif not dtype.is_complex:
        low, high = (int(example.min()), int(example.max())) if count else (0, 0)
        elements = st.integers(low, high)

        def seeded(g: torch.Generator) -> torch.Tensor:
            return torch.randint(low, high + 1, shape, generator=g)
    else:
        raise SpecError(
            f"{caller}: an example input is a real, integer or bool tensor, got dtype {dtype}. "
            "Pass a Hypothesis strategy of inputs instead."
        )
    if count <= _DRAWN_ELEMENTS and not normal:
        return st.lists(elements, min_size=count, max_size=count).map(
            lambda xs: torch.tensor(xs, dtype=dtype).reshape(shape).to(device)
        )
    return st.integers(0, 2**32 - 1).map(
        lambda seed: seeded(torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)
    )


def as_strategy(inputs: Inputs, caller: str, *, normal: bool = False) -> SearchStrategy[object]:
    """`inputs` if it is a strategy; else inputs like the example tensor (or tuple of them).

    Example floats are drawn in ``[-3, 3]`` element by element (standard normal from a seed
    with `normal`, or above :data:`_DRAWN_ELEMENTS` elements); integers within the example's
    range of values; a mask (bools, or integers all 0 or 1) stays the example's.
    """
    st = hypothesis().strategies
    if isinstance(inputs, st.SearchStrategy):
        return inputs
    if isinstance(inputs, torch.Tensor):
        return _like(inputs, normal, caller)
    if isinstance(inputs, tuple) and inputs and all(isinstance(t, torch.Tensor) for t in inputs):
        return st.tuples(*(_like(t, normal, caller) for t in inputs))
    raise SpecError(
        f"{caller}: `inputs` is a Hypothesis strategy or an example tensor (or a tuple of "
        f"them), got {type(inputs).__name__}. Pass an example such as `torch.randn(4, 3)`."
    )


def as_args(drawn: object) -> tuple:
    return drawn if isinstance(drawn, tuple) else (drawn,)


def show(drawn: object) -> str:
    return repr(drawn)


# -- the search -----------------------------------------------------------------------------


class _Found(Exception):
    """Raised inside the Hypothesis test: carries the failing draw out of it."""

    def __init__(self, drawn: object) -> None:
        super().__init__("the invariant fails on this input")
        self.drawn = drawn


def seeded(test: Callable[[], None], seed: int | None) -> Callable[[], None]:
    """A Hypothesis `test` that draws from `seed`: the same draws on every call (None:
    Hypothesis' own randomness, new draws each call unless the settings derandomize)."""
    return test if seed is None else hypothesis().seed(seed)(test)


def search(strategy: SearchStrategy[_Drawn], fails: Callable[[_Drawn], bool], settings: hyp.settings | None,
           seed: int | None) -> _Drawn | None:
    """Draw from `strategy` (from `seed`) until ``fails(drawn)``; the shrunk failing draw, or None."""
    hyp = hypothesis()

    @_settings_for(settings)
    @hyp.given(strategy)
    def holds(drawn: _Drawn) -> None:
        if fails(drawn):
            raise _Found(drawn)

    try:
        seeded(holds, seed)()
    except _Found as found:
        return cast(_Drawn, found.drawn)  # what `holds` was given: a draw of `strategy`
    return None


# -- state ------------------------------------------------------------------------------------


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Yield ``reset()``, which puts the buffers back as they were; on exit also the
    train/eval modes and the random state (of the CPU and of the devices in use)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})
    if torch.cuda.is_available() and torch.cuda.is_initialized() and not devices:
        devices = [torch.cuda.current_device()]

    def reset() -> None:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)

    try:
        with modes_kept(model), torch.random.fork_rng(devices=devices):
            yield reset
    finally:
        reset()


# -- modules and tensors ----------------------------------------------------------------------


def tensor_leaves(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in _torch.tree_leaves(value) if isinstance(t, torch.Tensor)]


def is_inside(inner: str, outer: str) -> bool:
    """Whether module path `inner` lies strictly inside module path `outer`."""
    return inner != outer and (outer == "" or inner.startswith(outer + "."))


def innermost(paths: list[str]) -> str | None:
    """The first path (in the given order) that holds none of the others."""
    for path in paths:
        if not any(is_inside(other, path) for other in paths):
            return path
    return None


def module_name(model: nn.Module, path: str) -> str:
    """``'path' (Type)``, or ``'' (the root, Type)``."""
    modules = dict(_torch.named_modules(model))
    kind = type(modules[path]).__name__ if path in modules else "?"
    return f"{path!r} ({kind})" if path else f"'' (the root, {kind})"


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` in module order, wrappers looked through."""
    return list(_torch.named_modules(model))


tree_map = _torch.tree_map
