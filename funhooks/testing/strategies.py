"""Hypothesis strategies of the kit: tensors, small random models with matching inputs, and valid
specs for a model.

Hypothesis is imported when a strategy is asked for, never by ``import funhooks``.

Cost: strategies draw tiny models (a few hundred parameters)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from funhooks import _torch
from funhooks.runs.introspect import never_called
from funhooks.specs import Spec, grads, inputs, observe, outputs, select

from . import _invariant, _models
from .transparency import tensor_leaves

if TYPE_CHECKING:  # pragma: no cover - types only
    from hypothesis import strategies as st
    from hypothesis.strategies import DrawFn

__all__ = ["models_and_inputs", "specs", "tensors"]


# -- strategies ----------------------------------------------------------------------------


def tensors(shape: Iterable[int], *, min_value: float = -10.0, max_value: float = 10.0,
            dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> st.SearchStrategy[torch.Tensor]:
    """A strategy for float tensors of `shape` whose elements Hypothesis draws and shrinks.

    Every element is drawn, so keep `shape` small (up to a few hundred elements); for large
    inputs map a seed to ``torch.randn`` instead.

    Args:
        shape: the tensor's shape.
        min_value, max_value: the range of the elements (rounded to `dtype`).
        dtype: a floating dtype.
        device: where the tensor lives.

    Returns:
        A Hypothesis strategy.

    Example:
        >>> import funhooks as fh
        >>> from hypothesis import find
        >>> big = find(fh.testing.tensors((2, 3), min_value=0, max_value=1), lambda x: x.sum() > 2)
        >>> big.shape, bool(((0 <= big) & (big <= 1)).all())
        (torch.Size([2, 3]), True)
    """
    st = _invariant.hypothesis().strategies
    shape = tuple(int(n) for n in shape)
    count = 1
    for n in shape:
        count *= n
    elements = st.floats(min_value, max_value, allow_nan=False)
    return st.lists(elements, min_size=count, max_size=count).map(
        lambda xs: torch.tensor(xs, dtype=dtype, device=device).reshape(shape)
    )


# Random models are built from these small modules; each has a readable repr for Hypothesis.


def models_and_inputs(*, max_depth: int = 2, device: str | torch.device = "cpu") -> st.SearchStrategy[tuple[nn.Module, torch.Tensor]]:
    """A strategy for ``(model, x)``: a small random model and an input it accepts.

    Models are nested containers (``nn.Sequential``, loops over ``nn.ModuleList``,
    residual blocks) of linear, conv, norm (BatchNorm, LayerNorm, GroupNorm) and activation
    layers, including in-place activations (only where autograd allows them), one module
    instance called twice, a module returning a tuple that is unpacked into the next, and a
    module called with a keyword argument. Inputs are ``(batch, features)`` or
    ``(batch, channels, height, width)`` float tensors with a batch of 2 to 4 (BatchNorm
    needs two), drawn from a seed. Models are in training mode and deterministic.

    Args:
        max_depth: how deeply containers nest.
        device: where the model and input live.

    Returns:
        A Hypothesis strategy; shrinking simplifies the model and the seed.

    Example:
        >>> import funhooks as fh
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=5, deadline=None)
        ... @given(fh.testing.models_and_inputs())
        ... def test_runs(model_and_input):
        ...     model, x = model_and_input
        ...     assert model(x) is not None
        >>> test_runs()
    """
    hyp = _invariant.hypothesis()
    st = hyp.strategies

    @st.composite
    def draw_pair(draw: DrawFn) -> tuple[nn.Module, torch.Tensor]:
        batch = draw(st.integers(2, 4))
        if draw(st.booleans()):
            shape = _models.Shape("vec", draw(st.integers(1, _models.MAX_FEATURES)))
            size: tuple[int, ...] = (batch, shape.channels)
        else:
            side = draw(st.integers(2, _models.MAX_SIDE))
            shape = _models.Shape("img", draw(st.integers(1, _models.MAX_CHANNELS)), side)
            size = (batch, shape.channels, side, side)
        layers, _, _ = _models.blocks(draw, st, shape, max_depth, False)
        seed = draw(st.integers(0, 2**31 - 1))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = nn.Sequential(*layers)
            x = torch.randn(size)
        return model.to(device), x.to(device)

    return draw_pair()


# -- specs for a model -------------------------------------------------------------------


def _output_mean(module: nn.Module, args: tuple, output: object) -> torch.Tensor:
    """The mean of every float tensor in `output`, stacked (a forward observer)."""
    return torch.stack([t.float().mean() for t in tensor_leaves(output)] or [torch.zeros(())])


def _arg_count(module: nn.Module, args: tuple) -> torch.Tensor:
    """The number of positional arguments (a ``forward_pre`` observer)."""
    return torch.tensor(len(args))


def _grad_norm(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The norm of a parameter's gradient (a ``param_grad`` observer)."""
    return grad.detach().norm()


def specs(model: nn.Module, *, clone: bool | None = None, max_specs: int = 3) -> st.SearchStrategy[tuple[Spec, ...]]:
    """A strategy for a tuple of valid observer specs for `model`.

    Each spec is one of ``outputs``, ``inputs``, ``grads`` or ``observe`` (forward,
    forward_pre and param_grad events, with tensor-valued functions), at most one per
    record name so they never clash. Selectors are drawn from the model's real paths
    (``""`` is the root), its module types, ``"**"``, path patterns with a ``*`` segment,
    and its module instances; flags (``detach``, ``cpu``, ``clone``) are drawn too.

    Args:
        model: the model the specs are for.
        clone: force ``clone=`` on every spec (``True`` makes every Record readable after
            in-place ops); ``None`` draws it.
        max_specs: the most specs in one draw.

    Returns:
        A Hypothesis strategy of tuples of Specs, each of which ``with_hooks`` accepts.

    Example:
        >>> import torch, funhooks as fh
        >>> from hypothesis import given, settings
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> @settings(max_examples=5, deadline=None)
        ... @given(fh.testing.specs(model))
        ... def test_transparent(specs):
        ...     fh.testing.assert_transparent(model, specs, torch.ones(2, 2))
        >>> test_transparent()
    """
    st = _invariant.hypothesis().strategies
    every = list(_torch.named_modules(model))
    modules = [(p, m) for p, m in every if not never_called(m)]  # a ModuleList alone is refused
    paths = [p for p, _ in modules]
    types = sorted({type(m) for _, m in modules}, key=lambda t: t.__qualname__)
    patterns = sorted({".".join("*" if i == k else s for i, s in enumerate(p.split("."))) + tail
                       for p, _ in every if p for k in range(p.count(".") + 1) for tail in ("", ".**")})
    patterns = [p for p in patterns if any(not never_called(m) for _, m in select(p).resolve(model))]
    param_modules = [m for _, m in modules if any(True for _ in m.parameters(recurse=False))]
    where = st.one_of(
        st.sampled_from(paths),
        st.sampled_from(types),
        st.just("**"),
        st.sampled_from(patterns) if patterns else st.just("**"),
        st.sampled_from([m for _, m in modules]),
    )
    flag = st.booleans()

    @st.composite
    def draw_specs(draw: DrawFn) -> tuple[Spec, ...]:
        kinds = ["outputs", "inputs", "grads", "observe_forward", "observe_pre"]
        if param_modules:
            kinds.append("observe_param")
        chosen = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=max_specs, unique=True))
        out = []
        for kind in chosen:
            sel = draw(where)
            if kind == "observe_param":
                sel = draw(st.sampled_from(param_modules))
            flags = {"detach": draw(flag), "cpu": draw(flag),
                     "clone": draw(flag) if clone is None else clone}
            if kind == "outputs":
                out.append(outputs(sel, **flags))
            elif kind == "inputs":
                out.append(inputs(sel, **flags))
            elif kind == "grads":
                out.append(grads(sel, **flags))
            elif kind == "observe_forward":
                out.append(observe(sel, _output_mean, name="mean", **flags))
            elif kind == "observe_pre":
                out.append(observe(sel, _arg_count, event="forward_pre", name="arg_count", **flags))
            else:
                out.append(observe(sel, _grad_norm, event="param_grad", name="grad_norm", **flags))
        return tuple(out)

    return draw_specs()
