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
after each step's token is chosen, takes the step's Record and moves to the next step. A
forward pre-hook on the model, there for the call only, reads each forward's positions (the
cache's length and the input's), which ``fh.steps`` edits by: with ``prefill_chunk_size`` the
prompt pass is one forward per chunk, and step 0's Record holds one call per chunk.
Greedy search and sampling (seed the global generator, ``torch.manual_seed``, as for a
plain ``generate``) make one forward per token; beam search, assisted decoding and the other
modes make other calls, and are refused before anything runs. An intervention whose
``fh.steps`` start after the last step made raises at the end, as an op spec that took no op
does.

Cost: what a ``with_hooks`` block costs for the call, plus building one Record per step and
reading each forward's positions. ``iter_generate`` runs ``generate`` in a worker thread (in
a copy of the caller's ``contextvars`` context, so runs open around it see it) that waits for
the consumer at every step, with nothing attached to the model while it waits; thread-local
torch state (autocast) is not carried over.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import attrs
import torch
from torch import nn

from funhooks import _frozen, _html
from funhooks.errors import ExtraError, InterventionError, SpecError
from funhooks.records.record import Record
from funhooks.specs.spec import Spec
from funhooks.specs.decoding import DECODING, Decoding, Steps

from ._core import Attached, Frame, Plan, scope
from .run import as_specs, check_model

__all__ = ["Generation", "GenerationIterator", "GenerationStep", "generate", "iter_generate"]


@_frozen.frozen
@attrs.frozen(eq=False)
class GenerationStep:
    """One decode step: its number, the token it chose for each sequence, and its Record.

    ``step`` 0 is the prompt pass; ``token`` has shape ``(batch,)``; ``prompt`` is the
    prompt's length; ``calls`` the number of forward calls the step made (1, or at step 0
    with ``prefill_chunk_size`` one per chunk of the prompt, each a call in the Record).

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
    calls: int = 1

    def new(self, dim: int = 1) -> Record:
        """The Record keeping, along `dim` of every stored tensor, only the positions this step
        added: the prompt at step 0, then the one token fed in. The same with and without the
        KV cache; with a chunked prompt pass every position of step 0's calls is the prompt's,
        and each is kept.

        Raises:
            SpecError: for a stored tensor with fewer positions along `dim` than the step added.
        """
        added = self.prompt if self.step == 0 else 1
        chunked = self.calls > 1  # the prompt pass in chunks: each call holds a part of the prompt

        def keep(t: torch.Tensor) -> torch.Tensor:
            if chunked and -t.ndim <= dim < t.ndim:
                return t.narrow(dim, max(t.shape[dim] - added, 0), min(t.shape[dim], added))
            if not -t.ndim <= dim < t.ndim or t.shape[dim] < added:
                raise SpecError(
                    f"GenerationStep.new: every stored tensor holds the {added} position(s) step {self.step} added "
                    f"along `dim` {dim}, got a tensor of shape {tuple(t.shape)}. Pass the `dim` of the positions, "
                    "or record only values that have one."
                )
            return t.narrow(dim, t.shape[dim] - added, added)

        return self.record.map(keep)

    def __repr__(self) -> str:
        return (f"GenerationStep(step={self.step}, token=Tensor{tuple(self.token.shape)}, "
                f"record=<{len(self.record)} module(s)>, prompt={self.prompt}, calls={self.calls})")


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

    def __repr__(self) -> str:
        batch = tuple(self.steps[0].token.shape) if self.steps else ()
        return f"Generation(steps={len(self.steps)}, tokens=Tensor{(*batch, len(self.steps))})"

    def html(self, *, vocab: _html.Vocab = None) -> _html.Html:
        """The tokens step by step as an HTML table: one row per decode step (0: the prompt
        pass), one column per sequence (the first 8), then the step's calls and what its Record
        holds. `vocab` writes token ids (a list of strings indexed by id, or a function such as
        ``tokenizer.decode``); None: the ids. Only the tokens reach the host."""
        batch = self.steps[0].token.numel() if self.steps else 0
        shown = min(batch, _SHOWN_SEQUENCES)
        header = ["step", *(f"sequence {b}" for b in range(shown)), "calls", "record"]
        rows = [[str(s.step), *(_html.label(t, vocab) for t in s.token.reshape(-1)[:shown].tolist()), str(s.calls),
                 f"{len(s.record)} module(s)"] for s in self.steps[: _html.MAX_ROWS]]
        caption = f"Generation: {len(self.steps)} step(s)" + (f", {batch} sequences" if batch > shown else "")
        return _html.table(header, rows, caption=caption, total=len(self.steps), row_header=True)

    def _repr_html_(self) -> str:
        return self.html()


_SHOWN_SEQUENCES = 8  # a generation's display shows the tokens of the first sequences


def _prompt_length(args: tuple, kwargs: dict[str, Any], caller: str) -> int:
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise SpecError(
            f"{caller}: the prompt is `input_ids`, a (batch, length) tensor given first or as `input_ids=`, got "
            f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else tuple(ids.shape)}. Pass the tokenized "
            "prompt."
        )
    return int(ids.shape[1])


_NUMBERED = ("greedy_search", "sample")
"""The generation modes that make one forward per new token, which steps number."""


def _mode(model: nn.Module, args: tuple, kwargs: dict[str, Any], caller: str) -> None:
    """Refuse, before anything runs, a generation mode that does not make one forward per new
    token (beam search, assisted decoding...): its steps would be misnumbered."""
    if kwargs.get("custom_generate") is not None:
        raise SpecError(f"{caller}: steps are the forwards of greedy search or sampling, one per new token, got "
                        f"custom_generate={kwargs['custom_generate']!r}, which makes calls of its own. Leave "
                        "`custom_generate` out, or call `model.generate` inside `fh.with_hooks` for one Record of "
                        "all its calls.")
    given = kwargs.get("generation_config", args[1] if len(args) > 1 else None)  # generate(inputs, config, ...)
    config = given or getattr(model, "generation_config", None)
    if config is None or not callable(getattr(config, "get_generation_mode", None)):
        return
    config = copy.deepcopy(config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    mode = str(getattr(config.get_generation_mode(kwargs.get("assistant_model")), "value", ""))
    if mode and mode not in _NUMBERED:
        settings = {k: getattr(config, k, None) for k in ("num_beams", "num_beam_groups", "penalty_alpha",
                                                          "prompt_lookup_num_tokens", "dola_layers")}
        shown = ", ".join(f"{k}={v!r}" for k, v in settings.items() if v not in (None, 1, 0.0))
        if kwargs.get("assistant_model") is not None:
            shown = ", ".join(filter(None, ["assistant_model=...", shown]))
        raise SpecError(f"{caller}: steps are the forwards of greedy search or sampling, one per new token, got "
                        f"{mode.replace('_', ' ')}{f' ({shown})' if shown else ''}, which makes other calls and "
                        "returns other shapes. Generate with num_beams=1 and no assistant, or call "
                        "`model.generate` inside `fh.with_hooks` for one Record of all its calls.")


def _checked(model: object, specs: Spec | Iterable[Spec], caller: str, args: tuple,
             kwargs: dict[str, Any]) -> tuple[nn.Module, Plan, tuple[Spec, ...]]:
    module = check_model(model, caller)
    if not callable(getattr(module, "generate", None)):
        raise SpecError(f"{caller}: `model` has a Hugging Face `generate` method, got {type(module).__name__}. "
                        "Pass a transformers model with a language-modelling head.")
    specs = as_specs(specs, caller)
    bad = next((s for s in specs if s.needs_backward or s.args), None)
    if bad is not None:
        raise SpecError(f"{caller}: generation runs forward only with the values in its specs, got {bad!r}. Leave "
                        "out backward-event specs and put values in the spec instead of `fh.arg`.")
    _mode(module, args, kwargs, caller)
    return module, Plan.get(module, specs, caller), specs


def _end(args: tuple, kwargs: dict[str, Any], fallback: int) -> int:
    """The position after the last one a forward sees: from its ``cache_position`` (older
    transformers), else the cache's length plus the input's; `fallback` (the sequence so far)
    where the call shows neither."""
    position = kwargs.get("cache_position")
    if isinstance(position, torch.Tensor) and position.numel():
        return int(position[-1]) + 1
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor):
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.ndim < 2:
        return fallback
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    length = getattr(cache, "get_seq_length", None)
    return (int(length()) if callable(length) else 0) + int(ids.shape[1])


class _Cursor:
    """Where the generation is, written into the frame's per-call values before each forward
    (a forward pre-hook on the model) and at each step's end."""

    def __init__(self, frame: Frame, prompt: int) -> None:
        self.frame, self.prompt, self.step, self.calls = frame, prompt, 0, 0
        frame.values[DECODING] = Decoding(0, prompt, prompt)

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.calls += 1
        end = _end(args, kwargs, self.prompt + self.step)
        self.frame.values[DECODING] = Decoding(self.step, self.prompt, end)

    def next(self) -> int:
        """Move to the next step; the number of forwards the step made."""
        calls, self.calls, self.step = self.calls, 0, self.step + 1
        return calls


class _Hooks:
    """The generation's hooks on the model: the plan's and the positions' pre-hook. Off while
    ``iter_generate``'s consumer holds a step, so a suspended iterator leaves the model bare."""

    def __init__(self, module: nn.Module, plan: Plan, frame: Frame, cursor: _Cursor) -> None:
        self.module, self.plan, self.frame, self.cursor = module, plan, frame, cursor
        self.attached: Attached | None = None
        self.handle: Any = None
        self.on()

    def on(self) -> None:
        self.attached = Attached(self.plan, self.frame, copies=bool(self.frame.level))  # takes itself off if it fails
        self.handle = self.module.register_forward_pre_hook(self.cursor.before, with_kwargs=True)

    def off(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.attached is not None:
            self.attached.detach()
            self.attached = None


def _steps_of(spec: Spec) -> Steps | None:
    """The ``fh.steps`` an intervention spec edits at, on a module or an op (None for the
    others): its intervention value, or its op action's."""
    if spec.role not in ("intervene", "op"):
        return None
    for held in (getattr(spec, "action", None), spec.fn):  # where a spec keeps what it does
        for value in (held, getattr(held, "intervention", None), getattr(held, "fn", None)):
            index = getattr(value, "index", None)
            if isinstance(index, Steps):
                return index
    return None


def _unreached(specs: tuple[Spec, ...], made: int, caller: str) -> None:
    """Raise for an intervention whose ``fh.steps`` start at or after the `made` steps."""
    for spec in specs:
        index = _steps_of(spec)
        if index is not None and index.start >= made:
            raise InterventionError(
                f"{caller}: `index={index!r}` addresses decode steps that came, got a generation of {made} step(s) "
                f"(0 to {made - 1}) for {spec!r}, which edited nothing. Address steps below {made}, or generate "
                "more tokens (`max_new_tokens`, no early `eos_token_id`)."
            )


def _drive(model: nn.Module, plan: Plan, specs: tuple[Spec, ...], args: tuple, kwargs: dict[str, Any],
           caller: str, on_step: Callable[[GenerationStep], None], *, pause: bool = False) -> Any:
    """Call ``model.generate`` inside a frame, handing each step to `on_step` as it ends (with
    `pause`, with the hooks off while `on_step` runs)."""
    try:
        import transformers
    except ImportError:
        raise ExtraError(f"{caller}: generation needs transformers, got it not installed. "
                         "Install the extra: pip install 'funhooks[hf]'.") from None
    prompt = _prompt_length(args, kwargs, caller)
    frame = Frame(plan, caller)
    cursor = _Cursor(frame, prompt)
    made = 0

    def cut(input_ids: torch.Tensor, scores: torch.Tensor, **_: object) -> torch.Tensor:
        nonlocal made
        step, record = cursor.step, frame.take()
        calls = cursor.next()
        made += 1
        if pause:
            hooks.off()
            on_step(GenerationStep(step, input_ids[:, -1], record, prompt, calls))
            hooks.on()
        else:
            on_step(GenerationStep(step, input_ids[:, -1], record, prompt, calls))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    criteria = transformers.StoppingCriteriaList([*(kwargs.pop("stopping_criteria", None) or ()), cut])
    hooks = _Hooks(model, plan, frame, cursor)
    scope.enter(frame)
    try:
        output = model.generate(*args, stopping_criteria=criteria, **kwargs)  # type: ignore[operator]
    finally:
        scope.leave(frame)
        hooks.off()
        frame.close()
    frame.check()
    _unreached(specs, made, caller)
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
        SpecError: before anything runs, for a model without ``generate``, a prompt that is
            not ``input_ids``, backward-event specs, ``fh.arg`` values, or a generation mode
            other than greedy search and sampling (beam search, assisted decoding,
            ``custom_generate``...). ExtraError without transformers.
        InterventionError: at the end, for an ``index=fh.steps(k, ...)`` with `k` at or after
            the last step made (it edited nothing).

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> gen = fh.generate(model, fh.outputs("transformer.h.0"), torch.tensor([[1, 2, 3]]),
        ...                   max_new_tokens=3, do_sample=False, pad_token_id=0)
        >>> gen.tokens.shape, [tuple(r["transformer.h.0"]["output"].shape) for r in gen.records]
        (torch.Size([1, 3]), [(1, 3, 8), (1, 1, 8), (1, 1, 8)])
    """
    module, plan, specs = _checked(model, specs, "generate", args, kwargs)
    made: list[GenerationStep] = []
    output = _drive(module, plan, specs, args, dict(kwargs), "generate", made.append)
    return Generation(output, tuple(made))


class _Closed(Exception):
    """Raised inside the worker's ``generate`` when the consumer closed the iterator."""


_DONE = object()
_GO, _STOP = object(), object()


class _Channel:
    """The two one-item queues between the consumer and the worker running ``generate``."""

    def __init__(self) -> None:
        self.made: queue.Queue[object] = queue.Queue(maxsize=1)
        self.wanted: queue.Queue[object] = queue.Queue(maxsize=1)

    def serve(self, work: Callable[[Callable[[GenerationStep], None]], None]) -> None:
        """The worker: `work` hands each step over and waits for the next request."""
        try:
            work(self.hand_over)
        except _Closed:
            return
        except BaseException as error:  # noqa: BLE001  # handed to the consumer, raised there
            self.made.put(error)
            return
        self.made.put(_DONE)

    def hand_over(self, step: GenerationStep) -> None:
        self.made.put(step)
        if self.wanted.get() is _STOP:
            raise _Closed


class GenerationIterator(Iterator[GenerationStep]):
    """What :func:`iter_generate` returns: an iterator of :class:`GenerationStep` that is also
    a context manager. ``close()`` (or leaving a ``with`` block, or the iterator being freed)
    ends the generation where it is; while the consumer holds a step nothing is attached to the
    model, so a suspended or abandoned iterator leaves the model as it was.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> with fh.iter_generate(model, (), torch.tensor([[1, 2, 3]]), max_new_tokens=10, do_sample=False,
        ...                       pad_token_id=0) as steps:
        ...     first = next(steps)
        >>> first.step, steps.closed
        (0, True)
    """

    def __init__(self, work: Callable[[Callable[[GenerationStep], None]], None]) -> None:
        self._channel = _Channel()
        # the worker holds the channel, never the iterator: a named iterator is freed (and closed)
        # when its last name goes, while the worker waits
        self._worker = threading.Thread(target=contextvars.copy_context().run, args=(self._channel.serve, work),
                                        daemon=True)
        self._started = False
        self.closed = False
        """True once the generation has ended: run out, raised, or closed."""

    def __iter__(self) -> GenerationIterator:
        return self

    def __next__(self) -> GenerationStep:
        if self.closed:
            raise StopIteration
        if self._started:
            self._channel.wanted.put(_GO)
        else:
            self._started = True
            self._worker.start()
        item = self._channel.made.get()
        if item is _DONE or isinstance(item, BaseException):
            self.closed = True
            self._worker.join()
            if item is _DONE:
                raise StopIteration
            raise cast(BaseException, item)
        return cast(GenerationStep, item)  # the worker puts nothing else

    def close(self) -> None:
        """End the generation where it is (the worker's ``generate`` stops at this step)."""
        if self.closed:
            return
        self.closed = True
        if self._started and self._worker.is_alive():
            self._channel.wanted.put(_STOP)
            self._worker.join()

    def __enter__(self) -> GenerationIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "closed", True):
            return
        if sys.is_finalizing():  # the worker may never run again: ask it to stop, wait for nothing
            self.closed = True
            if self._started:
                with contextlib.suppress(queue.Full):
                    self._channel.wanted.put_nowait(_STOP)
            return
        self.close()


def iter_generate(model: nn.Module, specs: Spec | Iterable[Spec], *args: Any,
                  **kwargs: Any) -> GenerationIterator:
    """Like :func:`generate`, yielding each :class:`GenerationStep` as soon as it is made.

    ``generate`` runs in a worker thread that waits at each step until the next one is asked
    for, with nothing attached to the model while it waits. Leaving a ``for`` loop over the
    call itself ends the generation there; an iterator kept in a name ends it when closed:
    ``with fh.iter_generate(...) as steps:`` (or ``steps.close()``), at the latest when it is
    freed. An error in the generation is raised here.

    Raises:
        SpecError: as :func:`generate` does, when called (before anything runs).

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
    module, plan, specs = _checked(model, specs, "iter_generate", args, kwargs)

    def work(hand_over: Callable[[GenerationStep], None]) -> None:
        _drive(module, plan, specs, args, dict(kwargs), "iter_generate", hand_over, pause=True)

    return GenerationIterator(work)
