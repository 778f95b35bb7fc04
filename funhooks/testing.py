"""Property-testing kit: Hypothesis strategies and invariant checks for your own models.

The same kit proves funhooks' own invariants in its test suite.
"""

from __future__ import annotations

from torch import nn

from . import run as _run

__all__ = ["assert_no_hooks"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def assert_no_hooks(model: nn.Module) -> None:
    """Assert that nothing is attached to `model`: no module or parameter hook of any
    origin, and no active funhooks run routing its modules.

    Raises:
        AssertionError: naming the module path and the kind of hook left behind.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> with fh.with_hooks(model, fh.grads("0")) as run:
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> fh.testing.assert_no_hooks(model)
    """
    for path, module in model.named_modules():
        where = repr(path) if path else "'' (the root)"
        for attr in _HOOK_DICTS:
            hooks = getattr(module, attr, None)
            if hooks:
                raise AssertionError(
                    f"assert_no_hooks: module {where} has {len(hooks)} hook(s) in `{attr}`, got "
                    f"{list(hooks.values())!r}. Remove them (exit every `with_hooks` block)."
                )
        for name, param in module.named_parameters(recurse=False):
            if getattr(param, "_backward_hooks", None):
                raise AssertionError(
                    f"assert_no_hooks: parameter {name!r} of module {where} has a gradient hook, got "
                    f"{list(param._backward_hooks.values())!r}. Remove it."
                )
        for frame in _run._STACK:
            if id(module) in frame.forward or id(module) in frame.forward_pre:
                raise AssertionError(
                    f"assert_no_hooks: an active funhooks run still routes module {where}, got a run "
                    "that was entered and not exited. Exit its `with` block."
                )
