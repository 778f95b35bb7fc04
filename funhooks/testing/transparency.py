"""assert_transparent: observers change no output, gradient or buffer of a model.

Cost: the model runs twice (forward and backward), bare and with the specs, from the same
state; a copy of its gradients and buffers is kept."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import SpecError
from funhooks.runs.run import Run, as_specs, with_hooks
from funhooks.specs import Spec, outputs

from .leftovers import assert_no_hooks

__all__ = ["assert_transparent", "backward_all", "tensor_leaves"]

# -- transparency ----------------------------------------------------------------------------


def tensor_leaves(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in _torch.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical up to NaN payloads: same shape, dtype, device and values."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _leaf_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Fresh copies of the float tensors in ``(args, kwargs)``, made leaves that need grad."""
    leaves: list[torch.Tensor] = []

    def fresh(x: object) -> object:
        if isinstance(x, torch.Tensor):
            x = x.detach().clone()
            if x.is_floating_point():
                x.requires_grad_(True)
                leaves.append(x)
        return x

    new_args, new_kwargs = _torch.tree_map(fresh, (args, kwargs))
    return new_args, new_kwargs, leaves


def _one_pass(model: nn.Module, args: tuple, kwargs: dict, state: dict[str, torch.Tensor],
              run: Run | None) -> dict[str, list[torch.Tensor]]:
    """Forward and backward from `state`; what a user of the model can see afterwards."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.copy_(state[name])
    params = list(model.parameters())
    for p in params:
        p.grad = None
    args, kwargs, leaves = _leaf_inputs(args, kwargs)
    with contextlib.nullcontext() if run is None else run:
        out = model(*args, **kwargs)
        backward_all(out)
    outputs = [t.detach() for t in tensor_leaves(out)]
    return {
        "output": outputs,
        "input gradient": [x.grad if x.grad is not None else torch.zeros(0) for x in leaves],
        "parameter gradient": [p.grad if p.grad is not None else torch.zeros(0) for p in params],
        "buffer": [b.detach().clone() for b in model.buffers()],
    }


def backward_all(out: object) -> None:
    needs = [t for t in tensor_leaves(out) if t.requires_grad]
    if needs:
        torch.stack([t.float().sum() for t in needs]).sum().backward()


def assert_transparent(model: nn.Module, specs: Spec | Iterable[Spec], *args: object,
                       **kwargs: object) -> None:
    """Assert that running observer `specs` changes nothing the model computes.

    Runs ``model(*args, **kwargs)`` and a backward pass (of the sum of its float outputs)
    once bare and once inside ``with_hooks(model, specs)``, from the same parameters and
    buffers, and compares bit for bit: every output, the gradient of every float input,
    every parameter gradient and every buffer (BatchNorm statistics). Afterwards the model's
    state and gradients are as before and :func:`assert_no_hooks` holds. The model must be
    deterministic (on CUDA set ``torch.backends.cudnn.deterministic = True``).

    Args:
        model: the model.
        specs: observers (a Spec or an iterable of Specs); editors change values by design.
        *args, **kwargs: the model's inputs (float tensors are copied and made to need grad).

    Raises:
        SpecError: when `specs` holds an editor (``fh.edit``).
        AssertionError: naming what changed (output, input gradient, parameter gradient or
            buffer), its index and the largest difference.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
        >>> fh.testing.assert_transparent(model, [fh.outputs("**", clone=True), fh.grads("0")], torch.randn(2, 3))
    """
    spec_tuple = as_specs(specs, "assert_transparent")
    for s in spec_tuple:
        if s.is_edit:
            raise SpecError(
                f"assert_transparent: `specs` are observers, got the editor {s!r}. Editors change "
                "values by design; drop them, or compare the edited model yourself."
            )
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    grads_before = [p.grad for p in model.parameters()]
    try:
        bare = _one_pass(model, args, kwargs, state, None)
        hooked = _one_pass(model, args, kwargs, state, with_hooks(model, spec_tuple))
    finally:
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                t.copy_(state[name])
        for p, g in zip(model.parameters(), grads_before):
            p.grad = g
    for what, values in bare.items():
        other = hooked[what]
        if len(values) != len(other):
            raise AssertionError(
                f"assert_transparent: observers must change no {what}, got {len(other)} {what}(s) "
                f"with {spec_tuple!r} and {len(values)} without. Fix the observer's function."
            )
        for i, (a, b) in enumerate(zip(values, other)):
            if not _same(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
                raise AssertionError(
                    f"assert_transparent: observers must change no {what}, got {what} {i} changed "
                    f"(largest difference {diff}) by {spec_tuple!r}. An observer's function must not "
                    "modify its arguments in place; return a new value instead."
                )
    assert_no_hooks(model)
