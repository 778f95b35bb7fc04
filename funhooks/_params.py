"""Per-layer sums over many parameter-sized tensors at once, on their device.

A layer owns a few tensors (a weight and a bias; their gradients); a model has many layers
whose tensors often share shapes. :class:`Groups` stacks the tensors of one shape, dtype and
device together, so each group costs a handful of kernels whatever the number of layers, and
:meth:`Groups.by_layer` adds per-tensor sums into per-layer ones with one ``index_add``, all
without a host sync. A :class:`Plan` keeps the flat tensor list and its groups for a
:class:`~funhooks.watch.Layers` between steps.

Cost: per group, one stack (a copy of the tensors) and a few reductions over it; per call,
one ``index_add`` of a ``(tensors, k)`` table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Groups", "Plan", "plan"]


class Groups:
    """Tensors of one shape, dtype and device, stacked together; each tensor's layer."""

    __slots__ = ("layers", "members", "owner", "owners")

    def __init__(self, tensors: Sequence[torch.Tensor], owners: Sequence[int], layers: int) -> None:
        found: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            found.setdefault((t.shape, t.dtype, t.device), []).append(i)
        self.members = list(found.values())
        self.owners = [owners[i] for members in self.members for i in members]
        self.layers = layers
        self.owner: dict[torch.device, torch.Tensor] = {}

    def stacks(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One ``(members, numel)`` float tensor per group: a copy of `tensors`."""
        out = []
        for members in self.members:
            x = torch.stack([tensors[i] for i in members]).flatten(1)
            out.append(x if x.dtype in (torch.float32, torch.float64) else x.float())
        return out

    def by_layer(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per layer, the sum of the per-tensor rows (one ``(members, k)`` table per group), float64."""
        device = rows[0].device
        table = torch.cat([r.to(device, torch.float64) for r in rows]) if len(rows) > 1 else rows[0].double()
        index = self.owner.get(device)
        if index is None:
            index = self.owner[device] = torch.tensor(self.owners, dtype=torch.long, device=device)
        return torch.zeros(self.layers, table.shape[1], dtype=torch.float64, device=device).index_add_(0, index, table)


class Plan:
    """The flat list of a Layers' parameters, their layers and their groups."""

    __slots__ = ("flat", "groups", "owners", "sparse")

    def __init__(self, params: Sequence[Sequence[torch.Tensor]]) -> None:
        self.flat = [p for ps in params for p in ps]
        self.owners = [i for i, ps in enumerate(params) for _ in ps]
        self.groups = Groups(self.flat, self.owners, len(params))
        self.sparse = False


def plan(cache: dict, params: Sequence[Sequence[torch.Tensor]]) -> Plan:
    """The :class:`Plan` of `params`, kept in a Layers' `cache`."""
    found = cache.get("plan")
    if found is None:
        found = cache["plan"] = Plan(params)
    return found
