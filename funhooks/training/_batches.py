"""Batches as the training loops take them: described in messages, split into ``(x, y)``,
grouped into micro-batches, moved to the model's device.

A batch is any pytree: a tensor, a tuple or list, a dict (Hugging Face models take
``model(**batch)``), a namedtuple, a dataclass, or a mapping such as transformers'
``BatchEncoding``. Moving one moves every tensor in it and keeps the rest.

Cost: moving a batch is one ``Tensor.to(device, non_blocking=True)`` per tensor (nothing for
a tensor already there); grouping keeps a list of `accumulate` batches.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch import nn

from funhooks.errors import LoopError

__all__ = ["group", "model_device", "pair", "to_device"]

B = TypeVar("B")


def _describe(batch: object) -> str:
    """A batch as an error message names it."""
    if isinstance(batch, torch.Tensor):
        return f"a Tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)} items"
    if isinstance(batch, collections.abc.Mapping):
        return f"a {type(batch).__name__} with keys {list(batch)}"
    return f"a {type(batch).__name__}"


def pair(batch: object, index: int, caller: str) -> tuple[Any, Any]:
    """``(x, y)`` of a batch the built-in step takes, or a LoopError saying what came."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise LoopError(
        f"{caller}: each batch is an `(x, y)` pair for `loss_fn(model(x), y)`, got {_describe(batch)} at batch "
        f"{index}. Yield `(x, y)` tuples, e.g. from a DataLoader over a TensorDataset, or pass your own "
        "`step=fn(model, batch)`."
    )


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for a model with neither."""
    for t in model.parameters():
        return t.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device` (containers rebuilt, other values kept).

    Example:
        >>> import torch
        >>> from funhooks.training._batches import to_device
        >>> moved = to_device({"input_ids": torch.ones(2, 3, dtype=torch.long), "n": 2}, torch.device("cpu"))
        >>> moved["input_ids"].device.type, moved["n"]
        ('cpu', 2)
    """
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict) and type(batch) is dict:
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, collections.abc.Mapping):  # BatchEncoding, OrderedDict, UserDict alike
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            return cast("Callable[[dict[object, object]], object]", type(batch))(moved)
        except TypeError:
            return moved
    return batch


def group(batches: Iterable[B], size: int) -> Iterator[list[B]]:
    """Consecutive batches in lists of `size` (the last one may be shorter)."""
    chunk: list[B] = []
    for batch in batches:
        chunk.append(batch)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
