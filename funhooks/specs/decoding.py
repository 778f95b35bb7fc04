"""Decode steps as positions: ``fh.steps``, an intervention's ``index`` during generation.

``fh.generate`` / ``fh.iter_generate`` number the model's forward calls of one
``model.generate``: step 0 is the prompt pass (it sees the whole prompt and predicts new token
0), step k the call that predicts new token k. With the KV cache step k sees one position (the
token chosen at step k-1); without it, the whole sequence so far; with ``prefill_chunk_size``
the prompt pass is one call per chunk, each seeing its chunk. Each position belongs to the step
that first sees it: the prompt to step 0, position ``prompt + k - 1`` to step k. A call's
positions are read off the call itself (the cache's length and the input's), not assumed.

``index=fh.steps(...)`` edits the positions that belong to the steps asked for, in whichever
calls see them: the cached run edits them once, the uncached run again at every later step,
so both compute the same values and choose the same tokens. ``last=True`` keeps only the
positions that predict a token: the prompt's last position and every generated one.

Cost: per edited call, a position mask of the edited value's length along ``dim``.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch

from funhooks import _frozen
from funhooks.errors import SpecError

__all__ = ["DECODING", "Decoding", "Steps", "steps"]

DECODING = "fh.decoding"
"""The per-call value under which a generation puts the step being run (not an identifier, so
no ``fh.arg`` name can take it)."""


class Decoding(NamedTuple):
    """Where a generation is: the `step` now running, the `prompt`'s length, and `end`, the
    position after the last one the model's call now running sees (its positions, and the
    keys its attention reads, end there)."""

    step: int
    prompt: int
    end: int


@_frozen.frozen
@attrs.frozen(repr=False)
class Steps:
    """Positions given by the decode steps they belong to (see :func:`steps`).

    Example:
        >>> import funhooks as fh
        >>> fh.steps(1, None).start, fh.steps(1, None).stop
        (1, None)
    """

    start: int
    stop: int | None
    last: bool = False

    def __repr__(self) -> str:
        stop = "" if self.stop == self.start + 1 else f", {self.stop}"
        return f"fh.steps({self.start}{stop}{', last=True' if self.last else ''})"

    def mask(self, size: int, at: Decoding, device: torch.device) -> torch.Tensor:
        """Which of a call's `size` positions (the `size` positions before ``at.end``) to edit."""
        first = at.end - size
        position = torch.arange(first, first + size, device=device)
        step = (position - at.prompt + 1).clamp(min=0)
        mask = step >= self.start
        if self.stop is not None:
            mask &= step < self.stop
        if self.last:
            mask &= position >= at.prompt - 1
        return mask


def steps(start: int, stop: int | None = ..., *, last: bool = False) -> Steps:  # type: ignore[assignment]
    """The positions of decode steps `start` (to `stop`, exclusive), for an intervention's ``index``.

    ``fh.steps(0)`` is the prompt pass, ``fh.steps(k)`` step k alone, ``fh.steps(k, None)``
    steps k on, ``fh.steps(1, None)`` the generated tokens and not the prompt. The same spec
    edits the same positions with and without the KV cache (see :mod:`funhooks.specs.decoding`).

    Args:
        start: the first step, >= 0.
        stop: the step after the last one (default ``start + 1``); None for every step on.
        last: only the positions that predict a token (the prompt's last one, then every
            generated one).

    Returns:
        A :class:`Steps`, read during ``fh.generate`` / ``fh.iter_generate`` only.

    Raises:
        SpecError: for a negative or empty range.

    Example:
        >>> import funhooks as fh
        >>> fh.steps(2, None), fh.steps(0, last=True)
        (fh.steps(2, None), fh.steps(0, last=True))
    """
    if stop is ...:
        stop = start + 1 if isinstance(start, int) else None
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise SpecError(f"steps: `start` is a step number >= 0 (0 is the prompt pass), got {start!r}. Pass e.g. 3.")
    if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int) or stop <= start):
        raise SpecError(f"steps: `stop` is None or a step after `start` ({start}), got {stop!r}. "
                        "Pass None for every step from `start` on.")
    if not isinstance(last, bool):
        raise SpecError(f"steps: `last` is a bool, got {last!r}. Pass True to edit only the positions that "
                        "predict a token.")
    return Steps(start, stop, last)
