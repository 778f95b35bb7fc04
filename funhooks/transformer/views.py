"""Per-head views of the tensors a transformer's modules make: what the standard points
``q``, ``k``, ``v`` and ``z`` read, and what an intervention on them writes back.

A projection's output (or the output projection's input) holds the heads side by side in its
last dimension; a view splits them off as ``(..., head, d_head)``, and for a fused q/k/v
projection picks q, k or v out of it in the layout the family uses. Writing back is a new
tensor made with ``cat`` / ``stack`` / ``flatten`` (never an in-place write), so an edit
through a view differentiates and maps under ``torch.func.vmap``.

Cost: reading is a view (no copy) except NeoX's fused layout (one ``select``, still a view);
writing back allocates one tensor of the projection's size.
"""

from __future__ import annotations

import attrs
import torch

from funhooks import _frozen
from funhooks.specs.editing import View

__all__ = ["Heads", "Interleaved", "Thirds"]

Tensor = torch.Tensor
_PARTS = 3
"""q, k and v: the parts of a fused projection."""


@_frozen.frozen
@attrs.frozen
class Heads(View):
    """The last dimension split into `n` heads: ``(..., n * d) <-> (..., n, d)``.

    Example:
        >>> import torch
        >>> from funhooks.transformer.views import Heads
        >>> Heads(2).get(torch.arange(4.0)).tolist()
        [[0.0, 1.0], [2.0, 3.0]]
    """

    n: int

    def get(self, tensor: Tensor) -> Tensor:
        return tensor.unflatten(-1, (self.n, -1))

    def put(self, tensor: Tensor, new: Tensor) -> Tensor:
        return new.flatten(-2)


@_frozen.frozen
@attrs.frozen
class Thirds(View):
    """Part `part` (0 q, 1 k, 2 v) of a fused ``[q | k | v]`` projection (GPT-2's
    ``c_attn``), heads split off.

    Example:
        >>> import torch
        >>> from funhooks.transformer.views import Thirds
        >>> Thirds(1, 1).get(torch.arange(6.0)).tolist()
        [[2.0, 3.0]]
    """

    part: int
    n: int

    def get(self, tensor: Tensor) -> Tensor:
        return tensor.chunk(_PARTS, -1)[self.part].unflatten(-1, (self.n, -1))

    def put(self, tensor: Tensor, new: Tensor) -> Tensor:
        parts = list(tensor.chunk(_PARTS, -1))
        parts[self.part] = new.flatten(-2)
        return torch.cat(parts, -1)


@_frozen.frozen
@attrs.frozen
class Interleaved(View):
    """Part `part` (0 q, 1 k, 2 v) of a fused projection laid out per head,
    ``[q_0 | k_0 | v_0 | q_1 | ...]`` (GPT-NeoX's ``query_key_value``).

    Example:
        >>> import torch
        >>> from funhooks.transformer.views import Interleaved
        >>> Interleaved(1, 2).get(torch.arange(6.0)).tolist()
        [[1.0], [4.0]]
    """

    part: int
    n: int

    def get(self, tensor: Tensor) -> Tensor:
        return tensor.unflatten(-1, (self.n, _PARTS, -1)).select(-2, self.part)

    def put(self, tensor: Tensor, new: Tensor) -> Tensor:
        parts = list(tensor.unflatten(-1, (self.n, _PARTS, -1)).unbind(-2))
        parts[self.part] = new
        return torch.stack(parts, -2).flatten(-3)
