"""A call racing a change of state of its wrapped forward in another thread: the call is
recorded by its run whichever state it started in (funhooks/runs/_core/forward.py, `_serve`)."""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

import torch
from torch import nn

import funhooks as fh


def test_a_call_that_began_while_two_runs_shared_its_module_is_recorded_when_the_other_run_leaves() -> None:
    """The run holding its plan's forwards calls module '0' while a run in another thread
    shares it; that other run exits after the call began but before the call read who uses the
    module. The call is still recorded by its own run, once, and by no other."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    x = torch.randn(2, 3)
    joined, leave = threading.Event(), threading.Event()
    other: list[fh.Run] = []

    def join_then_leave() -> None:
        with fh.with_hooks(model, fh.outputs("0")) as run:
            other.append(run)
            joined.set()
            leave.wait(10)

    with fh.with_hooks(model, fh.outputs("0")) as mine:  # entered first: the plan's own forwards
        worker = threading.Thread(target=join_then_leave)
        worker.start()
        assert joined.wait(10)
        wrapped = model[0].__dict__["forward"]

        def pause_in_the_call(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call" and frame.f_locals.get("self") is wrapped and not leave.is_set():
                leave.set()  # the other run exits now, while this call has begun
                worker.join(10)

        previous = sys.gettrace()
        sys.settrace(pause_in_the_call)
        try:
            model(x)
        finally:
            sys.settrace(previous)
    assert not worker.is_alive()
    assert len(mine.record.calls("0", "output")) == 1
    assert list(other[0].record) == []
    assert "forward" not in model[0].__dict__
