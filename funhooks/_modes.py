"""Train/eval modes set for a block and put back after it, module by module.

``nn.Module.__setattr__`` is slow and a module's own ``train()`` override may do more than
set a flag, so flags are written only where they change: on the way in through
``model.train(training)``, on the way out directly, to exactly what each module had.

Cost: one walk over the modules per block (about 0.2 µs per module), or, given the modules a
:class:`Walked` keeps (a loop entering a block per step), one comparison of their children
tables and one read of their flags, both at C speed.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator

from torch import nn

from . import _torch

__all__ = ["Walked", "in_mode", "modes_kept"]

_TRAINING = operator.attrgetter("training")


class Walked:
    """A model's modules (``_torch.walk``), walked again only when a module's table of children
    changed since (a module added, removed or replaced): the tables are compared with copies in
    one list comparison, as :class:`~funhooks.training.watch._Seen` does.

    Example:
        >>> from torch import nn
        >>> from funhooks._modes import Walked
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> walked = Walked(model)
        >>> len(walked()), walked() is walked()
        (2, True)
        >>> model.append(nn.ReLU())
        Sequential(...)
        >>> len(walked())
        3
    """

    __slots__ = ("copies", "model", "modules", "tables")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules: list[nn.Module] = []
        self.tables: list[dict[str, nn.Module | None]] | None = None
        self.copies: list[dict[str, nn.Module | None]] = []

    def __call__(self) -> list[nn.Module]:
        """The modules now, `model` first."""
        if self.tables is None or self.tables != self.copies:
            self.modules = _torch.walk(self.model)
            self.tables = [_torch.children(m) for m in self.modules]
            self.copies = [dict(t) for t in self.tables]
        return self.modules



def in_mode(model: nn.Module, training: bool, modules: list[nn.Module] | None = None) -> _InMode:
    """Inside the block `model` is in train (or eval) mode; after it, every module's flag is
    what it was before. `modules`: ``_torch.walk(model)`` where the caller has it (a
    :class:`Walked`'s); nothing is set or restored when every module is in the mode already.

    Example:
        >>> from torch import nn
        >>> from funhooks._modes import in_mode
        >>> model = nn.Sequential(nn.Dropout(), nn.Dropout()).eval()
        >>> model[1].train()
        Dropout(p=0.5, inplace=False)
        >>> with in_mode(model, True):
        ...     model.training, model[0].training
        (True, True)
        >>> model.training, model[0].training, model[1].training
        (False, False, True)
    """
    return _InMode(model, training, _torch.walk(model) if modules is None else modules)


class _InMode:
    """The block of :func:`in_mode`: a plain object rather than a generator's context manager,
    since a training loop enters one per step."""

    __slots__ = ("model", "modes", "modules", "training")

    def __init__(self, model: nn.Module, training: bool, modules: list[nn.Module]) -> None:
        self.model, self.training, self.modules = model, training, modules
        self.modes: list[tuple[nn.Module, bool]] | None = None

    def __enter__(self) -> None:
        flags = list(map(_TRAINING, self.modules))
        if all(flags) if self.training else not any(flags):
            return
        self.modes = list(zip(self.modules, flags))
        self.model.train(self.training)

    def __exit__(self, *exc: object) -> None:
        if self.modes is not None:
            _restore(self.modes)


@contextlib.contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """After the block every module's flag is what it was before, whatever the block set.

    Example:
        >>> from torch import nn
        >>> from funhooks._modes import modes_kept
        >>> model = nn.Sequential(nn.Dropout()).eval()
        >>> with modes_kept(model):
        ...     _ = model.train()
        >>> model.training, model[0].training
        (False, False)
    """
    modes = [(m, m.training) for m in _torch.walk(model)]
    try:
        yield
    finally:
        _restore(modes)


def _restore(modes: list[tuple[nn.Module, bool]]) -> None:
    for module, flag in modes:
        if module.training != flag:
            module.training = flag
