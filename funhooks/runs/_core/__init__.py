"""The run core: how specs reach the module calls they hook.

A **plan** (``plan``) resolves specs against a model once, after one walk of it (``walk``):
per hooked module, a ``Hooked`` table (``hooked``) of **entries** (``entries``), the small
functions that store, observe or edit one spec's values, and of **op entries** (``op_mode``),
which run during the module's own forward on the torch ops it calls. Plans are cached per
model and spec tuple while the model's structure holds; a plan holding a value of the
user's is kept only by the user's own spec (an intervention's ``memo``), or lives with its
run.

A **frame** (``frame``) is one run's mutable state: the buffer its entries append to, the
tensor hooks they registered, the ``torch.func`` level it was opened at. The Record is built
from it, with the in-place check of every stored tensor. The frame reads its plan through a
protocol of ``types``, the core's shared types (the buffer's ``Stored`` entries and their
``Check``, the plan's ``Selected`` specs): so ``frame`` imports no module whose entries take
a frame, and no module of the core names another's types under ``TYPE_CHECKING``.

**Attaching** (``attach``) puts a plan on the model for one frame: a ``Forward``
(``forward``) in the ``__dict__`` of each hooked module, a compiled recorder (``trace``) on
each ``torch.compile`` wrapper, hooks on watched parameters. Nothing global is installed,
ever, and detaching restores every ``__dict__`` exactly.

The **scope** (``scope``) says which frames see a call: those entered in the calling
thread's ``contextvars`` context. A ``Forward``'s class is its state, chosen when a run joins
or leaves the module (``forward``), and every hooked call runs the ``__call__`` of its state::

    module(x) -> PyTorch's _call_impl (fast path) -> Forward.__call__
        _Observing (its plan's one run, observers only): the run in scope, outside
               transforms? -> the module's own forward, then the observers' entries
        _Reading (its plan's one run, only recording the attention pattern): the run in
               scope, and the call gives its pattern run eagerly (a Hugging Face attention
               module in eval mode)? -> that call, its pattern stored; else as _OneRun
        _OneRun / _Shared (one run with editors or ops; several runs): the users in scope?
               no -> the module's own forward
               yes -> the runner: forward-pre editors, forward-pre observers, the module's
               forward (inside an op mode when op specs select it), editors, gradient
               watchers, observers (recordings see edited values); or, for a compiled
               module, its compiled recorder
        _Passing (left under someone else's forward) -> the module's own forward

Public code uses three names: ``Plan.get``, ``Frame`` and ``Attached``, plus ``scope``.
"""

from . import scope
from .attach import Attached
from .frame import Frame
from .plan import Plan, as_copy

__all__ = ["Attached", "Frame", "Plan", "as_copy", "scope"]
