"""The run core: how specs reach the module calls they hook.

A **plan** (``plan``) resolves specs against a model once, after one walk of it (``walk``):
per hooked module, a ``Hooked``
table (``hooked``) of **entries** (``entries``), the small functions that store, observe or
edit one spec's values, and of **op entries** (``ops``), which run during the module's own
forward on the torch ops it calls. Plans are cached per model and spec tuple while the model's structure holds,
except plans holding a value of the user's (a tensor, an intervention), which live with their run.

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
thread's ``contextvars`` context. Every hooked call goes through one hot loop::

    module(x) -> PyTorch's _call_impl (fast path) -> Forward.__call__
        the plan's one run, observing only, outside transforms?  -> the forward, then its
               observers (``fh.outputs`` stored inline)
        users in scope?  no -> the module's own forward
        yes -> forward-pre editors, forward-pre observers, the module's forward (inside
               an op mode when op specs select it), editors, gradient watchers,
               observers (recordings see edited values)

Public code uses three names: ``Plan.get``, ``Frame`` and ``Attached``, plus ``scope``.
"""

from . import scope
from .attach import Attached
from .frame import Frame
from .plan import Plan, as_copy

__all__ = ["Attached", "Frame", "Plan", "as_copy", "scope"]
