"""The ``result`` standard point's hooks (see ``heads.py`` and NOTE [result is computed] there):
each head's output after the output projection, computed from the projection's input and its
weight by a hook on the projection. Private to ``fh.transformer``: ``standard.py`` makes the
point's specs with :func:`result_spec`, ``heads.py`` reads the weights with :func:`projection`.

Cost: one ``einsum`` per hooked call; an editor's results are summed back (one more).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from funhooks.errors import SpecError
from funhooks.specs.selector import Selector
from funhooks.specs.spec import Spec, check_flags, record_name

__all__ = ["projection", "result_spec"]

Tensor = torch.Tensor


def projection(module: nn.Module, role: str) -> tuple[Tensor, Tensor | None]:
    """A projection as ``x @ matrix + bias``: ``(matrix (d_in, d_out), bias (d_out,) or None)``,
    for an ``nn.Linear`` (``weight`` is ``(d_out, d_in)``) or transformers' ``Conv1D``
    (``weight`` is ``(d_in, d_out)``, GPT-2)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if isinstance(module, nn.Linear):
        return module.weight.T, module.bias
    if type(module).__name__ == "Conv1D" and isinstance(weight, Tensor) and weight.ndim == 2:
        return weight, bias if isinstance(bias, Tensor) else None
    raise SpecError(f"head_weights: the {role} is an `nn.Linear` or transformers' `Conv1D`, got a "
                    f"{type(module).__name__}. Register an architecture whose projections are one of them.")


def _results(module: nn.Module, z: Tensor, n_heads: int) -> Tensor:
    """Each head's output after the projection `module`: ``z`` ``(..., n_heads * d_head)`` split
    into heads, each times its rows of the projection's matrix: ``(..., n_heads, d_out)``."""
    matrix, _ = projection(module, "output projection")
    return torch.einsum("...hd,hdm->...hm", z.unflatten(-1, (n_heads, -1)), matrix.unflatten(0, (n_heads, -1)))


def _bias_of(module: nn.Module, like: Tensor) -> Tensor | float:
    _, bias = projection(module, "output projection")
    return 0.0 if bias is None else bias.to(like.dtype)


class _ReadResult:
    """The result point's read: a forward-pre hook's ``(module, args)`` on the output
    projection, its input split into heads times the module's weight. Its empty ``__name__``
    keeps the spec's repr that of the point."""

    __name__ = ""
    __slots__ = ("n_heads",)

    def __init__(self, n_heads: int) -> None:
        self.n_heads = n_heads

    def __call__(self, module: nn.Module, args: tuple) -> Tensor:
        return _results(module, args[0], self.n_heads)

    def __eq__(self, other: object) -> bool:
        return type(other) is _ReadResult and other.n_heads == self.n_heads

    def __hash__(self) -> int:
        return hash((_ReadResult, self.n_heads))


class _CallResult:
    """A user's ``fn(module, args, results)`` on the heads' results, called by a forward hook
    on the output projection; an editor's results, summed over heads plus the projection's
    bias, replace the projection's output. Named after `fn`."""

    __slots__ = ("__name__", "edits", "fn", "n_heads")

    def __init__(self, fn: Callable[..., object], n_heads: int, edits: bool) -> None:
        self.fn, self.n_heads, self.edits = fn, n_heads, edits
        self.__name__ = getattr(fn, "__name__", repr(fn))

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> Any:
        value = _results(module, args[0], self.n_heads)
        new: Any = self.fn(module, args, value)
        if not self.edits or new is None:
            return new
        if not isinstance(new, Tensor) or new.shape != value.shape:
            raise ValueError(f"an editor of `result` returns a tensor shaped like the heads' results, "
                             f"{tuple(value.shape)}, got {getattr(new, 'shape', type(new).__name__)}. Return one "
                             "of that shape (or None to leave it)")
        return (new.sum(-2) + _bias_of(module, new)).to(output.dtype)

    def __eq__(self, other: object) -> bool:
        return type(other) is _CallResult and (other.fn, other.n_heads, other.edits) == (
            self.fn, self.n_heads, self.edits)

    def __hash__(self) -> int:
        return hash((_CallResult, self.fn, self.n_heads, self.edits))


def result_spec(label: str, where: Selector, n_heads: int, shown: str, **options: Any) -> Spec:
    """The spec `label` makes for the ``result`` point shown as `shown` (see NOTE [result is computed])."""
    if label == "outputs":
        return Spec(where=where, event="forward_pre", role="call", name="output", fn=_ReadResult(n_heads),
                    label=label, **check_flags(label, **options))
    if label in ("observe", "edit"):
        fn, event, name = options.pop("fn"), options.pop("event"), options.pop("name")
        if event != "forward":
            raise SpecError(f"{label}: a standard point is a value of the forward pass, seen with "
                            f"`event=\"forward\"`, got event={event!r} with `{shown}`. Leave `event` out.")
        call = _CallResult(fn, n_heads, label == "edit")
        if label == "edit":
            return Spec(where=where, event="forward", role="call", name=name, fn=call, is_edit=True, label="edit")
        return Spec(where=where, event="forward", role="call", name=record_name("observe", fn, name), fn=call,
                    label="observe", **check_flags("observe", **options))
    if label == "grads":
        raise SpecError(f"grads: `result` is computed from `z` and the output projection's weight, not a tensor of "
                        f"the model's forward, so no gradient of it is watched, got `{shown}`. Take "
                        f"`fh.grads(pts.attn_out)`: every head's result has the gradient of `attn_out`.")
    instead = _STEER if label == "steer" else _BY_Z.format(label.capitalize())
    raise SpecError(f"{label}: `result` is computed from `z` and the output projection's weight, not a value the "
                    f"model holds, so {label} cannot edit it in place, got `{shown}`. {instead}, or edit the results "
                    "with `fh.edit(pts.result, fn)`.")


_BY_Z = ("{} `pts.z` instead (a head's result is its `z` times `W_O`: patching, scaling or zero-ablating z's head "
         "does the same to its result), steer `pts.attn_out` (a vector added to one head's result is added to "
         "`attn_out`)")
_STEER = "Steer `pts.attn_out` instead (a vector added to one head's result is added to `attn_out`)"
