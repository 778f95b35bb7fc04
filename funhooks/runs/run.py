"""Context-scoped runs: ``with fh.with_hooks(model, specs) as run``.

A run attaches its plan when the block is entered and takes it off when the block exits,
however it exits. It sees the module calls made in the context that entered it (its thread
and its ``contextvars`` context): other threads and asyncio tasks calling the same model
meanwhile run it as if no run existed. Nothing global is installed: hooked modules get a
wrapped ``forward`` in their own ``__dict__`` for the duration of the block (see
``funhooks/runs/_core/``), so every module call keeps PyTorch's hook-free fast path (capturing all
96 modules of a deep-narrow MLP costs about 1.25x the bare forward).

Cost: per hooked module call, one wrapper call and, per stored tensor, a version-counter
read (and a ``detach()`` where it has autograd history); per run, wrapping and restoring
each hooked module (about 0.7 µs each). Resolved plans are cached per model and spec set,
and rebuilt when the model's structure changes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from funhooks._frozen import Frozen
from funhooks.errors import SpecError, TransformError
from funhooks.records.record import Record
from funhooks.specs.spec import Spec

from ._core import Attached, Frame, Plan, scope

__all__ = ["Run", "as_specs", "check_model", "make_run", "with_hooks"]


def as_specs(specs: Spec | Iterable[Spec], caller: str) -> tuple[Spec, ...]:
    if isinstance(specs, Spec):
        return (specs,)
    try:
        items = tuple(specs)
    except TypeError:
        items = None
    if items is None or isinstance(specs, str) or not all(isinstance(s, Spec) for s in items):
        bad = specs if items is None or isinstance(specs, str) else next(s for s in items if not isinstance(s, Spec))
        raise SpecError(
            f"{caller}: `specs` is a Spec or an iterable of Specs, got {bad!r}. "
            "Build specs with fh.outputs, fh.inputs, fh.grads, fh.observe or fh.edit."
        )
    return tuple(dict.fromkeys(items))  # equal specs are installed once


def check_model(model: object, caller: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise SpecError(f"{caller}: `model` is an nn.Module, got {type(model).__name__}. Pass the model to hook.")
    if isinstance(model, torch.jit.ScriptModule):
        raise TransformError(
            f"{caller}: hooks on a TorchScript module never fire, got {type(model).__name__}. "
            "Hook the eager model before scripting it."
        )
    return model


def _per_call_error(specs: tuple[Spec, ...], caller: str) -> SpecError:
    spec = next(s for s in specs if s.args)
    name = spec.args[0]
    return SpecError(
        f"{caller}: `fh.arg` values come from the keyword arguments of a call of `fh.capture` or "
        f"`fh.functional`, got `fh.arg({name!r})` in {spec!r}. Put the value itself in the spec, or call "
        f"`fh.capture(model, specs)(x, {name}=value)`."
    )


class Run(Frozen):
    """A context-scoped run of specs on a model. Use it through :func:`with_hooks`.

    Inside the block the model is called as usual (``model(x)`` or ``run(x)``); hooks are
    installed on entry and removed on exit, whatever the exit. ``run.record`` is a snapshot
    valid inside and after the block; ``run.stored`` is fastai's list, one value (the last
    call's) per hooked module and spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with fh.with_hooks(model, fh.outputs("0")) as run:
        ...     for _ in range(3):
        ...         y = run(torch.randn(4, 2))     # run(x) is model(x)
        ...     first = run.take()                  # the record so far; the buffer restarts
        ...     y = run(torch.randn(4, 2))
        >>> len(first.calls("0", "output")), len(run.record.calls("0", "output"))
        (3, 1)
    """

    __slots__ = ("_caller", "_life", "_model", "_plan", "_specs")
    _caller: str
    _life: _Life
    _model: nn.Module
    _plan: Plan
    _specs: tuple[Spec, ...]
    _hint = "Start a new run."

    def __init__(self, model: nn.Module, specs: Spec | Iterable[Spec]) -> None:
        self._setup(model, specs, "with_hooks")

    def _setup(self, model: nn.Module, specs: Spec | Iterable[Spec], caller: str) -> None:
        # the run's value, set once here as attrs sets a frozen instance's fields; what changes
        # when the block is entered and left is its `_Life`, a mutable object of its own
        set_ = object.__setattr__
        set_(self, "_caller", caller)
        set_(self, "_model", check_model(model, caller))
        set_(self, "_specs", as_specs(specs, caller))
        set_(self, "_plan", Plan.get(model, self._specs, caller))
        if self._plan.args:
            raise _per_call_error(self._specs, caller)
        set_(self, "_life", _Life())

    @property
    def specs(self) -> tuple[Spec, ...]:
        """The specs of this run, equal specs once."""
        return self._specs

    def __enter__(self) -> Run:
        life = self._life
        if life.state != "new":
            raise RuntimeError(f"{self._caller}: a run is entered once, got a second `with`. Call `with_hooks` again.")
        life.state = "open"
        life.frame = frame = Frame(self._plan, self._caller)
        # inside a torch.func transform, batched tensors keep no version counters: store copies
        life.attached = Attached(self._plan, frame, copies=bool(frame.level))
        scope.enter(frame)
        return self

    def __exit__(self, *exc: object) -> None:
        life = self._life
        frame, attached = life.frame, life.attached
        if frame is None or attached is None:  # never entered
            return
        scope.leave(frame)
        attached.detach()
        frame.close()
        life.state = "closed"
        if exc[0] is None and sys.exc_info()[0] is None:  # not while an error propagates (a step's abort)
            frame.check()

    def __call__(self, *args: object, **kwargs: object) -> Any:
        """Call the model: ``run(x)`` is ``model(x)``."""
        return self._model(*args, **kwargs)

    @property
    def record(self) -> Record:
        """A Record of everything stored so far (a snapshot).

        Raises:
            StaleTensorError: when a stored tensor was changed in place after it was stored.
        """
        frame = self._life.frame
        return Record() if frame is None else frame.record()

    def take(self) -> Record:
        """The Record of everything stored since the last ``take``, then start afresh.

        Use it to get one Record per batch from a single block around a loop.
        """
        frame = self._life.frame
        return Record() if frame is None else frame.take()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside this block the run stores and edits nothing: its wrappers stay in place and
        only call the modules."""
        frame = self._life.frame
        if frame is None or frame not in scope.active():
            yield
            return
        scope.leave(frame)
        try:
            yield
        finally:
            scope.enter(frame)

    @property
    def stored(self) -> list[Any]:
        """fastai's ``hooks.stored``: the last call's value for each (spec, module), in spec
        then module order (for a list of modules, the list's order); ``None`` where the
        module did not run."""
        rec = self.record
        out = []
        for path, name in self._plan.stored:
            node = rec.get(path)
            out.append(node.calls(name)[-1] if node is not None and name in node else None)
        return out

    def __repr__(self) -> str:
        return f"Run({type(self._model).__name__}, specs={list(self._specs)!r}, {self._life.state})"


class _Life:
    """What changes in a run as its block is entered and left: its state (``new``, ``open``,
    ``closed``), its frame and what it attached. A plain mutable object, owned by one Run."""

    __slots__ = ("attached", "frame", "state")

    def __init__(self) -> None:
        self.state = "new"
        self.frame: Frame | None = None
        self.attached: Attached | None = None


def make_run(model: nn.Module, specs: Spec | Iterable[Spec], caller: str) -> Run:
    """A run whose messages name `caller` (``train``, ``evaluate``, ``fit``): what the training
    loops open per step."""
    run = object.__new__(Run)
    run._setup(model, specs, caller)
    return run


def with_hooks(model: nn.Module, specs: Spec | Iterable[Spec]) -> Run:
    """Run `specs` on `model` for the duration of a ``with`` block.

    Everything is validated before anything is attached: selectors must match, module
    instances must belong to the model, record names must not clash on one module.
    The run sees the calls made in the context that entered it (its thread, its asyncio
    task); calls of the model from elsewhere meanwhile are neither recorded nor edited.

    Args:
        model: the model (DDP, DataParallel and ``torch.compile`` wrappers are looked through:
            paths are those of the inner model).
        specs: a Spec or an iterable of Specs; equal specs are installed once.

    Returns:
        A :class:`Run` to use as a context manager.

    Raises:
        SpecError: for things that are not specs, or two specs storing one name on one module.
        SelectorError: for a selector that matches nothing or a foreign module instance.
        HookError: (inside the block) when a spec's function raises.
        StaleTensorError: (on reading the record) when a stored tensor was changed in place.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> with fh.with_hooks(model, [fh.outputs(nn.Linear), fh.inputs("2")]) as run:
        ...     y = model(torch.randn(8, 4))
        >>> rec = run.record
        >>> list(rec), rec["2"]["output"].shape
        (['0', '2'], torch.Size([8, 1]))
        >>> fh.testing.assert_no_hooks(model)
    """
    return Run(model, specs)

