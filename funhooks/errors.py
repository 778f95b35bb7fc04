"""The exception types funhooks raises, each subclassing the builtin it refines.

Every message follows one shape: ``<function>: <the rule, names in backticks>, got
<value>. <how to fix>.`` so that the first line of a traceback says what to change.
"""

from __future__ import annotations

__all__ = [
    "FrozenError",
    "HookError",
    "RecordError",
    "SelectorError",
    "SpecError",
    "StaleTensorError",
    "TransformError",
]


class SpecError(ValueError):
    """Raised when a spec is built with a bad argument: a non-callable `fn`, an unknown
    `event`, a flag that makes no sense for the event, or two specs that would store under
    the same record name on one module."""


class SelectorError(ValueError):
    """Raised when a selector is malformed, matches no module of the model, or names a
    module instance that does not belong to the model. Nothing is registered."""


class RecordError(LookupError):
    """Raised when a Record lookup cannot give one clear answer: an unknown path or name,
    or single-value access (``rec[path][name]``) to a module that ran several times."""


class StaleTensorError(RuntimeError):
    """Raised when a stored tensor was modified in place after it was stored (for example
    by ``ReLU(inplace=True)`` after a ``BatchNorm``), so the value in the Record would be
    silently wrong. Store a copy with ``clone=True``."""


class HookError(RuntimeError):
    """Raised when a spec's function raised inside a run. The original exception is the
    ``__cause__``; the message names the spec and the module path. Hooks are removed."""


class TransformError(RuntimeError):
    """Raised when a run cannot work under a ``torch.func`` transform or ``torch.compile``
    as asked: a backward-event spec inside a transformed function, a non-tensor stored
    value where a transform needs tensors, or a model kind whose hooks would be ignored."""


class FrozenError(AttributeError):
    """Raised on any attempt to assign to a frozen funhooks value (Record, Run, Step)."""
