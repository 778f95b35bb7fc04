"""Selectors: the one place where ``str | type | module | predicate | list`` is normalised.

A selector says *where* a spec applies. Every accepted form becomes a frozen, hashable
:class:`Selector` value that matches ``(path, module)`` pairs, combines with ``&``, ``|``
and ``~``, and resolves against a model in ``named_modules()`` order. Wrapper prefixes
(``module.`` of DDP/DataParallel, ``_orig_mod.`` of ``torch.compile``) never appear in
paths, so one selector works on the plain, wrapped and compiled model.

Cost: resolving walks the module tree once (a few microseconds per module); runs cache
the result per model and spec set.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable
from typing import Any, Union

import attrs
from torch import nn

from funhooks import _frozen, _torch
from funhooks.errors import SelectorError

__all__ = ["Selector", "select", "resolve", "Where", "path_label"]

Where = Union[str, type, tuple, nn.Module, Callable[[str, nn.Module], bool], list, "Selector"]

# a segment is a module name (anything PyTorch allows: no ".", not empty), `*` or `**`
_SEGMENT = re.compile(r"^[^.*]+$|^\*$|^\*\*$")


def _compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a path pattern into a regex over ``"." + path``.

    `*` is one path segment, `**` any number of segments (zero included); a pattern other
    than ``""`` never matches the root.
    """
    if pattern == "":
        return re.compile(r"^\.$")
    parts = pattern.split(".")
    bad = [p for p in parts if not _SEGMENT.match(p)]
    if bad:
        raise SelectorError(
            f"select: a path pattern is dot-separated names, `*` or `**`, got {pattern!r}. "
            f"Fix the segment(s) {bad!r}."
        )
    pieces = {"*": r"\.[^.]+", "**": r"(?:\.[^.]+)*"}
    return re.compile(r"^(?=\.[^.])" + "".join(pieces.get(p) or r"\." + re.escape(p) for p in parts) + "$")


@_frozen.frozen
@attrs.frozen(repr=False)
class Selector:
    """A frozen, hashable description of which modules a spec applies to.

    Build one with :func:`select`; combine with ``&`` (both), ``|`` (either), ``~`` (not).

    Example:
        >>> from torch import nn
        >>> import funhooks as fh
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 1)))
        >>> sel = fh.select(nn.Linear) & ~fh.select("2.**")
        >>> [path for path, _ in sel.resolve(model)]
        ['0']
    """

    kind: str  # "pattern" | "type" | "instance" | "instances" | "predicate" | "any" | "all" | "not"
    value: Any

    def matches(self, path: str, module: nn.Module) -> bool:
        """True when this selector picks the module at `path`."""
        kind, value = self.kind, self.value
        if kind == "pattern":
            return value[1].match("." + path) is not None
        if kind == "type":
            return isinstance(module, value)
        if kind == "instance":
            return module is value
        if kind == "instances":
            return id(module) in value[1]
        if kind == "predicate":
            return bool(value(path, module))
        if kind == "any":
            return any(s.matches(path, module) for s in value)
        if kind == "all":
            return all(s.matches(path, module) for s in value)
        return not value.matches(path, module)  # "not"

    def resolve(self, model: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
        """The ``(path, module)`` pairs of `model` this selector picks, in module order."""
        return tuple((p, m) for p, m in _torch.named_modules(model) if self.matches(p, m))

    def instances(self) -> tuple[nn.Module, ...]:
        """Module instances named anywhere in this selector (checked for membership)."""
        if self.kind == "instance":
            return (self.value,)
        if self.kind == "instances":
            return self.value[0]
        if self.kind in ("any", "all"):
            return tuple(m for s in self.value for m in s.instances())
        if self.kind == "not":
            return self.value.instances()
        return ()

    def given(self) -> tuple[nn.Module, ...] | None:
        """The modules of a selector that is a list of modules, in the list's order (fastai's
        ``Hooks(ms)`` keeps ``stored`` in that order); None for other selectors."""
        if self.kind == "instances":
            return self.value[0]
        return (self.value,) if self.kind == "instance" else None

    def __and__(self, other: Where) -> Selector:
        return Selector("all", (self, select(other)))

    def __or__(self, other: Where) -> Selector:
        return Selector("any", (self, select(other)))

    def __rand__(self, other: Where) -> Selector:
        return Selector("all", (select(other), self))

    def __ror__(self, other: Where) -> Selector:
        return Selector("any", (select(other), self))

    def __invert__(self) -> Selector:
        return Selector("not", self)

    def __repr__(self) -> str:
        kind, value = self.kind, self.value
        if kind == "pattern":
            return repr(value[0])
        if kind == "type":
            names = [t.__name__ for t in value]
            return names[0] if len(names) == 1 else f"({', '.join(names)})"
        if kind == "instance":
            return f"<{type(value).__name__} instance>"
        if kind == "instances":
            shown = [f"<{type(m).__name__} instance>" for m in value[0][:_SHOWN]]
            if len(value[0]) > _SHOWN:
                shown.append(f"... {len(value[0]) - _SHOWN} more")
            return "[" + ", ".join(shown) + "]"
        if kind == "predicate":
            return getattr(value, "__name__", repr(value))
        if kind == "not":
            return f"~select({value!r})"
        if kind == "all":
            return "(" + " & ".join(repr(s) for s in value) + ")"
        return "[" + ", ".join(repr(s) for s in value) + "]"


def select(where: Where) -> Selector:
    """Normalise any accepted selector form into a :class:`Selector` value.

    Args:
        where: a path pattern (``"features.0"``, ``"blocks.*.attn"``, ``"**"``; `*` is one
            segment, `**` any number, ``""`` the root), a module type or tuple of types, a
            module instance, a predicate ``(path, module) -> bool``, a list of these
            (union) or a Selector.

    Returns:
        A frozen, hashable Selector.

    Raises:
        SelectorError: for anything else, or a malformed pattern.

    Example:
        >>> from torch import nn
        >>> import funhooks as fh
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> [p for p, _ in fh.select("*").resolve(model)]
        ['0', '1']
        >>> [p for p, _ in fh.select([nn.ReLU, ""]).resolve(model)]
        ['', '1']
    """
    if isinstance(where, Selector):
        return where
    if isinstance(where, str):
        return Selector("pattern", (where, _compile_pattern(where)))
    if isinstance(where, type):
        return _type_selector((where,))
    if isinstance(where, tuple) and where and all(isinstance(t, type) for t in where):
        return _type_selector(where)
    if isinstance(where, nn.Module):
        # a compiled / DataParallel submodule selects the module it wraps, as paths do
        return Selector("instance", _torch.unwrap(where))
    if isinstance(where, (list, tuple)):
        if not where:
            raise SelectorError(
                "select: a list selector needs at least one entry, got []. "
                'Use "**" for every module.'
            )
        if all(isinstance(w, nn.Module) for w in where):  # a list of modules: one set lookup per module
            modules = tuple(_torch.unwrap(w) for w in where)
            return Selector("instances", (modules, frozenset(map(id, modules))))
        return Selector("any", tuple(select(w) for w in where))
    if callable(where):
        try:
            hash(where)
        except TypeError:
            raise SelectorError(
                f"select: a predicate is hashable (selectors are values, compared and cached by it), got an "
                f"unhashable {type(where).__name__}. Make it hashable (e.g. `@attrs.frozen`), or pass a function."
            ) from None
        _check_predicate(where)
        return Selector("predicate", where)
    raise SelectorError(
        "select: `where` is a path pattern, a module type, a module instance, a predicate "
        f"`(path, module) -> bool` or a list of these, got {where!r}. Pass one of those."
    )


def _check_predicate(fn: Callable[..., object]) -> None:
    """A predicate is called as ``fn(path, module)``; one without a signature is trusted."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise SelectorError(
            f"select: a predicate takes `(path, module)` and returns a bool, got `{name}` taking "
            f"({', '.join(signature.parameters)}). Pass e.g. `lambda path, module: isinstance(module, nn.Linear)`."
        ) from None


def path_label(path: str) -> str:
    """A module path as messages name it: quoted, and the root said in words."""
    return repr(path) if path else "'' (the root)"


def _type_selector(types: tuple[type, ...]) -> Selector:
    bad = [t for t in types if not issubclass(t, nn.Module)]
    if bad:
        raise SelectorError(
            f"select: a type selector names `nn.Module` subclasses, got {bad[0]!r}. "
            "Pass a module class such as `nn.Linear`."
        )
    return Selector("type", types)


def resolve(
    selector: Selector,
    model: nn.Module,
    *,
    caller: str,
    spec: object = None,
    modules: list[tuple[str, nn.Module]] | None = None,
) -> tuple[tuple[str, nn.Module], ...]:
    """Resolve `selector` on `model`, raising a helpful error when it picks nothing.

    Args:
        selector: the selector to resolve.
        model: the model (wrappers are looked through).
        caller: the public function name, used in messages.
        spec: the spec being resolved, named in messages.
        modules: ``_torch.named_modules(model)`` when the caller already walked it.

    Returns:
        The ``(path, module)`` pairs, in module order.

    Raises:
        SelectorError: when a module instance is not part of `model`, or nothing matches.
    """
    if modules is None:
        modules = list(_torch.named_modules(model))
    where = f" in spec {spec!r}" if spec is not None else ""
    instances = selector.instances()
    by_id = {id(m) for _, m in modules} if instances else set()
    for inst in instances:
        if id(_torch.unwrap(inst)) not in by_id:
            raise SelectorError(
                f"{caller}: a module instance selector must be a submodule of the model{where}, "
                f"got a {type(inst).__name__} that is not part of {type(model).__name__}. "
                "Select it by path or type, or pass the model that contains it."
            )
    found = _matching(selector, modules)
    if not found:
        raise SelectorError(_no_match_message(selector, model, modules, caller, where))
    return found


def _matching(selector: Selector, modules: list[tuple[str, nn.Module]]) -> tuple[tuple[str, nn.Module], ...]:
    """The pairs of `modules` `selector` picks: one pass with no call per module for the
    common kinds (patterns, types, lists of modules), ``matches`` for the others."""
    kind, value = selector.kind, selector.value
    if kind == "pattern":
        match = value[1].match
        return tuple([pm for pm in modules if match("." + pm[0]) is not None])
    if kind == "type":
        return tuple([pm for pm in modules if isinstance(pm[1], value)])
    if kind == "instances":
        ids = value[1]
        return tuple([pm for pm in modules if id(pm[1]) in ids])
    return tuple([pm for pm in modules if selector.matches(*pm)])


def _no_match_message(selector: Selector, model: nn.Module, modules: list, caller: str, where: str) -> str:
    name = type(_torch.unwrap(model)).__name__
    every = list(_torch.named_modules(model, every_path=True))
    first = {id(m): p for p, m in reversed(modules)}
    for path, module in every:
        if first.get(id(module), path) != path and selector.matches(path, module):
            return (
                f"{caller}: selector {selector!r}{where} matched module {path!r} of {name}, which is the same "
                f"module as {first[id(module)]!r} (registered at both paths); funhooks names a shared module by its "
                f"first path and records every call there. Select {first[id(module)]!r}."
            )
    children = [p for p, _ in every if p and "." not in p]
    msg = f"{caller}: selector {selector!r}{where} matched no module of {name}; "
    paths = [p for p, _ in modules if p]
    close: list[str] = []
    for pattern in _patterns(selector):
        close += [p for p in difflib.get_close_matches(pattern, paths, n=_NEARBY, cutoff=0.5) if p not in close]
    if close:
        msg += f"nearby paths are {close[:_NEARBY]}; "
    return msg + f"top-level children are {children}."


_NEARBY = 5
"""How many nearby paths a no-match message lists."""

_SHOWN = 6
"""How many modules the repr of a list-of-modules selector shows."""


def _patterns(selector: Selector) -> list[str]:
    """The non-empty path patterns a selector asks for (inside lists and `&` too)."""
    if selector.kind == "pattern":
        return [selector.value[0]] if selector.value[0] else []
    if selector.kind in ("any", "all"):
        return [p for s in selector.value for p in _patterns(s)]
    return []

