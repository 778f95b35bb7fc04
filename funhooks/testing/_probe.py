"""A probed forward and backward pass: the gradient flowing into and out of every module call.

:class:`Flow` adds a zero tensor (a *probe*, with an ``fh.edit`` spec) to every float input
and output of every module call, records with observers whether each call ran with
gradients on and produced finite values, and takes one ``torch.autograd.grad`` of the
loss with respect to the probes and the trainable parameters. A probe's gradient is the
gradient of the loss with respect to that input or output of that one call, so a module
that receives a gradient at its output and passes none (or a NaN) back can be named.
Parameters' ``.grad`` are never touched.

A probe makes a module's input a new tensor: a module that changes its input in place
changes the probed copy, not the caller's tensor, during a probed pass.

Cost: one forward and one backward pass; every float input and output is copied once by
the zero add, and the graph of the pass is kept until the gradients are taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from funhooks.records.record import Record
from funhooks.runs.run import with_hooks
from funhooks.specs.spec import edit, observe

from . import _invariant

if TYPE_CHECKING:  # pragma: no cover - types only
    from typing import TypeAlias

__all__ = ["Flow", "LossFn", "ancestors", "kind", "owner", "projection_loss"]

_LOSS_SEED = 0

LossFn: TypeAlias = Callable[[Any], torch.Tensor]
"""``loss_fn(output) -> scalar``: the user's loss of whatever the model returns."""

_Tree = TypeVar("_Tree")


def projection_loss(output: object) -> torch.Tensor:
    """The default loss: a fixed random projection of every float output to a scalar.

    A plain sum would give no gradient through a softmax or a final LayerNorm, whose
    outputs sum to a constant."""
    g = torch.Generator().manual_seed(_LOSS_SEED)
    terms = [(t * torch.randn(t.shape, generator=g).to(t.device, t.dtype)).sum()
             for t in _invariant.tensor_leaves(output) if t.is_floating_point()]
    return torch.stack([t.float() for t in terms]).sum() if terms else torch.zeros(())


def kind(tensors: Sequence[torch.Tensor | None]) -> str | None:
    """``"nan"`` or ``"inf"`` for the first non-finite value, or None."""
    for t in tensors:
        if t is not None and t.is_floating_point():
            if t.isnan().any():
                return "nan"
            if t.isinf().any():
                return "inf"
    return None


def _grad_enabled(module: nn.Module, args: tuple) -> bool:
    return torch.is_grad_enabled()


def _input_kind(module: nn.Module, args: tuple) -> str | None:
    return kind(_invariant.tensor_leaves(args))


def _output_kind(module: nn.Module, args: tuple, output: object) -> str | None:
    return kind(_invariant.tensor_leaves(output))


class _Probes:
    """The editors' functions: add a zero probe that needs grad to every float tensor going
    into and out of each module call, and keep the probes by path and call."""

    def __init__(self, model: nn.Module) -> None:
        self.paths = {id(m): p for p, m in _invariant.named_modules(model)}
        self.inputs: dict[str, list[list[torch.Tensor]]] = {}
        self.outputs: dict[str, list[list[torch.Tensor]]] = {}
        self.order: list[tuple[str, int]] = []  # (path, call) in call order

    @staticmethod
    def _probed(tree: _Tree) -> tuple[_Tree, list[torch.Tensor]]:
        probes: list[torch.Tensor] = []

        def add(t: object) -> object:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                probes.append(torch.zeros_like(t, requires_grad=True))
                return t + probes[-1]
            return t

        return _invariant.tree_map(add, tree), probes

    def before(self, module: nn.Module, args: tuple) -> tuple:
        path = self.paths[id(module)]
        new, probes = self._probed(args)
        calls = self.inputs.setdefault(path, [])
        self.order.append((path, len(calls)))
        calls.append(probes)
        return new

    def after(self, module: nn.Module, args: tuple, output: _Tree) -> _Tree:
        new, probes = self._probed(output)
        self.outputs.setdefault(self.paths[id(module)], []).append(probes)
        return new

    def all(self) -> list[torch.Tensor]:
        return [p for calls in (*self.inputs.values(), *self.outputs.values()) for probes in calls for p in probes]


class Flow:
    """One probed forward and backward pass: the Record of the observers, and the gradient
    of every probe and trainable parameter (None where no gradient arrived)."""

    def __init__(self, model: nn.Module, args: tuple, loss_fn: LossFn) -> None:
        self.model = model
        probes = _Probes(model)
        specs = [
            edit(_invariant.EVERY, probes.before, event="forward_pre", name="probe_inputs"),
            edit(_invariant.EVERY, probes.after, name="probe_outputs"),
            observe(_invariant.EVERY, _grad_enabled, event="forward_pre", name="grad_enabled"),
            observe(_invariant.EVERY, _input_kind, event="forward_pre", name="input_kind"),
            observe(_invariant.EVERY, _output_kind, name="output_kind"),
        ]
        with torch.enable_grad(), with_hooks(model, specs) as run:
            self.loss = loss_fn(model(*args))
        self.record: Record = run.record
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        wanted = probes.all() + [p for _, p in self.params]
        grads: list[torch.Tensor | None] = [None] * len(wanted)
        if isinstance(self.loss, torch.Tensor) and self.loss.requires_grad and wanted:
            grads = list(torch.autograd.grad(self.loss, wanted, allow_unused=True))
        by_id = {id(t): g for t, g in zip(wanted, grads)}
        self.order = probes.order
        self.out_grads = {p: [[by_id[id(t)] for t in call] for call in calls] for p, calls in probes.outputs.items()}
        self.in_grads = {p: [[by_id[id(t)] for t in call] for call in calls] for p, calls in probes.inputs.items()}
        self.param_grads = {n: by_id[id(p)] for n, p in self.params}

    def reached(self, path: str, call: int) -> bool:
        """Whether a non-zero gradient flows out of this call (into its output)."""
        grads = self.out_grads.get(path, [])
        return call < len(grads) and any(g is not None and bool((g != 0).any()) for g in grads[call])

    def passes_back(self, path: str, call: int) -> bool | None:
        """Whether this call passes a non-zero gradient to its float inputs (None: it has none)."""
        grads = self.in_grads.get(path, [])
        if call >= len(grads) or not grads[call]:
            return None
        return any(g is not None and bool((g != 0).any()) for g in grads[call])

    def grad_enabled(self, path: str) -> bool:
        return path in self.record and bool(self.record.calls(path, "grad_enabled")[0])

    def name(self, path: str) -> str:
        return _invariant.module_name(self.model, path)


def owner(name: str) -> str:
    """The path of the module that holds parameter `name`."""
    return name.rpartition(".")[0]


def ancestors(path: str) -> list[str]:
    """Enclosing module paths, nearest first, ending with the root ``""``."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]
