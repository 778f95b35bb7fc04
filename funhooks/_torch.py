"""The one place that touches private or version-dependent torch APIs.

Everything else in funhooks imports these helpers instead of reaching into
``torch.utils._pytree``, ``torch._C._functorch`` or wrapper classes directly, so a change
in PyTorch is fixed here once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = [
    "is_functorch_active",
    "pytree",
    "register_pytree",
    "tree_leaves",
    "tree_map",
    "unwrap",
]

tree_map = pytree.tree_map
tree_leaves = pytree.tree_leaves

_WRAPPER_ATTRS = {"OptimizedModule": "_orig_mod"}


def _wrapper_attr(module: nn.Module) -> str | None:
    """The attribute holding the wrapped model, for DDP / DataParallel / torch.compile."""
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return "module"
    # OptimizedModule is matched by name: importing torch._dynamo costs about a second.
    return _WRAPPER_ATTRS.get(type(module).__name__)


def unwrap(module: nn.Module) -> nn.Module:
    """Strip DDP / DataParallel / ``torch.compile`` wrappers, however deeply nested."""
    attr = _wrapper_attr(module)
    while attr is not None:
        module = getattr(module, attr)
        attr = _wrapper_attr(module)
    return module


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` without wrapper modules or their prefixes.

    A shared module is yielded once, at its first path; wrappers (``module.`` of DDP,
    ``_orig_mod.`` of ``torch.compile``, also around submodules) never appear.
    """
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        path, module = stack.pop()
        module = unwrap(module)
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield path, module
        children = [(f"{path}.{n}" if path else n, c) for n, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))


COMPILED, REPLICATED = "compiled", "replicated"


def _wrapper_kind(module: nn.Module) -> str | None:
    """``COMPILED`` for a ``torch.compile`` wrapper, ``REPLICATED`` for ``nn.DataParallel``
    (whose replicas copy each module's ``__dict__``), else None (DDP included)."""
    if isinstance(module, nn.DataParallel):
        return REPLICATED
    return COMPILED if type(module).__name__ in _WRAPPER_ATTRS else None


def wrappers_in(model: nn.Module) -> frozenset[str]:
    """The kinds of wrapper anywhere in `model`'s tree (see ``_wrapper_kind``)."""
    return frozenset(kind for m in model.modules() if (kind := _wrapper_kind(m)) is not None)


def wrappers_around(model: nn.Module) -> frozenset[str]:
    """The kinds of wrapper in the chain of wrappers around `model` (cheap: no tree walk)."""
    kinds = set()
    while (attr := _wrapper_attr(model)) is not None:
        if (kind := _wrapper_kind(model)) is not None:
            kinds.add(kind)
        model = getattr(model, attr)
    return frozenset(kinds)


def reset_compiled() -> None:
    """Drop dynamo's compiled code so that the next call traces the hooks installed now."""
    torch.compiler.reset()


HAS_KEY_PATHS = "flatten_with_keys_fn" in inspect.signature(pytree.register_pytree_node).parameters
"""Whether this torch has pytree key paths (``tree_flatten_with_path``, ``keystr``; torch >= 2.3)."""


def register_pytree(cls: type, flatten: Callable, unflatten: Callable, name: str, *,
                    flatten_with_keys: Callable | None = None) -> None:
    """Register ``cls`` as a pytree node so ``torch.func`` transforms see its tensors.

    `flatten_with_keys` (``obj -> ([(key_entry, child), ...], context)``, the children and
    context of `flatten`) names each child for ``tree_flatten_with_path``,
    ``tree_map_with_path`` and ``keystr``; a torch without key paths registers without it.
    """
    keys = {"flatten_with_keys_fn": flatten_with_keys} if flatten_with_keys is not None and HAS_KEY_PATHS else {}
    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=name, **keys)


def is_functorch_active() -> bool:
    """True inside a ``torch.func`` transform (vmap, grad, jacrev, ...)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def is_distributed() -> bool:
    """True when a ``torch.distributed`` group with more than one process is initialised."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_compiling() -> bool:
    """True while dynamo traces the calling code."""
    return torch.compiler.is_compiling()
