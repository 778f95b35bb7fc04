"""Runs over a Hugging Face ``model.generate``: one Record per decode step, beside its token.

``fh.generate(model, specs, input_ids, **generate_kwargs)`` calls ``model.generate`` inside
a run and cuts the run's Record at every decode step: step 0 is the prompt pass (it predicts
new token 0), step k the forward that predicts new token k. Interventions whose ``index`` is
``fh.steps(...)`` edit only the positions of the steps asked for, the same with and without
the KV cache (see :mod:`funhooks.specs.decoding`). ``fh.iter_generate`` yields each step as it
is made.

**A Record per step**, not one Record with a step axis: the prompt pass sees the whole
prompt, a cached step one position and an uncached step the whole sequence so far, so a
step's values cannot stack with another's. ``GenerationStep.new(dim)`` keeps the positions
a step added (the prompt, then one token), the same Record with and without the cache.

Steps are cut by a stopping criterion added to the call's ``stopping_criteria``: it runs
after each step's token is chosen, takes the step's Record and moves to the next step.
Greedy search and sampling (seed the global generator, ``torch.manual_seed``, as for a
plain ``generate``) make one forward per token; beam search and assisted decoding, which
make other calls, are not numbered as steps here.

Cost: what a ``with_hooks`` block costs for the call, plus building one Record per step.
``iter_generate`` runs ``generate`` in a worker thread (in a copy of the caller's
``contextvars`` context, so runs open around it see it) that waits for the consumer at every
step; thread-local torch state (autocast) is not carried over.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import attrs
import torch
from torch import nn

from funhooks import _frozen
from funhooks.errors import ExtraError, SpecError
from funhooks.records.record import Record
from funhooks.specs.spec import Spec
from funhooks.specs.decoding import DECODING, Decoding

from ._core import Attached, Frame, Plan, scope
from .run import as_specs, check_model

__all__ = ["Generation", "GenerationStep", "generate", "iter_generate"]


@_frozen.frozen
@attrs.frozen(eq=False)
class GenerationStep:
    """One decode step: its number, the token it chose for each sequence, and its Record.

    ``step`` 0 is the prompt pass; ``token`` has shape ``(batch,)``; ``prompt`` is the
    prompt's length.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> gen = fh.generate(model, fh.outputs("transformer.h.0"), torch.tensor([[1, 2, 3]]),
        ...                   max_new_tokens=2, do_sample=False, pad_token_id=0, use_cache=False)
        >>> [tuple(s.new()["transformer.h.0"]["output"].shape) for s in gen.steps]
        [(1, 3, 8), (1, 1, 8)]
    """

    step: int
    token: torch.Tensor
    record: Record
    prompt: int

    def new(self, dim: int = 1) -> Record:
        """The Record keeping, along `dim` of every stored tensor, only the positions this step
        added: the prompt at step 0, then the one token fed in. The same with and without the
        KV cache.

        Raises:
            SpecError: for a stored tensor with fewer positions along `dim` than the step added.
        """
        added = self.prompt if self.step == 0 else 1

        def keep(t: torch.Tensor) -> torch.Tensor:
            if not -t.ndim <= dim < t.ndim or t.shape[dim] < added:
                raise SpecError(
                    f"GenerationStep.new: every stored tensor holds the {added} position(s) step {self.step} added "
                    f"along `dim` {dim}, got a tensor of shape {tuple(t.shape)}. Pass the `dim` of the positions, "
                    "or record only values that have one."
                )
            return t.narrow(dim, t.shape[dim] - added, added)

        return self.record.map(keep)


@_frozen.frozen
@attrs.frozen(eq=False)
class Generation:
    """What ``fh.generate`` returns: ``output`` (what ``model.generate`` returned) and
    ``steps``, one :class:`GenerationStep` per decode step.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> gen = fh.generate(model, fh.outputs("transformer.h.0"), torch.tensor([[1, 2, 3]]),
        ...                   max_new_tokens=2, do_sample=False, pad_token_id=0, use_cache=False)
        >>> gen.tokens.shape, len(gen.records)
        (torch.Size([1, 2]), 2)
    """

    output: Any
    steps: tuple[GenerationStep, ...]

    @property
    def tokens(self) -> torch.Tensor:
        """The new tokens, ``(batch, steps)``."""
        return torch.stack([s.token for s in self.steps], 1)

    @property
    def records(self) -> tuple[Record, ...]:
        """The Records of the steps, in step order."""
        return tuple(s.record for s in self.steps)


def _prompt_length(args: tuple, kwargs: dict[str, Any], caller: str) -> int:
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise SpecError(
            f"{caller}: the prompt is `input_ids`, a (batch, length) tensor given first or as `input_ids=`, got "
            f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else tuple(ids.shape)}. Pass the tokenized "
            "prompt."
        )
    return int(ids.shape[1])


def _checked(model: object, specs: Spec | Iterable[Spec], caller: str) -> tuple[nn.Module, Plan]:
    module = check_model(model, caller)
    if not callable(getattr(module, "generate", None)):
        raise SpecError(f"{caller}: `model` has a Hugging Face `generate` method, got {type(module).__name__}. "
                        "Pass a transformers model with a language-modelling head.")
    specs = as_specs(specs, caller)
    bad = next((s for s in specs if s.needs_backward or s.args), None)
    if bad is not None:
        raise SpecError(f"{caller}: generation runs forward only with the values in its specs, got {bad!r}. Leave "
                        "out backward-event specs and put values in the spec instead of `fh.arg`.")
    return module, Plan.get(module, specs, caller)


def _drive(model: nn.Module, plan: Plan, args: tuple, kwargs: dict[str, Any], caller: str,
           on_step: Callable[[GenerationStep], None]) -> Any:
    """Call ``model.generate`` inside a frame, handing each step to `on_step` as it ends."""
    try:
        import transformers
    except ImportError:
        raise ExtraError(f"{caller}: generation needs transformers, got it not installed. "
                         "Install the extra: pip install 'funhooks[hf]'.") from None
    prompt = _prompt_length(args, kwargs, caller)
    frame = Frame(plan, caller, values={DECODING: Decoding(0, prompt)})

    def cut(input_ids: torch.Tensor, scores: torch.Tensor, **_: object) -> torch.Tensor:
        at = cast(Decoding, frame.values[DECODING])  # set here only
        on_step(GenerationStep(at.step, input_ids[:, -1], frame.take(), prompt))
        frame.values[DECODING] = Decoding(at.step + 1, prompt)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    criteria = transformers.StoppingCriteriaList([*(kwargs.pop("stopping_criteria", None) or ()), cut])
    attached = Attached(plan, frame, copies=bool(frame.level))
    scope.enter(frame)
    try:
        output = model.generate(*args, stopping_criteria=criteria, **kwargs)  # type: ignore[operator]
    finally:
        scope.leave(frame)
        attached.detach()
        frame.close()
    frame.check()
    return output


def generate(model: nn.Module, specs: Spec | Iterable[Spec], *args: Any, **kwargs: Any) -> Generation:
    """Call ``model.generate(*args, **kwargs)`` with `specs` running, one Record per decode step.

    Args:
        model: a Hugging Face model with ``generate`` (greedy search or sampling).
        specs: a Spec or an iterable of forward-event Specs; an intervention's
            ``index=fh.steps(...)`` picks decode steps.
        *args, **kwargs: ``generate``'s own: ``input_ids`` (first, or by name),
            ``max_new_tokens``, ``do_sample``, ``use_cache``, ``stopping_criteria``...

    Returns:
        A :class:`Generation`: ``output``, ``steps``, ``tokens`` ``(batch, steps)``, ``records``.

    Raises:
        SpecError: for a model without ``generate``, a prompt that is not ``input_ids``,
            backward-event specs or ``fh.arg`` values. ExtraError without transformers.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> gen = fh.generate(model, fh.outputs("transformer.h.0"), torch.tensor([[1, 2, 3]]),
        ...                   max_new_tokens=3, do_sample=False, pad_token_id=0)
        >>> gen.tokens.shape, [tuple(r["transformer.h.0"]["output"].shape) for r in gen.records]
        (torch.Size([1, 3]), [(1, 3, 8), (1, 1, 8), (1, 1, 8)])
    """
    module, plan = _checked(model, specs, "generate")
    made: list[GenerationStep] = []
    output = _drive(module, plan, args, dict(kwargs), "generate", made.append)
    return Generation(output, tuple(made))


class _Closed(Exception):
    """Raised inside the worker's ``generate`` when the consumer closed the iterator."""


_DONE = object()
_GO, _STOP = object(), object()


def iter_generate(model: nn.Module, specs: Spec | Iterable[Spec], *args: Any,
                  **kwargs: Any) -> Iterator[GenerationStep]:
    """Like :func:`generate`, yielding each :class:`GenerationStep` as soon as it is made.

    ``generate`` runs in a worker thread that waits at each step until the next one is asked
    for; closing the iterator (``break``) ends the generation there, and an error in it is
    raised here.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> for step in fh.iter_generate(model, fh.outputs("transformer.h.0"), torch.tensor([[1, 2, 3]]),
        ...                              max_new_tokens=10, do_sample=False, pad_token_id=0):
        ...     if step.step == 1:
        ...         break
        >>> step.step, tuple(step.record["transformer.h.0"]["output"].shape)
        (1, (1, 1, 8))
    """
    module, plan = _checked(model, specs, "iter_generate")
    made: queue.Queue[object] = queue.Queue(maxsize=1)
    wanted: queue.Queue[object] = queue.Queue(maxsize=1)

    def hand_over(step: GenerationStep) -> None:
        made.put(step)
        if wanted.get() is _STOP:
            raise _Closed

    def work() -> None:
        try:
            _drive(module, plan, args, dict(kwargs), "iter_generate", hand_over)
        except _Closed:
            return
        except BaseException as error:  # noqa: BLE001  # handed to the consumer, raised there
            made.put(error)
            return
        made.put(_DONE)

    return _consume(threading.Thread(target=contextvars.copy_context().run, args=(work,), daemon=True),
                    made, wanted)


def _consume(worker: threading.Thread, made: queue.Queue[object], wanted: queue.Queue[object]) -> Iterator[GenerationStep]:
    worker.start()
    try:
        while True:
            item = made.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield cast(GenerationStep, item)  # the worker puts nothing else
            wanted.put(_GO)
    finally:
        if worker.is_alive():
            wanted.put(_STOP)
        worker.join()
