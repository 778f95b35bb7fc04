"""Building blocks of the random models that ``funhooks.testing.models_and_inputs`` draws.

Tiny modules that track their output shape (residual adds, forks returning tuples, joins
taking keyword arguments, shared scaled blocks), and the Hypothesis-driven functions that
chain them so that in-place activations appear only where autograd allows them.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover - types only
    from hypothesis.strategies import DrawFn

__all__ = ["MAX_CHANNELS", "MAX_FEATURES", "MAX_SIDE", "Shape", "blocks"]


class _Residual(nn.Module):
    """``x + body(x)``."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class _Fork(nn.Module):
    """Returns a tuple ``(x, body(x))``."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.body(x)


class _Join(nn.Module):
    """Takes two positional tensors and adds them."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class _ForkJoin(nn.Module):
    """A module returning a tuple, unpacked into the next one."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.fork, self.join = _Fork(body), _Join()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.join(*self.fork(x))


class _Scale(nn.Module):
    """Multiplies by a keyword-only `scale`."""

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return x * scale


class _Scaled(nn.Module):
    """Calls a submodule with a keyword argument: ``scale(body(x), scale=...)``."""

    def __init__(self, body: nn.Module, scale: float) -> None:
        super().__init__()
        self.body, self.scale, self.factor = body, _Scale(), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.body(x), scale=self.factor)


class _Chain(nn.Module):
    """A loop over an ``nn.ModuleList``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Shape(NamedTuple):
    """What a block takes or gives, the batch left out: a vector of `channels` features
    (``"vec"``), or an image of `channels` channels, `side` by `side` (``"img"``)."""

    kind: Literal["vec", "img"]
    channels: int
    side: int = 0


MAX_FEATURES = 6
MAX_CHANNELS = 3
MAX_SIDE = 5
_SCALES = (0.5, 2.0)
_MAX_BLOCKS = 3


_ACTIVATIONS: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "relu": (nn.ReLU, False),
    "tanh": (nn.Tanh, False),
    "gelu": (nn.GELU, True),
    "sigmoid": (nn.Sigmoid, False),
    "leaky_relu": (lambda: nn.LeakyReLU(0.1), False),
}
"""name -> (factory, whether an in-place op may follow: the output is not saved for backward)."""


def _activation(draw: DrawFn, st: ModuleType, *, inplace_ok: bool) -> tuple[nn.Module, bool]:
    """An activation, in place only where autograd allows it, and its own freshness."""
    kinds = list(_ACTIVATIONS) + (["relu_", "leaky_relu_"] if inplace_ok else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "relu_":
        return nn.ReLU(inplace=True), False
    if kind == "leaky_relu_":
        return nn.LeakyReLU(0.1, inplace=True), False
    factory, fresh = _ACTIVATIONS[kind]
    return factory(), fresh


def _block(draw: DrawFn, st: ModuleType, shape: Shape, depth: int, fresh: bool,
           keep_shape: bool) -> tuple[nn.Module, Shape, bool]:
    """One drawn block for inputs of `shape` (``Shape("vec", F)`` or ``Shape("img", C, H)``).

    `fresh` says whether an in-place op may modify the block's input (it is no leaf and
    no op before saved it); `keep_shape` asks for a block whose output has the input's
    shape. Returns the block, its output shape and its own freshness.
    """
    kinds = ["layer", "norm", "activation", "activation"]
    if shape.kind == "img" and not keep_shape:
        kinds.append("flatten")
    if depth > 0:
        kinds += ["sequential", "chain", "residual", "fork", "scaled", "shared"]
    kind = draw(st.sampled_from(kinds))
    if kind == "layer":
        if shape.kind == "vec":
            out = shape.channels if keep_shape else draw(st.integers(1, MAX_FEATURES))
            return nn.Linear(shape.channels, out), Shape("vec", out), True
        out = shape.channels if keep_shape else draw(st.integers(1, MAX_CHANNELS))
        return nn.Conv2d(shape.channels, out, 3, padding=1), Shape("img", out, shape.side), True
    if kind == "norm":
        if shape.kind == "vec":
            norm = draw(st.sampled_from([nn.BatchNorm1d, nn.LayerNorm]))(shape.channels)
        else:
            norm = draw(st.sampled_from([nn.BatchNorm2d, lambda c: nn.GroupNorm(1, c)]))(shape.channels)
        return norm, shape, True
    if kind == "activation":
        module, after = _activation(draw, st, inplace_ok=fresh)
        return module, shape, after
    if kind == "flatten":
        return nn.Flatten(), Shape("vec", shape.channels * shape.side * shape.side), fresh
    if kind in ("sequential", "chain"):
        layers, shape, fresh = blocks(draw, st, shape, depth - 1, fresh, keep_shape)
        return (nn.Sequential(*layers) if kind == "sequential" else _Chain(layers)), shape, fresh
    if kind == "shared":
        # One instance called twice: shape preserving, so it can run on its own output.
        if shape.kind == "vec":
            layer: nn.Module = nn.Linear(shape.channels, shape.channels)
        else:
            layer = nn.Conv2d(shape.channels, shape.channels, 3, padding=1)
        return nn.Sequential(layer, nn.Tanh(), layer), shape, True
    # The body's input is shared with the skip path, so nothing may change it in place.
    body_layers, body_shape, _ = blocks(draw, st, shape, depth - 1, False, keep_shape or kind != "scaled")
    body = nn.Sequential(*body_layers)
    if kind == "scaled":
        return _Scaled(body, draw(st.sampled_from(_SCALES))), body_shape, True
    return (_Residual(body) if kind == "residual" else _ForkJoin(body)), shape, True


def blocks(draw: DrawFn, st: ModuleType, shape: Shape, depth: int, fresh: bool,
           keep_shape: bool = False) -> tuple[list[nn.Module], Shape, bool]:
    layers = []
    for _ in range(draw(st.integers(1, _MAX_BLOCKS))):
        block, shape, fresh = _block(draw, st, shape, depth, fresh, keep_shape)
        layers.append(block)
    return layers, shape, fresh
