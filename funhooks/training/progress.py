"""An optional progress bar over training steps (the ``progress`` extra: tqdm).

On by default in a terminal, off when stderr is not a terminal or the ``CI`` environment
variable is set, off (silently) when tqdm is not installed and nobody asked for it.

Cost: one ``bar.update()`` per step (tqdm checks the clock only every few updates). The
loss is shown only when the bar redraws, so reading it syncs a GPU at most a few times a
second, never once per batch.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Generator, Iterator
from typing import TypeVar

from funhooks.errors import ExtraError

__all__ = ["wrap"]

T = TypeVar("T")

_CI_VARIABLE = "CI"
"""Setting this environment variable (to anything but ``""`` / ``"0"`` / ``"false"``) turns the default bar off."""

_FALSY = ("", "0", "false", "no")


def _is_enabled(progress: bool | None) -> bool:
    """Whether a loop shows a bar: `progress` if given, else "a terminal, not CI, tqdm installed".

    Args:
        progress: True (require a bar), False (none) or None (decide from the environment).

    Returns:
        True when a bar is shown.

    Raises:
        ExtraError: for ``progress=True`` without tqdm installed.

    Example:
        >>> from funhooks import progress
        >>> progress._is_enabled(False)
        False
    """
    if progress is False:
        return False
    installed = importlib.util.find_spec("tqdm") is not None
    if progress is True:
        if not installed:
            raise ExtraError(
                "progress: a progress bar needs tqdm, got `progress=True` without it installed. "
                "Install the extra: pip install 'funhooks[progress]'."
            )
        return True
    in_ci = os.environ.get(_CI_VARIABLE, "").strip().lower() not in _FALSY
    return installed and not in_ci and sys.stderr is not None and sys.stderr.isatty()


def wrap(steps: Generator[T, None, None], *, total: int | None, desc: str, progress: bool | None) -> Iterator[T]:
    """`steps` itself when no bar is shown, else a generator that shows one while it runs.

    Closing the wrapper closes `steps` (so a loop's hooks are removed) and the bar.

    Args:
        steps: a generator of Steps.
        total: the number of steps, when known.
        desc: the bar's label.
        progress: as for :func:`_is_enabled`.

    Returns:
        An iterator over the same steps.

    Example:
        >>> from funhooks import progress
        >>> gen = (i for i in range(3))
        >>> progress.wrap(gen, total=3, desc="train", progress=False) is gen
        True
    """
    if not _is_enabled(progress):
        return steps
    return _with_bar(steps, total, desc)


def _with_bar(steps: Generator[T, None, None], total: int | None, desc: str) -> Iterator[T]:
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=True)
    try:
        for step in steps:
            yield step
            if bar.update():
                loss = getattr(step, "loss", None)
                if loss is not None:
                    bar.set_postfix(loss=f"{float(loss):.4g}", refresh=False)
                del loss
            del step  # the loop does not keep step i (a batch, its output) alive while step i + 1 is made
    finally:
        steps.close()
        bar.close()
