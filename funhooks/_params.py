"""Per-layer statistics of many parameter-sized tensors at once, on their device.

A layer owns a few tensors (a weight and a bias; their gradients); a model has many layers
whose tensors often share shapes. :class:`Groups` stacks the tensors of one shape, dtype and
device together, so each group costs a handful of kernels whatever the number of layers, and
:func:`layer_moments` combines the per-tensor moments into per-layer ones (counts, means,
squared deviations by Chan's formula, zero counts), all without a host sync.

Cost: per group, one stack (a copy of the tensors) and about six kernels over it; per call,
about ten small kernels to combine the rows by layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Groups", "layer_moments", "layer_sums"]


class Groups:
    """Tensors of one shape, dtype and device, stacked together; each tensor's layer."""

    __slots__ = ("members", "owner", "owners")

    def __init__(self, tensors: Sequence[torch.Tensor], owners: Sequence[int]) -> None:
        found: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            found.setdefault((t.shape, t.dtype, t.device), []).append(i)
        self.members = list(found.values())
        order = [i for members in self.members for i in members]
        self.owners = [owners[i] for i in order]
        self.owner: dict[torch.device, torch.Tensor] = {}

    def stacks(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One ``(members, numel)`` float tensor per group: a copy of `tensors`."""
        out = []
        for members in self.members:
            x = torch.stack([tensors[i] for i in members]).flatten(1)
            out.append(x if x.dtype in (torch.float32, torch.float64) else x.float())
        return out

    def owner_index(self, device: torch.device) -> torch.Tensor:
        """The layer of each row of the concatenated stacks, on `device`."""
        index = self.owner.get(device)
        if index is None:
            index = self.owner[device] = torch.tensor(self.owners, dtype=torch.long, device=device)
        return index


def _by_layer(values: torch.Tensor, owners: torch.Tensor, layers: int) -> torch.Tensor:
    return torch.zeros(layers, *values.shape[1:], dtype=values.dtype, device=values.device).index_add_(0, owners, values)


def layer_moments(groups: Groups, stacks: Sequence[torch.Tensor], layers: int) -> torch.Tensor:
    """``(layers, 4)`` float64: per layer the element count, mean, sum of squared deviations
    from the mean and count of exact zeros of its tensors, all on the first stack's device."""
    device = stacks[0].device
    rows = []
    for x in stacks:
        mean = x.mean(1)
        m2 = torch.linalg.vector_norm(x - mean[:, None], dim=1).square()
        zeros = torch.eq(x, 0, out=torch.empty_like(x)).sum(1)
        n = torch.full_like(mean, x.shape[1])
        rows.append(torch.stack((n, mean, m2, zeros), 1).to(device, torch.float64))
    per = rows[0] if len(rows) == 1 else torch.cat(rows)
    owners = groups.owner_index(device)
    n, mean, m2, zeros = per.unbind(1)
    total = _by_layer(n, owners, layers)
    layer_mean = _by_layer(n * mean, owners, layers) / total
    spread = _by_layer(m2 + n * (mean - layer_mean.index_select(0, owners)).square(), owners, layers)
    return torch.stack((total, layer_mean, spread, _by_layer(zeros, owners, layers)), 1)


def layer_sums(groups: Groups, per_row: Sequence[torch.Tensor], layers: int) -> torch.Tensor:
    """Per layer, the sum of the per-tensor values `per_row` (one vector per stack), float64."""
    device = per_row[0].device
    values = torch.cat([v.to(device, torch.float64) for v in per_row])
    return _by_layer(values, groups.owner_index(device), layers)
