"""The one way funhooks values refuse to change.

Assigning or deleting an attribute (and, for the mapping-like Record, an item) raises
``FrozenError`` naming the class and what to do instead. Slots classes inherit
:class:`Frozen`; attrs frozen classes get the same methods with :func:`frozen` (attrs builds
its instances through ``object.__setattr__``, so ``__init__`` and ``attrs.evolve`` work).
A class says how to get a changed value in ``_hint`` (``{key}`` is the attribute).
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from .errors import FrozenError

__all__ = ["Frozen", "frozen"]

T = TypeVar("T", bound=type)


class Frozen:
    """Assignment and deletion raise FrozenError. Example:

        >>> from funhooks._frozen import Frozen
        >>> class Point(Frozen):
        ...     __slots__ = ("x",)
        ...     def __init__(self, x):
        ...         object.__setattr__(self, "x", x)
        >>> Point(1).x = 2
        Traceback (most recent call last):
        ...
        funhooks.errors.FrozenError: Point: a frozen value cannot be assigned to, got `.x = ...`. Build a new one.
    """

    __slots__ = ()
    _hint: ClassVar[str] = "Build a new one."

    def __setattr__(self, key: str, value: Any) -> None:
        raise FrozenError(self._refusal(f"assigned to, got `.{key} = ...`", key))

    def __delattr__(self, key: str) -> None:
        raise FrozenError(self._refusal(f"changed, got `del .{key}`", key))

    def __setitem__(self, key: Any, value: Any) -> None:
        raise FrozenError(self._refusal(f"assigned to, got `[{key!r}] = ...`", key))

    def __delitem__(self, key: Any) -> None:
        raise FrozenError(self._refusal(f"changed, got `del [{key!r}]`", key))

    def _refusal(self, what: str, key: Any) -> str:
        return f"{type(self).__name__}: a frozen value cannot be {what}. {self._hint.format(key=key)}"


def frozen(cls: T) -> T:
    """Give an attrs frozen class Frozen's refusals (FrozenError, with the class's ``_hint``)."""
    for name in ("__setattr__", "__delattr__", "_refusal"):
        setattr(cls, name, getattr(Frozen, name))
    return cls
