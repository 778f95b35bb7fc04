"""fastai's hook spellings as spec constructors: ``Hook``, ``Hooks``, ``hook_output``,
``hook_outputs``, with fastai's signatures and stored values.

fastai hooks are objects that register themselves; here each is a :class:`~funhooks.Spec`,
a value run by ``fh.with_hooks``: ``with fh.with_hooks(model, fh.hook_outputs(ms)) as h:``
gives ``h.stored`` in the order of `ms`, as fastai does.

Cost: none until the spec is run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

from torch import nn

from funhooks.errors import SpecError

from .selector import select
from .spec import Spec, check_bools, check_flags, check_fn, record_name

__all__ = ["Hook", "Hooks", "hook_output", "hook_outputs"]

_FASTAI_NAME = "stored"
"""The record name of a fastai ``Hook``/``Hooks`` whose function has no ``__name__``
(a ``functools.partial`` or a callable object): fastai takes any callable."""


def _modules_of(label: str, ms: object, arg: str = "ms") -> list[nn.Module]:
    """fastai iterates `ms`: a Sequential or ModuleList means its children."""
    mods: list[nn.Module] | None = None
    if not isinstance(ms, nn.Module) or hasattr(ms, "__iter__"):  # a Sequential or ModuleList: its children
        try:
            mods = list(cast(Iterable[nn.Module], ms))  # checked below
        except TypeError:
            mods = None
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise SpecError(
            f"{label}: `{arg}` is an iterable of modules (a list, Sequential or ModuleList), "
            f"got {type(ms).__name__}. Pass a list of the modules to hook."
        )
    return mods


def Hook(  # noqa: N802 - fastai's spelling
    m: nn.Module,
    hook_func: Callable[..., object],
    is_forward: bool = True,
    detach: bool = True,
    cpu: bool = False,
    gather: bool = False,
) -> Spec:
    """fastai's ``Hook`` as a spec: store ``hook_func(m, input, output)`` for module `m`
    (or ``hook_func(m, grad_input, grad_output)`` when ``is_forward=False``).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> tst_model = nn.Linear(5, 3)
        >>> with fh.with_hooks(tst_model, fh.Hook(tst_model, lambda m, i, o: o)) as h:
        ...     y = tst_model(torch.randn(4, 5))
        >>> torch.equal(h.stored[0], y)
        True
    """
    if not isinstance(m, nn.Module):
        raise SpecError(f"Hook: `m` is an nn.Module, got {type(m).__name__}. Pass the module to hook.")
    check_fn("Hook", hook_func, "hook_func")
    check_bools("Hook", is_forward=is_forward)
    flags = check_flags("Hook", detach=detach, cpu=cpu, gather=gather)
    name = record_name("Hook", hook_func, getattr(hook_func, "__name__", _FASTAI_NAME))
    return Spec(where=select(m), event="forward" if is_forward else "backward", role="call", name=name, fn=hook_func,
                label="Hook", **flags)


def Hooks(  # noqa: N802 - fastai's spelling
    ms: Iterable[nn.Module],
    hook_func: Callable[..., object],
    is_forward: bool = True,
    detach: bool = True,
    cpu: bool = False,
) -> Spec:
    """fastai's ``Hooks`` as a spec: :func:`Hook` on every module of `ms`.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> layers = [nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3)]
        >>> tst_model = nn.Sequential(*layers)
        >>> with fh.with_hooks(tst_model, fh.Hooks(layers, lambda m, i, o: o)) as h:
        ...     y = tst_model(torch.randn(4, 5))
        >>> len(h.stored), torch.equal(h.stored[2], y)
        (3, True)
    """
    mods = _modules_of("Hooks", ms)
    check_fn("Hooks", hook_func, "hook_func")
    check_bools("Hooks", is_forward=is_forward)
    flags = check_flags("Hooks", detach=detach, cpu=cpu)
    name = record_name("Hooks", hook_func, getattr(hook_func, "__name__", _FASTAI_NAME))
    return Spec(where=select(mods), event="forward" if is_forward else "backward", role="call", name=name,
                fn=hook_func, label="Hooks", **flags)


def hook_output(module: nn.Module, detach: bool = True, cpu: bool = False, grad: bool = False) -> Spec:
    """fastai's ``hook_output``: store `module`'s output, or with ``grad=True`` its
    ``grad_output`` tuple (record name ``"grad"``).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> tst_model = nn.Linear(5, 10)
        >>> with fh.with_hooks(tst_model, fh.hook_output(tst_model, grad=True)) as h:
        ...     y = tst_model(torch.randn(4, 5))
        ...     y.pow(2).mean().backward()
        >>> torch.allclose(h.stored[0][0], 2 * y / y.numel())
        True
    """
    if not isinstance(module, nn.Module):
        raise SpecError(
            f"hook_output: `module` is an nn.Module, got {type(module).__name__}. Pass the module to hook."
        )
    flags = check_flags("hook_output", detach=detach, cpu=cpu)
    check_bools("hook_output", grad=grad)
    if grad:
        return Spec(where=select(module), event="backward_pre", role="grad_output", name="grad", label="hook_output",
                    **flags)
    return Spec(where=select(module), event="forward", role="output", name="output", label="hook_output", **flags)


def hook_outputs(modules: Iterable[nn.Module], detach: bool = True, cpu: bool = False, grad: bool = False) -> Spec:
    """fastai's ``hook_outputs``: :func:`hook_output` on every module of `modules`.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> tst_model = nn.Sequential(nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3))
        >>> with fh.with_hooks(tst_model, fh.hook_outputs(tst_model)) as h:
        ...     y = tst_model(torch.randn(4, 5))
        >>> [tuple(s.shape) for s in h.stored]
        [(4, 10), (4, 10), (4, 3)]
    """
    mods = _modules_of("hook_outputs", modules, "modules")
    flags = check_flags("hook_outputs", detach=detach, cpu=cpu)
    check_bools("hook_outputs", grad=grad)
    if grad:
        return Spec(where=select(mods), event="backward_pre", role="grad_output", name="grad", label="hook_outputs",
                    **flags)
    return Spec(where=select(mods), event="forward", role="output", name="output", label="hook_outputs", **flags)
