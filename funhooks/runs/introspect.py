"""What code outside the runs may ask about runs, without reaching into the run core.

``assert_no_hooks`` asks whether a callable left on a module is a run's wrapped forward, the
strategies which modules can be called at all, the shape utilities for a block that no run
sees (funhooks' own passes). Each answer is the core's own, re-exported here as the one door.

Example:
    >>> import torch, funhooks as fh
    >>> from torch import nn
    >>> from funhooks.runs import introspect
    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> with fh.with_hooks(model, fh.outputs("0")) as run:
    ...     hooked = introspect.is_run_forward(model[0].__dict__["forward"])
    ...     with introspect.isolated():
    ...         _ = model(torch.ones(1, 2))
    >>> hooked, list(run.record), introspect.never_called(nn.ModuleList())
    (True, [], True)
"""

from __future__ import annotations

import contextlib

from torch import nn

from ._core import forward, plan, scope

__all__ = ["is_run_forward", "isolated", "never_called"]


def is_run_forward(obj: object) -> bool:
    """True when `obj` is the wrapped ``forward`` a run puts in a hooked module's ``__dict__``."""
    return isinstance(obj, forward.Forward)


def never_called(module: nn.Module) -> bool:
    """True for containers without a forward of their own (``ModuleList``, ``ModuleDict``)."""
    return plan.never_called(module)


def isolated() -> contextlib.AbstractContextManager[None]:
    """A block whose module calls no run sees (funhooks' own passes: shapes, summaries)."""
    return scope.isolated()
