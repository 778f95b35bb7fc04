"""assert_no_hooks: nothing of funhooks (or, unless asked, of anyone) left attached to a model.

funhooks registers no module hook; a run wraps the hooked modules' forward and sets hooks
on watched tensors only while its block is open. What another library keeps on purpose (HF
output-capturing hooks, FSDP's own) is named by its owner and can be left out.

Cost: one walk over the modules and their parameters and buffers."""

from __future__ import annotations

import os
from collections.abc import Callable

from torch import nn

from funhooks import _torch
from funhooks.errors import SpecError
from funhooks.runs.introspect import is_run_forward
from funhooks.specs.selector import path_label

__all__ = ["assert_no_hooks"]

# -- hooks left behind -----------------------------------------------------------------------

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")

_Hook = Callable[..., object]
"""A hook as torch keeps it: a function, a bound method, a ``functools.partial``..."""


def _function(hook: _Hook) -> _Hook:
    """The plain function behind a hook (bound methods and partials looked through)."""
    while True:
        inner = getattr(hook, "__func__", None) or getattr(hook, "func", None)
        if inner is None or inner is hook:
            return hook
        hook = inner


def _owner(hook: _Hook) -> str:
    fn = _function(hook)
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{getattr(fn, '__qualname__', type(fn).__name__)}"


_PACKAGE = os.path.dirname(os.path.abspath(_torch.__file__))  # the funhooks package folder


def _is_funhooks(hook: _Hook) -> bool:
    """Whether the hook's code lives in this package (not: whose module name it claims)."""
    code = getattr(_function(hook), "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_PACKAGE + os.sep)


def _left(where: str, what: str, hooks: list[_Hook], funhooks_only: bool) -> None:
    """Raise for the hooks in `what`: funhooks' own always, others' unless `funhooks_only`."""
    ours = [h for h in hooks if _is_funhooks(h)]
    if ours:
        raise AssertionError(
            f"assert_no_hooks: {where} has {len(ours)} funhooks hook(s) in `{what}`, got {ours!r}. Exit every "
            "`with_hooks` block and close every `train`/`evaluate` generator."
        )
    if hooks and not funhooks_only:
        owners = sorted({_owner(h) for h in hooks})
        raise AssertionError(
            f"assert_no_hooks: {where} has {len(hooks)} hook(s) in `{what}` installed by {owners}, not by funhooks, "
            f"got {hooks!r}. Remove them, or pass `funhooks_only=True` to check only what funhooks attaches."
        )


def assert_no_hooks(model: nn.Module, *, funhooks_only: bool = False) -> None:
    """Assert that nothing is attached to `model`: no module, parameter or buffer hook, and no
    ``forward`` still wrapped by a funhooks run.

    funhooks itself registers no module hook; a run wraps the hooked modules' ``forward`` and
    sets hooks on watched tensors only while its block is open. Other libraries keep hooks on
    purpose (HF ``transformers`` installs output-capturing hooks after an
    ``output_hidden_states=True`` call): the message names their owner, and
    ``funhooks_only=True`` checks only what funhooks attaches. The hooks FSDP2's
    ``fully_shard`` puts on the modules it shards are part of the sharded model, as its class
    is, and are never counted; the unsharded parameters it all-gathers for a forward are
    checked with the module's own tensors.

    Args:
        model: the model to inspect (DDP / ``torch.compile`` wrappers included).
        funhooks_only: ignore hooks whose function is not funhooks'.

    Raises:
        AssertionError: naming the module path, what is left and who left it.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> with fh.with_hooks(model, fh.grads("0")) as run:
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> fh.testing.assert_no_hooks(model)
        >>> handle = model[0].register_forward_hook(lambda m, i, o: None)
        >>> fh.testing.assert_no_hooks(model, funhooks_only=True)
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise SpecError(f"assert_no_hooks: `model` is an nn.Module, got {type(model).__name__}. Pass the model.")
    for path, module in model.named_modules(remove_duplicate=False):
        where = f"module {path_label(path)}"
        for attr in ("forward", "_call_impl"):
            wrapped = module.__dict__.get(attr)
            if is_run_forward(wrapped):
                raise AssertionError(
                    f"assert_no_hooks: {where} still has its `{attr}` wrapped by funhooks, got {wrapped!r} with "
                    f"{len(wrapped.current_users())} active run(s). Exit every `with_hooks` block and close every "
                    "`train`/`evaluate` generator."
                )
        reducer = module.__dict__.get("__reduce_ex__")
        if is_run_forward(getattr(reducer, "__self__", None)):
            raise AssertionError(
                f"assert_no_hooks: {where} still has a `__reduce_ex__` set by a funhooks run, got {reducer!r}. "
                "Exit every `with_hooks` block."
            )
        fsdp = _torch.is_fsdp_module(module)
        for attr in _HOOK_DICTS:
            hooks = list(getattr(module, attr, {}).values())
            _left(where, attr, [h for h in hooks if not _torch.is_fsdp_hook(h)] if fsdp else hooks, funhooks_only)
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if fsdp:
            tensors += [(f"{path} (unsharded by FSDP)", t) for path, _, t in _torch.fsdp_parameters(module) if t is not None]
        for name, tensor in tensors:
            for attr in _TENSOR_HOOK_DICTS:
                _left(f"tensor {name!r} of {where}", attr, list((getattr(tensor, attr, None) or {}).values()),
                      funhooks_only)
