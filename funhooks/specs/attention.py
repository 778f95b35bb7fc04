"""Attention patterns and scores as op values, whatever attention implementation a model uses.

``fh.attention_pattern`` (the softmax probabilities, ``(batch, head, query, key)``) and
``fh.attention_scores`` (the scaled ``q·kᵀ`` plus the mask, before the softmax) go wherever an
op goes: ``fh.op_outputs(where, fh.attention_pattern)``, ``fh.op_edit``, ``fh.patch(...,
op=fh.attention_pattern)``. Each is one value per attention call inside the selected module:

- under eager attention (Hugging Face's ``eager_attention_forward``), the ``softmax`` call:
  its output is the pattern, its input the scores (eager adds the mask before the softmax,
  as the dtype's minimum rather than ``-inf``);
- under SDPA (``torch.nn.functional.scaled_dot_product_attention``), computed from the
  ``query``, ``key``, ``attn_mask``, ``is_causal``, ``scale`` and ``enable_gqa`` the call
  receives: causal and padding masks (boolean, or additive floats), and grouped-query keys
  (repeated per query head) handled; scores are ``-inf`` where masked, and a query that sees
  no key (a padding position of a left-padded batch) gets a pattern row of 0, as SDPA's output
  is 0 there (eager's ``softmax`` spreads such a row over the keys).

**An SDPA call whose pattern or scores a run reads or edits runs as eager attention**: the
(edited) scores, their softmax, the (edited) pattern, its dropout when the call has
``dropout_p > 0``, then ``pattern @ value`` is the call's output, in place of SDPA's fused
kernel, so the pattern costs what eager attention costs, not eager attention's work beside
SDPA's. That output is eager attention's (bit for bit on a float32 CPU forward of Hugging
Face's GPT-2, Llama, NeoX and BERT under transformers 5, the padding rows above aside): it differs from SDPA's own by
float rounding (about 1e-7 of the values in float32), so a forward that records a pattern
under SDPA gives what the model loaded with ``attn_implementation="eager"`` gives, not
exactly what a bare SDPA forward gives. Calls no such spec takes (other modules, the same
module called from another thread) are SDPA's own.

Under any other implementation (flex, flash) no such call is made, and the run's "op spec
matched nothing" error says to load the model with ``attn_implementation="eager"`` or
``"sdpa"``. A single-token decode step of a grouped-query Hugging Face model (which packs the
query heads of a key head into the query axis before SDPA) is read as it is packed.

**A run that only records patterns needs no op mode** on a Hugging Face attention module
(``eager_weights``): such a module returns ``(output, weights)`` and, under eager attention in
eval mode, the weights are the pattern. So the call is run as eager attention (as it is under
eager; under SDPA the same forward on a twin of the module, made for the call, whose config
says eager) and the pattern taken from its output: the same values and the same output as
above, without watching the 30-odd torch functions the attention calls. Editing a pattern,
reading the scores, train mode, a query that sees no key, or a module someone else wrapped
take the op mode as described.

Cost: a recorded pattern on a Hugging Face attention module, what eager attention costs plus a
stored value (and under SDPA the mask in eager's form); otherwise, under eager, what
``fh.op_outputs(where, "softmax")`` costs, and under SDPA, eager attention's work (scores,
softmax, ``pattern @ value``) in place of SDPA's kernel, plus the causal mask where the call asks
for one, both inside the op mode of the selected module (one Python ``__torch_function__`` per
torch function it calls, about 0.2 of a small model's forward; see docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch

from funhooks import _frozen

from . import eager_weights
from .ops import At, Derived, Reading

__all__ = ["attention_pattern", "attention_scores"]

_SCORES, _PATTERN = "attention_scores", "attention_pattern"
"""The names of the two points, and of their values in a Record."""
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _always_deep(deep: bool) -> bool:
    """An attention op is deep whatever `as_op` passes: the call is the attention's, at any depth."""
    return True


@_frozen.frozen
@attrs.frozen(repr=False)
class _AttentionOp(Derived):
    """An attention point (``name``: ``attention_pattern`` or ``attention_scores``) of every
    attention call, eager (``softmax``) or SDPA (``scaled_dot_product_attention``).

    An attention call is taken wherever it runs inside the selected module: always ``deep``,
    so the module a family calls "the attention" (BERT's ``attention``, whose
    ``attention.self`` makes the call) and the module making the call both work, and
    ``call=k`` counts the attention calls under the module.

    Example:
        >>> import funhooks as fh
        >>> fh.attention_pattern, fh.op(fh.attention_scores, call=1)
        (fh.attention_pattern, fh.op(fh.attention_scores, call=1))
        >>> fh.op(fh.attention_scores, call=1).deep
        True
    """

    deep: bool = attrs.field(default=True, converter=_always_deep)

    def __repr__(self) -> str:
        return f"fh.op(fh.{self.name}, call={self.call})" if self.call is not None else f"fh.{self.name}"

    READS: ClassVar[tuple[str, ...]] = ("softmax", "scaled_dot_product_attention")
    HINT: ClassVar[str] = (
        "An attention pattern is read off eager attention's `softmax` or computed from "
        "`scaled_dot_product_attention`: load the model with `attn_implementation=\"eager\"` or `\"sdpa\"` "
        "(or call `model.set_attn_implementation(\"sdpa\")`), or select the module that calls it"
    )

    def run(self, op: str, func: Callable[..., Any], args: tuple, kwargs: dict, at: At) -> Any:
        """The attention call `func(*args, **kwargs)` with its scores and pattern handed to `at`."""
        if op == "softmax":
            return _eager(func, args, kwargs, at)
        return _sdpa(func, args, kwargs, at)

    def in_output(self, cls: type) -> bool:
        """The pattern, for Hugging Face's attention modules, which return it (``eager_weights``)."""
        return self.name == _PATTERN and eager_weights.attention_class(cls)

    def reading(self, module: Any, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Reading:
        """A pattern is read off a Hugging Face attention module's output, the call run as
        eager attention (``eager_weights``), where that holds."""
        return eager_weights.reading(module, inner, args, kwargs) if self.name == _PATTERN else Reading.OPS

    def read(self, reading: Reading, module: Any, inner: Callable[..., Any], args: tuple, kwargs: dict,
             shared: dict) -> tuple[Any, Any]:
        """The call run as eager attention: its output and its pattern (``eager_weights``)."""
        return eager_weights.read(reading, module, inner, args, kwargs, shared)


def _eager(func: Callable[..., Any], args: tuple, kwargs: dict, at: At) -> Any:
    """Eager attention's softmax: its input is the scores, its output the pattern."""
    if args:
        scores = args[0]
        new = at(_SCORES, scores)
        if new is not scores:
            args = (new, *args[1:])
    else:
        scores = kwargs["input"]
        new = at(_SCORES, scores)
        if new is not scores:
            kwargs = {**kwargs, "input": new}
    return at(_PATTERN, func(*args, **kwargs))


def _bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    """SDPA's arguments by name."""
    return {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)), **kwargs}


def _heads(t: torch.Tensor, query: torch.Tensor, gqa: bool) -> torch.Tensor:
    """Key or value heads repeated to the query's (``enable_gqa``: each key head serves a run
    of consecutive query heads)."""
    if not gqa or t.size(-3) == query.size(-3):
        return t
    return t.repeat_interleave(query.size(-3) // t.size(-3), dim=-3)


def _scores(a: dict[str, Any]) -> tuple[torch.Tensor, bool]:
    """SDPA's pre-softmax scores (``-inf`` where masked), and whether a mask may hide every key
    of a query (a causal one never does: query i sees key 0)."""
    query, mask = a["query"], a["attn_mask"]
    key = _heads(a["key"], query, a["enable_gqa"])
    scale = 1 / math.sqrt(query.size(-1)) if a["scale"] is None else a["scale"]
    scores = torch.matmul(query, key.transpose(-2, -1)).mul_(scale)  # in place: a fresh tensor, one pass fewer
    if a["is_causal"]:
        n, m = scores.shape[-2:]
        scores.masked_fill_(torch.ones(n, m, dtype=torch.bool, device=scores.device).triu_(1), -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    return scores, mask is not None


def _sdpa(func: Callable[..., Any], args: tuple, kwargs: dict, at: At) -> Any:
    """An SDPA call run as eager attention: scores -> softmax -> pattern -> ``pattern @
    value``, each point handed to `at` (SDPA's own kernel, `func`, is not run: its output would
    be this one to rounding, at the cost of the attention computed twice)."""
    a = _bind(args, kwargs)
    scores, masked = _scores(a)
    scores = at(_SCORES, scores)
    dtype = a["query"].dtype
    pattern = torch.softmax(scores, -1) if dtype == torch.float32 else torch.softmax(
        scores, -1, dtype=torch.float32).to(dtype)
    if masked:  # a query that sees no key: SDPA gives it zeros, softmax NaNs
        pattern = pattern.nan_to_num(0.0)
    pattern = at(_PATTERN, pattern)
    if a["dropout_p"] > 0:
        pattern = torch.nn.functional.dropout(pattern, a["dropout_p"])
    value = _heads(a["value"], a["query"], a["enable_gqa"])
    return torch.matmul(pattern.to(value.dtype), value)


attention_pattern = _AttentionOp(_PATTERN)
"""The attention pattern of each attention call: softmax probabilities, ``(batch, head, query, key)``.

Example:
    >>> import torch, funhooks as fh
    >>> from torch import nn
    >>> class Attention(nn.Module):
    ...     def forward(self, q, k, v):
    ...         return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> attn, q = Attention(), torch.ones(1, 2, 3, 4)
    >>> with fh.with_hooks(attn, fh.op_outputs("", fh.attention_pattern)) as run:
    ...     y = attn(q, q, q)
    >>> run.record[""]["attention_pattern"][0, 0]       # causal: row i sees keys 0..i
    tensor([[1.0000, 0.0000, 0.0000],
            [0.5000, 0.5000, 0.0000],
            [0.3333, 0.3333, 0.3333]])
"""

attention_scores = _AttentionOp(_SCORES)
"""The pre-softmax scores of each attention call: ``scale * q·kᵀ`` plus the mask, ``(batch,
head, query, key)``; ``-inf`` where SDPA masks, the mask's own value under eager attention."""
