"""Mean outputs as a fold: the reference values of mean-ablation, over a whole dataset.

``fh.fold(fh.OutputMeans(where), fh.evaluate(model, batches, specs=...))`` streams the
selected modules' outputs and keeps one running sum per module, never the outputs
themselves; the result is a Record of means that ``fh.ablate(where, mean=...)`` reads.

Cost: per step, one sum over the batch dimension per module (in float64); memory, one
activation-sized tensor per module.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from funhooks import _frozen
from funhooks.errors import ReducerError
from funhooks.records.record import Record
from funhooks.specs.selector import Selector, path_label, select
from funhooks.specs.spec import Spec, outputs
from funhooks.training.step import Step

__all__ = ["OutputMeans"]

_State = dict[str, tuple[torch.Tensor, int]]


@_frozen.frozen
@attrs.frozen
class OutputMeans:
    """A reducer: each selected module's mean output over every example of the folded steps
    (means over the first, batch, dimension; the other dimensions are kept).

    Its result is a Record holding, per module, the mean with a batch dimension of 1 under
    ``"output"``: ``fh.ablate(where, mean=result)`` puts it in place of the module's output.
    It merges (chunks of steps, ranks) exactly.

    Args:
        where: a selector.
        element: for modules returning a tuple, list or dict, the item averaged.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Identity())
        >>> means = fh.OutputMeans("0")
        >>> batches = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0], [5.0, 6.0]])]
        >>> result = fh.fold(means, fh.evaluate(model, batches, specs=means.specs))
        >>> result["0"]["output"]
        tensor([[3., 4.]])
    """

    where: Selector = attrs.field(converter=select)
    element: int | str = 0

    @property
    def specs(self) -> tuple[Spec, ...]:
        """The spec whose records it reads: the selected modules' outputs."""
        return (outputs(self.where),)

    def init(self) -> _State:
        """No module seen yet."""
        return {}

    def step(self, state: _State, step: Step) -> _State:
        """Add one step's outputs (every call of every selected module) to the sums."""
        new = dict(state)
        for path, node in step.record.items():
            if "output" not in node:
                continue
            for value in node.calls("output"):
                t = value if isinstance(value, torch.Tensor) else self._item(value, path)
                new[path] = self._add(path, new.get(path), (t.double().sum(0, keepdim=True), t.shape[0]))
        return new

    def merge(self, a: _State, b: _State) -> _State:
        """The state of the steps of `a` and `b` together."""
        merged = dict(a)
        for path, part in b.items():
            merged[path] = self._add(path, merged.get(path), part)
        return merged

    def scalars(self, state: _State, *, since: int = 0) -> dict[str, float]:
        """None (``{}``): its statistics are mean activations, tensors for ablation, not numbers
        to watch per step."""
        return {}

    def result(self, state: _State) -> Record:
        """A Record of the means, ``(1, ...)``-shaped, under ``"output"``."""
        return Record({path: {"output": ((total / n).float(),)} for path, (total, n) in state.items()})

    def _add(self, path: str, acc: tuple[torch.Tensor, int] | None,
             part: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
        if acc is None:
            return part
        if acc[0].shape != part[0].shape:
            raise ReducerError(
                f"OutputMeans: the outputs of one module have one shape after the batch dimension, got "
                f"{tuple(part[0].shape[1:])} after {tuple(acc[0].shape[1:])} at module {path_label(path)}. "
                "Pad or crop the batches to one length."
            )
        return acc[0] + part[0], acc[1] + part[1]

    def _item(self, value: Any, path: str) -> torch.Tensor:
        try:
            item = value[self.element]
        except (IndexError, KeyError, TypeError):
            item = None
        if not isinstance(item, torch.Tensor):
            raise ReducerError(
                f"OutputMeans: `element` names a tensor in the output of every selected module, got element "
                f"{self.element!r} of a {type(value).__name__} at module {path_label(path)}. Pass `element=`."
            )
        return item
