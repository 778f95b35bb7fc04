"""A Hugging Face attention module's pattern read off its own output: no op mode on the call.

Since transformers 4.48 an attention module of Hugging Face's (``GPT2Attention``,
``LlamaAttention``, ``GPTNeoXAttention`` ...) picks its attention function on each call from
``self.config._attn_implementation`` and returns ``(attn_output, attn_weights)``; under eager
attention the weights are the softmax probabilities, after a dropout that is off in eval mode.
So a run that only *records* such a module's pattern (``fh.outputs(pts.pattern)``,
``fh.op_outputs(attn, fh.attention_pattern)``) need not watch the torch functions the module
calls through an op mode (one Python ``__torch_function__`` for each of its 30-odd views,
transposes and matmuls, about 0.2 of a small model's forward): it runs the call eagerly and
takes the weights from its output.

- under eager attention: the module's own call, as it is;
- under SDPA: the same forward run on a *twin* of the module, made for this call alone: an
  instance of the module's class sharing its ``__dict__``'s entries (so its parameters,
  submodules and hooks), whose ``config`` answers ``"eager"`` for ``_attn_implementation``
  and everything else from the model's config; the attention mask Hugging Face built for
  SDPA (``None`` for an unpadded causal batch, which SDPA runs as ``is_causal``; or boolean,
  True where a query sees a key) is handed over in eager attention's form (additive: 0 where
  seen, the dtype's minimum where not). The call's output is then eager attention's, the one
  the model loaded with ``attn_implementation="eager"`` gives, as when the op mode runs an
  SDPA call whose pattern is read as eager attention (``attention``). Nothing is set on the
  module, its config or the process: the same module called meanwhile from another thread
  (or by a run that does not read its pattern) runs SDPA as usual.

Only where that is known to hold: the module is in eval mode; its config names ``"eager"``
or ``"sdpa"``; its class's forward reads ``_attn_implementation`` (transformers' attention
interface); the call goes to that forward (no other wrapper in between); under SDPA the mask
comes by keyword, as Hugging Face's layers pass it, and every query sees some key. Where a
query sees none (a padding position of a left-padded batch), SDPA's output there is 0 and so
is its pattern row, while eager's softmax spreads the row over the keys: such a call goes
through the op mode, which keeps SDPA's zeros (``attention``); telling costs one reduction of
the boolean mask and, on a GPU, a wait for it (inside a ``torch.func`` transform, where a
value cannot be read, a boolean mask always takes the op mode). A checkpointed block's call
handed a cache and no mask takes the op mode too (see ``_checkpointed``: its recomputation
must save what its first pass saved). Any other call, and every call that edits
a pattern or reads the scores, goes through the op mode as before.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import SelectorError

from .ops import Reading

__all__ = ["attention_class", "read", "reading"]

_EAGER, _SDPA = "eager", "sdpa"
_MASK, _HIDDEN = "attention_mask", "hidden_states"
_CACHES = ("cache", "past_key_values", "past_key_value")
"""The names Hugging Face's attention modules take their cache by (transformers 5.24, 5.x, 4.x)."""


class _EagerConfig:
    """A model config as one call of a twin reads it: ``_attn_implementation`` is ``"eager"``,
    every other attribute the config's own."""

    __slots__ = ("_config",)
    _attn_implementation = _EAGER

    def __init__(self, config: object) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def attention_class(cls: type) -> bool:
    """Whether `cls` is a Hugging Face attention module's class that picks its attention per
    call: its forward reads ``_attn_implementation`` (decided when a plan is made)."""
    forward = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(forward) if callable(forward) else None, "__code__", None)
    return code is not None and "_attn_implementation" in code.co_names


def reading(module: nn.Module, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Reading:
    """How the call ``inner(*args, **kwargs)`` of `module` gives its pattern: off its output as
    called (eager attention), off a twin's (SDPA), or through the op mode (see the module's
    docstring); `module`'s class is one :func:`attention_class` accepts."""
    if module.training:
        return Reading.OPS
    implementation = getattr(module.__dict__.get("config"), "_attn_implementation", None)
    if implementation != _EAGER and implementation != _SDPA:
        return Reading.OPS
    if getattr(inner, "__self__", None) is not module or getattr(inner, "__func__", None) is not type(module).forward:
        return Reading.OPS
    if implementation == _EAGER:
        return Reading.OUTPUT
    mask, hidden = kwargs.get(_MASK), _hidden(args, kwargs)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return Reading.OPS
    if mask is None:  # SDPA's `is_causal` (keys = queries, says Hugging Face), unless a cache lies
        return Reading.OPS if hidden.size(-2) > 1 and _cache(kwargs) is not None and _checkpointed() \
            else Reading.TWIN
    if not isinstance(mask, torch.Tensor):
        return Reading.OPS
    if mask.dtype == torch.bool and (_torch.peek_transform() is not None or not bool(mask.any(-1).all())):
        return Reading.OPS  # a query that sees no key (its pattern row is 0, as SDPA's output), or can't tell
    return Reading.TWIN


class _Causal:
    """The additive causal mask a run's calls share (every layer of a forward asks for the
    same one): the last one made, for one shape, dtype and device. Kept in the run's
    ``shared`` dict, so it lives as long as the run and no longer."""

    __slots__ = ("key", "mask")

    def __init__(self, key: tuple, mask: torch.Tensor) -> None:
        self.key, self.mask = key, mask


def _causal(n: int, keys: int, dtype: torch.dtype, device: torch.device, shared: dict) -> torch.Tensor:
    """The additive causal mask of `n` queries and `keys` keys, ``(1, 1, n, keys)``, as SDPA's
    ``is_causal`` has it: 0 where query i sees key j <= i, the dtype's minimum elsewhere (what
    Hugging Face builds for an eager model, where the keys are the queries)."""
    key = (n, keys, dtype, device)
    last = shared.get(_Causal)
    if last is None or last.key != key:
        last = shared[_Causal] = _Causal(key, torch.full((1, 1, n, keys), torch.finfo(dtype).min, dtype=dtype,
                                                         device=device).triu_(1))
    return last.mask


def _hidden(args: tuple, kwargs: dict) -> object:
    """The hidden states a call is handed: its one positional argument, or by keyword."""
    return args[0] if len(args) == 1 else kwargs.get(_HIDDEN) if not args else None


def _cache(kwargs: dict) -> object:
    """The cache a call is handed (Hugging Face's ``Cache``), None without one."""
    for name in _CACHES:
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def _checkpointed() -> bool:
    """Whether the call may be a checkpointed block's: autograd records, and saved-tensor
    hooks are in force (a non-reentrant checkpoint's first pass) or a backward pass runs (its
    recomputation). Such a call with a cache and no mask goes through the op mode in both
    passes: recomputed with ``use_cache=True``, the block finds the cache its first pass
    filled, so its keys outnumber its queries (the eager model itself fails there); the op
    mode does what SDPA does with them, and both passes save the same tensors, which
    checkpoint checks. A plain forward with gradients (not checkpointed) reads off the twin."""
    return torch.is_grad_enabled() and (_torch.saving_hooks_active() or _torch.in_backward())


def _past(module: nn.Module, kwargs: dict) -> int:
    """How many keys the call's cache holds before it (Hugging Face's ``Cache``; 0 without one).
    Hugging Face asks SDPA for ``is_causal`` only where the keys are the queries, but a cache
    updated twice (a checkpointed block recomputed with ``use_cache=True``) adds keys, and
    SDPA's ``is_causal`` then lets query i see keys 0..i of them."""
    length = getattr(_cache(kwargs), "get_seq_length", None)
    return 0 if length is None else int(length(getattr(module, "layer_idx", None) or 0))


def _eager_mask(module: nn.Module, mask: torch.Tensor | None, hidden: torch.Tensor, kwargs: dict,
                shared: dict) -> torch.Tensor | None:
    """SDPA's mask in eager attention's form: additive, 0 where a query sees a key and the
    dtype's minimum where not (what Hugging Face builds for an eager model); ``None`` with a
    causal module and more than one query is SDPA's ``is_causal``."""
    dtype = hidden.dtype if hidden.is_floating_point() else torch.float32
    if mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        n = hidden.size(-2)
        if not causal or n == 1:
            return None
        return _causal(n, n + _past(module, kwargs), dtype, hidden.device, shared)
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _twin(module: nn.Module) -> nn.Module:
    """An instance of `module`'s class for one call: the module's attributes (parameters,
    submodules and hooks shared), with a config that says eager attention."""
    twin = object.__new__(type(module))
    state = twin.__dict__
    state.update(module.__dict__)
    state["config"] = _EagerConfig(state["config"])
    return twin


def _weights(module: nn.Module, output: object) -> torch.Tensor:
    weights = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
    if not isinstance(weights, torch.Tensor):
        raise SelectorError(
            f"fh.attention_pattern: {type(module).__name__} picks its attention by `config._attn_implementation` "
            f"but did not return the attention weights as its second output under eager attention (got "
            f"{type(weights).__name__}). Read the pattern with `fh.op_outputs(<its path>, \"softmax\")`, or report "
            "the model's class to funhooks."
        )
    return weights


def read(reading: Reading, module: nn.Module, inner: Callable[..., Any], args: tuple, kwargs: dict,
         shared: dict) -> tuple[object, torch.Tensor]:
    """The call run as eager attention, the way `reading` (``OUTPUT`` or ``TWIN``) says: its
    output, and its pattern. `shared`: what the run's calls share (the causal mask)."""
    if reading is Reading.OUTPUT:
        output = inner(*args, **kwargs)
        return output, _weights(module, output)
    hidden = cast(torch.Tensor, _hidden(args, kwargs))
    kwargs = {**kwargs, _MASK: _eager_mask(module, kwargs.get(_MASK), hidden, kwargs, shared)}
    output = type(module).forward(_twin(module), *args, **kwargs)
    return output, _weights(module, output)
