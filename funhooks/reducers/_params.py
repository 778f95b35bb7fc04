"""Per-layer sums over many parameter-sized tensors at once, on their device.

A layer owns a few tensors (a weight and a bias; their gradients); a model has many layers
whose tensors often share shapes. :class:`Groups` stacks the tensors of one shape, dtype and
device together, so each group costs a handful of kernels whatever the number of layers, and
:meth:`Groups.by_layer` adds per-tensor sums into per-layer ones with one ``index_add``, all
without a host sync. A :class:`_Plan` keeps the flat tensor list and its groups for a
:class:`~funhooks.training.Layers` between steps.

Cost: per group, one stack (a copy of the tensors) and a few reductions over it; per call,
one ``index_add`` of a ``(tensors, k)`` table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from funhooks import _torch

__all__ = ["Groups", "plan"]


class Groups:
    """Tensors of one shape, dtype and device, stacked together; each tensor's layer.

    Sharded tensors (FSDP2's ``DTensor`` parameters and gradients) are stacked as this rank's
    local shards, and :meth:`by_layer` adds their per-tensor sums over the ranks holding the
    other shards (one all-reduce of the small table), so every rank gets the whole tensors'
    sums; any other ``DTensor`` is gathered whole first.
    """

    __slots__ = ("aligned", "counts", "group", "layers", "members", "owner", "owners", "shards", "starts", "views")

    def __init__(self, tensors: Sequence[torch.Tensor], owners: Sequence[int], layers: int) -> None:
        groups = [_torch.shard_group(t) for t in tensors]
        self.group = next((g for g in groups if g is not None), None)
        self.views: list[Callable[[torch.Tensor], torch.Tensor]] | None = None
        if self.group is not None or any(_torch.is_dtensor(t) for t in tensors):
            self.views = [_local if g is not None and g is self.group else _whole if _torch.is_dtensor(t) else _same
                          for t, g in zip(tensors, groups)]
        found: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            x = t if self.views is None else self.views[i](t)
            found.setdefault((x.shape, x.dtype, x.device), []).append(i)
        self.members = list(found.values())
        self.owners = [owners[i] for members in self.members for i in members]
        self.layers = layers
        # each group one tensor of every layer, in layer order (a weight and a bias per layer):
        # per-layer sums are the groups' rows added, with no index
        self.aligned = all([owners[i] for i in members] == list(range(layers)) for members in self.members)
        self.owner: dict[torch.device, torch.Tensor] = {}
        self.starts: dict[tuple[torch.device, int, bool], torch.Tensor] = {}
        self.counts = [0.0] * layers  # per layer, its tensors' whole element counts (a complex one's two parts)
        for t, layer in zip(tensors, owners):
            self.counts[layer] += t.numel() * (2 if t.is_complex() else 1)
        order = [i for members in self.members for i in members]
        sharded = [k for k, i in enumerate(order) if self.views is not None and self.views[i] is _local]
        self.shards: list[int] | None = None if len(sharded) == len(order) else sharded

    def stacks(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One ``(members, numel)`` float tensor per group: a copy of `tensors`."""
        views = self.views
        out = []
        for members in self.members:
            parts = [tensors[i] for i in members] if views is None else [views[i](tensors[i]) for i in members]
            x = torch.stack(parts).flatten(1)
            if x.is_complex():  # a complex number's two parts, so norms are the complex norms
                x = torch.view_as_real(x).flatten(1)
            out.append(x if x.dtype in (torch.float32, torch.float64) else x.float())
        return out

    def by_layer(self, rows: Sequence[torch.Tensor], *, counts: bool = False) -> torch.Tensor:
        """Per layer, the sum of the per-tensor rows (one ``(members, k)`` table per group), float64;
        with `counts`, each layer's element count first (a column the rows need not carry)."""
        device = rows[0].device
        k = rows[0].shape[1]
        start = self.starts.get((device, k, counts))
        if start is None:
            start = torch.zeros(self.layers, k + counts, dtype=torch.float64, device=device)
            if counts:
                start[:, 0] = torch.tensor(self.counts, dtype=torch.float64)
            self.starts[device, k, counts] = start
        out = start.clone()
        sums = out[:, 1:] if counts else out
        if self.aligned and self.group is None:  # each row of each group is its layer's: added in place, in
            for r in rows:  # the order index_add would add them, so the very same float64 sums
                sums.add_(r)
            return out
        table = torch.cat([r.to(device, torch.float64) for r in rows]) if len(rows) > 1 else rows[0].double()
        if self.group is not None:
            _over_shards(table, self.shards, self.group)
        index = self.owner.get(device)
        if index is None:
            index = self.owner[device] = torch.tensor(self.owners, dtype=torch.long, device=device)
        sums.index_add_(0, index, table)
        return out

def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local()  # type: ignore[attr-defined]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor()  # type: ignore[attr-defined]


def _over_shards(table: torch.Tensor, shards: list[int] | None, group: torch.distributed.ProcessGroup) -> None:
    """Sum the rows of sharded tensors (`shards`; None: all of them) over the ranks of `group`, in place."""
    if shards is None:
        torch.distributed.all_reduce(table, group=group)
        return
    if shards:
        index = torch.tensor(shards, dtype=torch.long, device=table.device)
        part = table.index_select(0, index)
        torch.distributed.all_reduce(part, group=group)
        table.index_copy_(0, index, part)


class _Plan:
    """The flat list of a Layers' parameters, their layers and their groups."""

    __slots__ = ("flat", "groups", "owners", "sparse")

    def __init__(self, params: Sequence[Sequence[torch.Tensor]]) -> None:
        self.flat = [p for ps in params for p in ps]
        self.owners = [i for i, ps in enumerate(params) for _ in ps]
        self.groups = Groups(self.flat, self.owners, len(params))
        self.sparse = False


def plan(cache: dict, params: Sequence[Sequence[torch.Tensor]]) -> _Plan:
    """The :class:`_Plan` of `params`, kept in a Layers' `cache`."""
    found = cache.get("plan")
    if found is None:
        found = cache["plan"] = _Plan(params)
    return found
