"""Attaching: a plan put on a model for one frame, and taken off again.

``Attached(plan, frame)`` makes the frame a user of the wrapped forward of every hooked
module (``forward``), of the recorder of every ``torch.compile`` wrapper holding hooked
modules (``trace``), and registers the ``param_grad`` hooks; ``detach()`` undoes all of it,
whatever happened in between. Which frames see a call is the scope's business, not this
module's: attaching is the same for every run, whichever thread or task enters it.

Cost: per run, a few dict writes per hooked module and one hook per watched parameter.
"""

from __future__ import annotations

from . import forward
from .entries import param_hook
from .frame import Frame
from .plan import Plan
from .types import Handle

__all__ = ["Attached"]


class Attached:
    """A plan's wrappers and parameter hooks, attached for one frame until :meth:`detach`."""

    __slots__ = ("forwards", "frame", "params", "slot")

    def __init__(self, plan: Plan, frame: Frame, *, copies: bool = False) -> None:
        """Args: `copies` uses the entries that store copies (inside ``torch.func`` transforms,
        whose batched tensors keep no version counters)."""
        self.frame = frame
        self.forwards: list[forward.Forward[forward.Table]] = []
        self.params: list[Handle] = []
        self.slot = None if copies else plan.slot
        try:
            items = plan.copy_items() if copies else plan.items
            if plan.pauses:
                with plan.attaching():
                    self.forwards = forward.install(frame, items, self.slot)
            else:
                self.forwards = forward.install(frame, items, self.slot)
            if plan.wrappers:
                self.forwards += forward.install(frame, plan.wrappers)
            for hook in plan.params:
                param = hook.ref()
                if param is not None and param.requires_grad:
                    self.params.append(param.register_hook(param_hook(hook.spec, hook.key, param, frame)))
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        """Take everything off again; the model's ``__dict__``s are as they were."""
        for handle in reversed(self.params):
            handle.remove()
        self.params = []
        forward.uninstall(self.frame, self.forwards, self.slot)
        self.forwards = []
