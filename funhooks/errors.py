"""The exception types funhooks raises, each subclassing the builtin it refines.

Every message follows one shape: ``<function>: <the rule, names in backticks>, got
<value>. <how to fix>.`` so that the first line of a traceback says what to change.
"""

from __future__ import annotations

__all__ = [
    "FrozenError",
    "ExtraError",
    "HookError",
    "InterventionError",
    "LoopError",
    "RecordError",
    "RecordKeyError",
    "ReducerError",
    "SelectorError",
    "SpecError",
    "StaleTensorError",
    "StoreError",
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
    """Raised when a Record cannot give one clear answer: an unknown path or name (as the
    subclass :class:`RecordKeyError`), single-value access (``rec[path][name]``) to a module
    that ran several times, or a file ``Record.load`` cannot read as a Record."""


class RecordKeyError(RecordError, KeyError):
    """Raised when a Record has no such module path, or a module stored no such name.

    It is a ``KeyError`` so that the ``Mapping`` protocol works (``node.get(name)``,
    ``name in node``), and a ``RecordError`` so that one ``except`` catches every lookup
    failure. ``str()`` is the message itself, without the quotes ``KeyError`` adds.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class StaleTensorError(RuntimeError):
    """Raised when a stored tensor was modified in place after it was stored (for example
    by ``ReLU(inplace=True)`` after a ``BatchNorm``), so the value in the Record would be
    silently wrong. Store a copy with ``clone=True``."""


class HookError(RuntimeError):
    """Raised when a spec's function raised inside a run. The original exception is the
    ``__cause__``; the message names the spec and the module path. Hooks are removed."""


class InterventionError(ValueError):
    """Raised when an intervention (``patch``, ``steer``, ``scale``, ``ablate``) cannot apply
    at a module call as asked: a value whose shape does not broadcast to what it edits (a
    batch size that differs, a value still batched outside ``vmap``), a Record without the
    module it patches, an ``index`` past the positions, a per-call value not given. The run
    stops and its hooks are removed: the model is left as it was. ``attribution_patching``
    raises it too, for a clean and a corrupted input of different shapes, or an ``element``,
    ``dim`` or ``heads`` that does not fit a point's value."""


class TransformError(RuntimeError):
    """Raised when a run cannot work under a ``torch.func`` transform or ``torch.compile``
    as asked: a backward-event spec inside a transformed function, a non-tensor stored
    value where a transform needs tensors, or a model kind whose hooks would be ignored."""


class FrozenError(AttributeError):
    """Raised on any attempt to assign to a frozen funhooks value (Record, Run, Step)."""


class LoopError(ValueError):
    """Raised by ``train`` / ``evaluate`` / ``fit`` for input the loop cannot use: a batch
    that is not an ``(x, y)`` pair where the loss needs one, an iterator of batches with
    ``epochs > 1``, a bad ``epochs`` or an optimizer without ``step`` / ``zero_grad``."""


class ReducerError(ValueError):
    """Raised when a value used as a reducer lacks the protocol (``specs``, ``init``,
    ``step``, ``result``), a reducer is built with a bad argument (``every <= 0``), a step
    stream lacks the records a reducer needs, or a result is read for something it does not
    hold (a module index out of range, histograms folded without ``with_hist``)."""


class ExtraError(ImportError):
    """Raised when a feature needs an optional dependency that is not installed; the
    message names the ``funhooks[...]`` extra to install."""


class StoreError(OSError):
    """Raised when an activation store on disk cannot be written or read as asked: a
    directory written by other specs, options or format version, a batch whose column
    shapes or dtypes differ from the store's, a shard missing or replaced, a write that
    failed (a full disk), or a rank locked by another process. Committed shards are never
    changed by the failure; the message says what to fix."""
