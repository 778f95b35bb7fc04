"""What entries store: a value and its in-place check (version counters; inference tensors as
copies), the copies stored inside compiled graphs and transforms, and the transforms a spec's
flags ask for (detach, gather, cpu, clone).

Cost: a version read per stored tensor; a flagged transform per tensor it applies to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from funhooks import _torch
from funhooks.distributed import is_distributed
from funhooks.specs.spec import Spec

from .frame import Frame
from .types import Check, Key

__all__ = ["COPIES", "Copy", "Prep", "copied_inputs", "copied_output", "copier", "copies_of", "preparer", "snapshot",
           "unchecked"]

_V = TypeVar("_V")
_SCALARS = (bool, int, float, complex, str)
_tracing = _torch.jit_tracing

Copy = Callable[[Tensor], Tensor]
"""One of :data:`COPIES`."""


class Prep(Protocol):
    """A spec's per-tensor transform applied to a value: every tensor in it transformed, the
    structure kept (see :func:`preparer`)."""

    def __call__(self, value: _V, /) -> _V: ...


# -- stored values ----------------------------------------------------------------------------


def _own_copy(t: Tensor) -> Tensor:
    return t.clone() if t.is_inference() else t


def snapshot(value: object) -> tuple[object, Check]:
    """`value`, and what the Record needs to tell later whether it was changed in place.

    Inference tensors (made under ``torch.inference_mode``) keep no version counter, so the
    change could never be seen: they are stored as copies, which no later op can change.
    """
    if isinstance(value, Tensor):
        try:
            return value, value._version
        except RuntimeError:  # an inference tensor
            return value.clone(), None
    if value is None or isinstance(value, _SCALARS):
        return value, None
    return _snapshot_tree(value)


def _snapshot_tree(value: object) -> tuple[object, Check]:
    """:func:`snapshot` of a structure: ``(tensor, version)`` for each tensor in it."""
    tensors = value if type(value) is tuple and all(isinstance(t, Tensor) for t in value) else _torch.tensor_leaves(value)
    if not tensors:
        return value, None
    try:
        return value, tuple([(t, t._version) for t in tensors])
    except RuntimeError:  # an inference tensor among them
        value = _torch.map_tensors(_own_copy, value)
        return value, tuple([(t, t._version) for t in _torch.tensor_leaves(value) if not t.is_inference()])


def unchecked(value: object) -> tuple[object, Check]:
    """For entries that store copies (inside compiled graphs and transforms): nothing can
    change a private copy, and a version read inside a dynamo trace becomes an op."""
    return value, None


def _copy(t: Tensor) -> Tensor:
    return t.clone()


def _copy_detached(t: Tensor) -> Tensor:
    return t.detach().clone()


def _copy_cpu(t: Tensor) -> Tensor:
    return t.cpu().clone()


def _copy_detached_cpu(t: Tensor) -> Tensor:
    return t.detach().cpu().clone()


COPIES = (_copy, _copy_detached, _copy_cpu, _copy_detached_cpu)
"""The copy a storing spec makes inside compiled graphs and transforms, at ``detach + 2 * cpu``:
plain module functions, so a dynamo trace guards one function, not a chain of closures."""


def copier(spec: Spec) -> int | None:
    """The index in :data:`COPIES` of the copy an `outputs`/`inputs` spec stores inside
    compiled graphs and transforms; None for every other spec (and for `gather`, which needs
    the full entry)."""
    if spec.role in ("output", "input") and not spec.gather:
        return spec.detach + 2 * spec.cpu
    return None


def copied_inputs(copy: Copy, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor in them copied by `copy` (one of :data:`COPIES`)."""
    return _torch.map_tensors(copy, (args, kwargs))


def copied_output(copy: Copy, output: object) -> object:
    """`output` (a tensor or a structure of them) copied by `copy` (one of :data:`COPIES`)."""
    return copy(output) if isinstance(output, Tensor) else _torch.map_tensors(copy, output)


def copies_of(spec: Spec, key: Key, pre: bool) -> Callable[..., None]:
    """A lean entry storing copies of the inputs (`pre`) or outputs, for `outputs`/`inputs`
    specs inside compiled graphs and transforms (what a dynamo trace reads is what it guards)."""
    copy = COPIES[spec.detach + 2 * spec.cpu]
    if pre:

        def store_input_copy(frame: Frame, module: nn.Module, args: tuple, kwargs: dict) -> None:
            frame.buffer.append((key, copied_inputs(copy, args, kwargs), None))

        return store_input_copy

    def store_output_copy(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        frame.buffer.append((key, copied_output(copy, output), None))

    return store_output_copy


def _gather(t: Tensor) -> Tensor:
    if _torch.is_dtensor(t):  # a shard (FSDP2's gradients): the full tensor it is part of
        return t.full_tensor()  # type: ignore[attr-defined]
    if not is_distributed():
        return t
    dist = torch.distributed
    if t.ndim == 0:
        t = t.clone()
        dist.all_reduce(t)
        return t / dist.get_world_size()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=0)


def _detached(t: Tensor) -> Tensor:
    """`t` without autograd history, as a store keeps it: a tensor that needs no gradient has
    none to cut, so it is passed as is (``detach()`` would only make an alias, at the cost of
    an op per tensor). Under ``torch.jit.trace`` no op is called: the tracer names a value after
    the variable of the frame that passes it to an op, and its check traces again without
    gradients, so a detach in one trace only would make the two graphs differ."""
    return t.detach() if t.requires_grad and not _tracing() else t


def _detach_only(value: Any) -> Any:
    """The :data:`Prep` of the default flags (`detach` alone), the common case: each tensor
    :func:`_detached`; a tensor, or a tuple of tensors (the usual `args`), that needs no
    gradient comes back as is, without a walk or a new tuple."""
    if isinstance(value, Tensor):
        return _detached(value)
    if type(value) is tuple and all(isinstance(x, Tensor) for x in value):  # the usual `args`
        return tuple([_detached(x) for x in value]) if any(x.requires_grad for x in value) else value
    return _torch.map_tensors(_detached, value)


class _Chain:
    """The :data:`Prep` of any other flags: each tensor through the flagged steps in turn."""

    __slots__ = ("steps",)

    def __init__(self, steps: tuple[Copy, ...]) -> None:
        self.steps = steps

    def tensor(self, t: Tensor) -> Tensor:
        for step in self.steps:
            t = step(t)
        return t

    def __call__(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            return self.tensor(value)
        if type(value) is tuple and all(isinstance(x, Tensor) for x in value):
            return tuple([self.tensor(x) for x in value])  # the usual `args`
        return _torch.map_tensors(self.tensor, value)


_STEPS: tuple[Copy, ...] = (_detached, _gather, Tensor.cpu, Tensor.clone)
"""The step of each flag, in the order they apply: detach, gather, cpu, clone."""


def preparer(spec: Spec) -> Prep | None:
    """The per-tensor transform a spec's flags ask for (detach, gather, cpu, clone), chosen
    once, when the plan is made: None for no flag, :func:`_detach_only` for the default flags,
    else a chain of the flagged steps."""
    flags = (spec.detach, spec.gather, spec.cpu, spec.clone)
    steps = tuple([step for on, step in zip(flags, _STEPS) if on])
    if not steps:
        return None
    return _detach_only if steps == (_detached,) else _Chain(steps)
