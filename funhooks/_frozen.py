"""The one way funhooks values refuse to change.

Assigning or deleting an attribute (and, for the mapping-like Record, an item) raises
``FrozenError`` naming the class and what to do instead. Slots classes inherit
:class:`Frozen`; attrs frozen classes get the same methods with :func:`frozen` (attrs builds
its instances through ``object.__setattr__``, so ``__init__`` and ``attrs.evolve`` work).
A class says how to get a changed value in ``_hint`` (``{key}`` is the attribute).
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

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

    def __setattr__(self, key: str, value: object) -> None:
        raise FrozenError(self._refusal(f"assigned to, got `.{key} = ...`", key))

    def __delattr__(self, key: str) -> None:
        raise FrozenError(self._refusal(f"changed, got `del .{key}`", key))

    def __setitem__(self, key: object, value: object) -> None:
        raise FrozenError(self._refusal(f"assigned to, got `[{key!r}] = ...`", key))

    def __delitem__(self, key: object) -> None:
        raise FrozenError(self._refusal(f"changed, got `del [{key!r}]`", key))

    def _refusal(self, what: str, key: object) -> str:
        return f"{type(self).__name__}: a frozen value cannot be {what}. {self._hint.format(key=key)}"


_EVOLVE_HINT = "Build a new one with `attrs.evolve(value, {key}=...)`."
"""What an attrs value without a ``_hint`` of its own suggests."""


def frozen(cls: T) -> T:
    """Give an attrs frozen class Frozen's refusals (FrozenError, with the class's ``_hint``,
    by default :data:`_EVOLVE_HINT`). Every frozen attrs class of funhooks wears it, so every
    funhooks value refuses change the same way.

    Example:
        >>> import attrs
        >>> from funhooks._frozen import frozen
        >>> @frozen
        ... @attrs.frozen
        ... class Point:
        ...     x: int
        >>> Point(1).x = 2
        Traceback (most recent call last):
        ...
        funhooks.errors.FrozenError: Point: a frozen value cannot be assigned to, got `.x = ...`. Build a new one with `attrs.evolve(value, x=...)`.
    """
    for name in ("__setattr__", "__delattr__", "_refusal"):
        setattr(cls, name, getattr(Frozen, name))
    if "_hint" not in vars(cls) and not any("_hint" in vars(base) for base in cls.__mro__[1:-1]):
        cls._hint = _EVOLVE_HINT  # type: ignore[attr-defined]
    return cls
