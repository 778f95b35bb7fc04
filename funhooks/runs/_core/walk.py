"""Walking a model for a plan: its modules, wrappers looked through, and what a spec holds.

:func:`walk` lists a model's modules in ``named_modules()`` order (a shared module once),
looking through wrappers (``module.`` of DDP/DataParallel, ``_orig_mod.`` of
``torch.compile``), and keeps every children table it passed (so a plan can tell later whether
the structure changed). Modules under a wrapper or run by compiled code only are *placed*: the
compiled module whose code runs them, and the ``_modules`` keys traced code reaches them by.
:func:`holds_values` tells whether a spec holds a value of the user's, which no cache may keep
alive.

Cost: one tuple per module in the common case (no wrapper, nothing compiled); a few µs per
module in all.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Container, Iterable
from typing import NamedTuple

import attrs
import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import TransformError
from funhooks.specs.selector import path_label
from funhooks.specs.spec import Spec

__all__ = ["Walk", "holds_values", "keys_of", "reaches", "walk"]


class _Keys(NamedTuple):
    """How traced code reaches a module: the ``_modules`` keys from the model (wrappers' own
    included), and where in them the inner model of its ``torch.compile`` wrapper starts."""

    keys: tuple[str, ...]
    start: int


class _Placed(NamedTuple):
    """A module under a wrapper, or run by compiled code only: the ``torch.compile`` wrapper
    (or module compiled in place) whose compiled code runs it, None for none, and its keys."""

    owner: nn.Module | None
    keys: _Keys


_Table = tuple[dict, tuple, tuple]
"""A children table with children, its keys and its children, as they were."""


class Walk(NamedTuple):
    """What the walk of a model found (wrappers looked through)."""

    modules: list[tuple[str, nn.Module]]
    """``(path, module)`` in ``named_modules()`` order, a shared module once."""
    placed: dict[int, _Placed]
    """By module id, the modules under a wrapper or run by compiled code only. Any other
    module has no owner, and its path's segments as its keys (:func:`keys_of`)."""
    full: list[_Table]
    """Every children table with children (to tell later whether the structure changed)."""
    empty: list[dict]
    """Every children table that is empty."""


def walk(model: nn.Module, caller: str) -> Walk:
    """The modules of `model` in ``named_modules()`` order, wrappers looked through and a
    shared module once; with the children of every module seen. One tuple per module in the
    common case: a module is placed only under a wrapper or a compiled module (a big model is
    walked without making many small objects)."""
    found = Walk([], {}, [], [])
    seen: set[int] = set()
    wrappers: dict[type, bool] = {}  # by type: whether it is a wrapper (DDP, torch.compile)
    # (path, module, where it is placed, None in the common case: no owner, its path's segments as its keys)
    stack: list[tuple[str, nn.Module, _Placed | None]] = [("", model, None)]
    while stack:
        path, module, placed = stack.pop()
        kind = type(module)
        wrapper = wrappers[kind] if kind in wrappers else wrappers.setdefault(kind, _torch.wrapper_attr(module) is not None)
        if wrapper:
            module, placed = _unwrap(path, module, placed, found.full, caller)
        if id(module) in seen:
            continue
        seen.add(id(module))
        if (placed is None or placed.owner is None) and _torch.compiled_in_place(module) is not None:
            keys = keys_of(path, placed).keys  # `module.compile()`: its compiled code runs what is below it
            placed = _Placed(module, _Keys(keys, len(keys)))
        if placed is not None:
            found.placed[id(module)] = placed
        found.modules.append((path, module))
        stack.extend(_children(path, module, placed, found))
    return found


def _children(path: str, module: nn.Module, placed: _Placed | None,
              found: Walk) -> list[tuple[str, nn.Module, _Placed | None]]:
    """What the walk visits below `module` (last first); its children table goes to `found`."""
    children = _torch.children(module)
    if not children:
        found.empty.append(children)
        return []
    found.full.append((children, tuple(children.keys()), tuple(children.values())))
    prefix = f"{path}." if path else ""
    if placed is None:
        return [(prefix + n, c, None) for n, c in reversed(children.items()) if c is not None]
    owner, (keys, start) = placed
    return [(prefix + n, c, _Placed(owner, _Keys((*keys, n), start)))
            for n, c in reversed(children.items()) if c is not None]


def keys_of(path: str, placed: _Placed | None) -> _Keys:
    """A module's keys: its path's segments unless the walk placed it (:attr:`Walk.placed`)."""
    if placed is not None:
        return placed.keys
    return _Keys(tuple(path.split(".")) if path else (), 0)


def _unwrap(path: str, module: nn.Module, placed: _Placed | None, full: list[_Table],
            caller: str) -> tuple[nn.Module, _Placed]:
    """The module inside the wrappers at `path` (DDP, DataParallel, ``torch.compile``), and
    where it is placed; the wrappers' children tables go to `full`."""
    owner = None if placed is None else placed.owner
    keys, start = keys_of(path, placed)
    while (attr := _torch.wrapper_attr(module)) is not None:
        if isinstance(module, nn.DataParallel) and len(module.device_ids or ()) > 1:
            raise TransformError(
                f"{caller}: `nn.DataParallel` runs replicas, new module objects no run can see, got one over "
                f"devices {module.device_ids} at {path_label(path)}. Use DistributedDataParallel, or DataParallel "
                "on one device."
            )
        keys = (*keys, attr)
        if owner is None and _torch.is_compile_wrapper(module):
            owner, start = module, len(keys)
        table = _torch.children(module)
        full.append((table, tuple(table.keys()), tuple(table.values())))
        module = getattr(module, attr)
    return module, _Placed(owner, _Keys(keys, start))


_LIMIT = 100_000
"""How many objects :func:`holds_values` visits before it gives up (and says yes)."""

_LEAVES = (str, bytes, int, float, complex, bool, type, types.ModuleType, type(None))


def holds_values(start: object, model: nn.Module, inside: Container[int]) -> bool:
    """Whether `start` holds a value of the user's that a cached plan would keep alive: a
    tensor (a patch value, a steering vector, a Record's values, a tensor a function closes
    over, the parameters of a probe outside the model), or the model itself (a function
    closing over the model would keep it alive for ever). Followed through closures, defaults,
    bound ``self``, partials, containers, object attributes and modules, except the modules
    `inside` the model (by id; what a plan keeps of them, it keeps anyway), and not globals,
    which live as long as their module anyway. Unsure (too many objects) counts as yes."""
    return _finds(start, inside, lambda obj: obj is model or isinstance(obj, torch.Tensor))


def reaches(start: object, model: nn.Module, inside: Container[int]) -> bool:
    """Whether `start` reaches the model itself, followed as :func:`holds_values` follows it
    (a plan kept by a spec of the user's must not keep the model alive as long as the spec)."""
    return _finds(start, inside, lambda obj: obj is model)


def _finds(start: object, inside: Container[int], found: Callable[[object], bool]) -> bool:
    seen: set[int] = set()
    stack = [start]
    while stack:
        obj = stack.pop()
        if found(obj):
            return True
        if id(obj) in seen or id(obj) in inside or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if len(seen) > _LIMIT:
            return True
        stack.extend(_parts(obj))
    return False


def _parts(obj: object) -> Iterable[object]:
    """What `obj` refers to, as :func:`holds_values` follows it."""
    if isinstance(obj, Spec):  # its fields, not its memo: what runs keep there is theirs
        return [getattr(obj, field.name) for field in attrs.fields(Spec) if field.eq]
    if isinstance(obj, nn.Module):
        return [*_torch.children(obj).values(), *_torch.own_parameters(obj).values(), *_torch.own_buffers(obj).values()]
    if isinstance(obj, types.FunctionType):
        return _function_parts(obj)
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, (tuple, list, set, frozenset)):
        return obj
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    return _attributes(obj)


def _function_parts(fn: types.FunctionType) -> list[object]:
    """What a function refers to, globals aside: its closure, defaults and ``__wrapped__``."""
    cells = [c.cell_contents for c in fn.__closure__ or () if c.cell_contents is not None]
    return [*cells, *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values(), getattr(fn, "__wrapped__", None)]


def _attributes(obj: object) -> list[object]:
    """An object's attributes: its ``__dict__`` and slots."""
    slots = [s for cls in type(obj).__mro__ for s in cls.__dict__.get("__slots__", ()) if isinstance(s, str)]
    return [*getattr(obj, "__dict__", {}).values(), *(getattr(obj, s, None) for s in slots)]
