"""Optimizer watches: what a reducer reads around each optimizer step.

Specs see module calls; some statistics live elsewhere: the gradients the optimizer is about
to apply (accumulated over micro-batches, unscaled by a ``GradScaler``, clipped), and the
parameters before and after its update. An :class:`OptimizerWatch` names the layers it reads
(a selector) and two functions: ``before(layers)`` runs just before the optimizer updates the
parameters, ``after(layers, carry)`` just after, with what ``before`` returned. The value
(``after``'s, or ``before``'s alone) maps layer paths to values, stored in the step's Record
under the watch's name, one call per optimizer step, next to what the specs stored.

A reducer lists its watches in an optional ``watches`` member; ``fh.fit``, ``fh.folding`` and
the Lightning and Hugging Face callbacks attach the union of them to the optimizers for the
duration of each recorded step, as they do the specs. Attaching registers a step pre-hook and
a step post-hook on each optimizer (``Optimizer.register_step_pre_hook``), removed when the
step ends; nothing is put on the model. An update the optimizer skips (a ``GradScaler`` that
found an inf) stores nothing. Under Lightning, ``before`` runs in ``on_before_optimizer_step``
(Lightning calls the training step inside ``optimizer.step``, after the pre-hooks).

Cost: per recorded step, two hook registrations per optimizer, a check that no module or param
group was added or removed (one list comparison of the children tables, a few µs for a hundred
modules; the layers are found again only when something was), and whatever the functions
cost; nothing when no reducer has watches. The watched layers are resolved once per model
and kept while its structure is the same: a run checks that with one walk over the modules
and their parameters (well under 1 µs each).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar

import attrs
import torch
from torch import nn

from funhooks import _frozen, _torch
from funhooks.errors import HookError, LoopError, SelectorError, SpecError
from funhooks.specs.selector import Selector, resolve, select

from ._one_step import Optimizers

__all__ = ["Layers", "OptimizerWatch", "Stored", "Watching", "as_watches", "optimizers"]

T = TypeVar("T")

Stored: TypeAlias = list[tuple[str, Mapping[str, object]]]
"""What the watches stored, in the order they stored it: per watch and optimizer step, the
watch's record name and its ``{path: value}`` mapping (made into a Record's nodes once, when
the step's Record is built)."""


@_frozen.frozen
@attrs.frozen(eq=False)
class Layers:
    """The layers an optimizer watch reads at one optimizer step.

    Attributes:
        optimizer: the optimizer stepping (the innermost ``torch.optim.Optimizer``).
        paths: the layers' module paths, in module order: those of the watch's selector whose
            own parameters (``recurse=False``) this optimizer updates.
        params: per layer, its own parameters that this optimizer updates.
    """

    optimizer: torch.optim.Optimizer
    paths: tuple[str, ...]
    params: tuple[tuple[torch.Tensor, ...], ...]
    cache: dict[Hashable, Any] = attrs.field(factory=dict, repr=False)
    """Scratch space for the watch functions (e.g. a stacking plan), kept while these layers are."""


def _check_fn(instance: object, attribute: attrs.Attribute[T], fn: T) -> None:
    if fn is not None and not callable(fn):
        raise SpecError(f"OptimizerWatch: `{attribute.name}` is a callable, got {fn!r}. Pass a function.")


def _check_name(instance: object, attribute: attrs.Attribute[T], name: T) -> None:
    if not isinstance(name, str) or not name:
        raise SpecError(f"OptimizerWatch: `name` is a non-empty str, got {name!r}. Name what the watch stores.")


@_frozen.frozen
@attrs.frozen
class OptimizerWatch:
    """What to read around each optimizer step, as a frozen value.

    Args:
        where: the layers (any selector); a layer is read for the parameters of its own that
            the stepping optimizer updates.
        before: ``before(layers) -> carry``, called with a :class:`Layers` just before the
            update (gradients final, parameters old), under ``torch.no_grad()``.
        after: ``after(layers, carry) -> {path: value}``, called just after the update
            (parameters new); None: ``before`` returns the ``{path: value}`` mapping itself.
        name: the record name the values are stored under.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> def grad_norms(layers):
        ...     return {p: torch.stack([q.grad.norm() for q in ps]).norm() for p, ps in zip(layers.paths, layers.params)}
        >>> watch = fh.OptimizerWatch(nn.Linear, grad_norms, name="grad_norm")
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> batches = [(torch.randn(4, 2), torch.randn(4, 1))] * 2
        >>> steps = list(fh.train(model, batches, nn.functional.mse_loss, opt, watches=watch))
        >>> list(steps[0].record), steps[0].record["2"]["grad_norm"].shape
        (['0', '2'], torch.Size([]))
    """

    where: Selector = attrs.field(converter=select)
    before: Callable[[Layers], Any] = attrs.field(validator=_check_fn)
    after: Callable[[Layers, Any], Mapping[str, Any]] | None = attrs.field(default=None, validator=_check_fn)
    name: str = attrs.field(kw_only=True, validator=_check_name)


def as_watches(watches: OptimizerWatch | Iterable[OptimizerWatch], caller: str) -> tuple[OptimizerWatch, ...]:
    """`watches` as a tuple, equal ones once."""
    items = (watches,) if isinstance(watches, OptimizerWatch) else tuple(watches)
    bad = next((w for w in items if not isinstance(w, OptimizerWatch)), None)
    if bad is not None:
        raise SpecError(f"{caller}: `watches` is an OptimizerWatch or an iterable of them, got {bad!r}. "
                        "Build them with fh.OptimizerWatch(where, before, after=None, name=...).")
    return tuple(dict.fromkeys(items))


def optimizers(opt: Optimizers | None, caller: str) -> tuple[torch.optim.Optimizer, ...]:
    """`opt` (an optimizer, a wrapper of one, or a list of them) as the innermost optimizers."""
    found = []
    for o in (opt if isinstance(opt, (list, tuple)) else [opt]):
        while not isinstance(o, torch.optim.Optimizer) or isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer):
            inner = getattr(o, "optimizer", None)  # accelerate's AcceleratedOptimizer, wrappers alike
            if inner is None:
                raise LoopError(
                    f"{caller}: optimizer watches need a `torch.optim.Optimizer` (or a wrapper with `.optimizer`), "
                    f"got {type(o).__name__}. Pass the optimizer your training step calls as `opt=`."
                )
            o = inner
        found.append(o)
    return tuple(dict.fromkeys(found))


class _Handle(Protocol):
    """What registering an optimizer hook returns."""

    def remove(self) -> None: ...


class Watching:
    """Optimizer watches attached for one step at a time; what they stored, by path."""

    __slots__ = ("caller", "carries", "current", "data", "handles", "manual", "model", "opts", "owner", "resolved",
                 "seen", "watches", "wheres")

    def __init__(self, model: nn.Module, watches: tuple[OptimizerWatch, ...], opts: tuple[torch.optim.Optimizer, ...],
                 caller: str, *, manual_before: bool = False) -> None:
        """Resolve the watches' layers on `model` now (selectors that match nothing raise); each
        :meth:`attach` finds them again if the model changed since (layers added mid-training are
        watched from then on; a selector that matches nothing any more reads no layer).

        Args: `manual_before`: do not register pre-hooks; the caller calls :meth:`before`
        (Lightning, whose optimizer runs the training step after its pre-hooks).
        """
        self.caller, self.watches, self.opts, self.manual, self.model = caller, watches, opts, manual_before, model
        self.wheres = tuple(dict.fromkeys(w.where for w in watches))
        self.resolved = _Resolved.get(model, self.wheres, caller, watches)
        self.seen = _Seen.of(model, opts)
        for watch in watches:
            if opts and all(self.resolved.layers(opt, watch.where) is None for opt in opts):
                raise LoopError(
                    f"{caller}: an optimizer watch reads the layers whose parameters the optimizer updates, got "
                    f"optimizers holding none of those of {watch!r}. Pass the optimizer of this model's parameters."
                )
        self.carries: dict[tuple[int, int], Any] = {}
        self.data: Stored = []
        self.handles: list[_Handle] = []
        self.current: dict[int, list[Layers | None]] = {}
        self.owner: int | None = None  # the thread whose optimizer steps are read; None: paused

    def _layers(self, opt: torch.optim.Optimizer) -> list[Layers | None]:
        """Per watch, its layers for `opt` (None: none of them)."""
        return [self.resolved.layers(opt, watch.where) for watch in self.watches]

    def attach(self, *, same: bool = False) -> None:
        """Register the hooks on every optimizer, for the calling thread, on the layers of the
        model as it is now; `same`: the caller saw that no module was added, removed or
        replaced since the last attach, so only the param groups are compared."""
        self.owner = threading.get_ident()
        if not (self.seen.groups == _groups(self.opts) if same else self.seen.holds(self.opts)):  # something added or removed
            self.resolved = _Resolved.get(self.model, self.wheres, self.caller, self.watches, strict=False)
            self.seen = _Seen.of(self.model, self.opts)
            self.current = {}
        if not self.current:  # else the last step's layers: nothing they depend on changed
            self.current = {id(opt): self._layers(opt) for opt in self.opts}
        if self.handles:  # kept registered while paused (:meth:`pause`)
            return
        try:
            for opt in self.opts:
                if not self.manual:
                    self.handles.append(opt.register_step_pre_hook(self._pre))
                self.handles.append(opt.register_step_post_hook(self._post))
        except BaseException:
            self.detach()
            raise

    def pause(self) -> None:
        """Read no optimizer step until :meth:`attach`, the hooks left registered (``fh.fit``,
        whose steps follow each other with nothing but the reducers between them, spares two
        registrations and two removals per optimizer per step); forget carries of updates that
        never happened."""
        self.owner = None
        self.carries.clear()

    def detach(self) -> None:
        """Remove the hooks; forget carries of updates that never happened."""
        self.owner = None
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.carries.clear()

    def _pre(self, opt: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if threading.get_ident() == self.owner:
            self.before(opt)

    def _post(self, opt: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if threading.get_ident() == self.owner:
            self.after(opt)

    def before(self, opt: torch.optim.Optimizer) -> None:
        """Run every watch's ``before`` for `opt`'s layers (gradients final, parameters old)."""
        if id(opt) not in self.current:
            opt = optimizers(opt, self.caller)[0]
        with torch.no_grad():
            for i, (watch, layers) in enumerate(zip(self.watches, self.current.get(id(opt)) or self._layers(opt))):
                if layers is not None:
                    self.carries[i, id(opt)] = self._call(watch, watch.before, layers)

    def after(self, opt: torch.optim.Optimizer) -> None:
        """Run every watch's ``after`` for `opt` and store the values (parameters new)."""
        with torch.no_grad():
            for i, (watch, layers) in enumerate(zip(self.watches, self.current.get(id(opt)) or self._layers(opt))):
                if layers is None or (i, id(opt)) not in self.carries:
                    continue
                carry = self.carries.pop((i, id(opt)))
                values = carry if watch.after is None else self._call(watch, watch.after, layers, carry)
                self.data.append((watch.name, values))

    def _call(self, watch: OptimizerWatch, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` (under the caller's ``torch.no_grad()``), its errors named after `watch`."""
        try:
            return fn(*args)
        except HookError:
            raise
        except Exception as err:
            raise HookError(
                f"{self.caller}: the function of {watch!r} raised {type(err).__name__} at an optimizer step: {err}. "
                "Fix the function; the optimizer's hooks were removed."
            ) from err

    @property
    def order(self) -> dict[str, tuple[int, int]]:
        """The key of each module's path in the model's module order (see :meth:`key`)."""
        return self.resolved.order

    def key(self, path: str) -> tuple[int, int]:
        """Where `path` comes in the model's module order (a parameter's path: just after its module's)."""
        order = self.resolved.order
        key = order.get(path)
        if key is None:
            key = order[path] = (order.get(path.rpartition(".")[0], (len(order), 0))[0], 1)
        return key

    def take(self) -> Stored:
        """What the watches stored since the last take; starts afresh."""
        data, self.data = self.data, []
        return data


_Found: TypeAlias = tuple[tuple[str, ...], tuple[tuple[torch.Tensor, ...], ...], dict[Hashable, Any]]
"""A :class:`Layers` but its optimizer: the paths, their parameters and the cache."""


class _Known(NamedTuple):
    """The layers an optimizer updates, as found for its param groups."""

    opt: weakref.ref[torch.optim.Optimizer]
    groups: tuple[tuple[int, int], ...]
    found: _Found | None


class _Resolved:
    """The layers of a model's watch selectors, kept between runs while the model's structure
    (its modules, their names, their own parameters, which of those require grad, their
    shapes, dtypes and devices) is what it was; per optimizer, the layers it updates and
    their ``cache`` (kept while its param groups are), so that the watch functions' caches
    (stacking plans) last from run to run; and the model's module order."""

    __slots__ = ("by_opt", "found", "held", "order", "partial", "shape")

    _CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Selector, ...], _Resolved]] = weakref.WeakKeyDictionary()
    _PER_MODEL = 8
    _LOCK = threading.Lock()

    def __init__(self, found: dict[Selector, list[tuple[str, tuple[torch.Tensor, ...]]]], shape: list[object],
                 held: list[nn.Parameter | None], order: dict[str, tuple[int, int]]) -> None:
        self.found, self.shape, self.held, self.order = found, shape, held, order
        self.partial = False  # some selector matched no module (a layer left mid-training)
        self.by_opt: dict[tuple[int, Selector], _Known] = {}

    @classmethod
    def get(cls, model: nn.Module, wheres: tuple[Selector, ...], caller: str,
            watches: tuple[OptimizerWatch, ...], *, strict: bool = True) -> _Resolved:
        """The layers of `wheres` on `model`: cached, or resolved now (a selector that matches
        nothing raises, naming its watch; with ``strict=False`` it has no layers)."""
        shape, held = _shape(model)
        with cls._LOCK:
            known = cls._CACHE.get(model, {}).get(wheres)
        if known is not None and known.shape == shape and not (strict and known.partial):
            return known
        found: dict[Selector, list[tuple[str, tuple[torch.Tensor, ...]]]] = {}
        partial = False
        for where in wheres:
            watch = next(w for w in watches if w.where == where)
            try:
                pairs = resolve(where, model, caller=caller, spec=watch)
            except SelectorError:
                if strict:
                    raise
                pairs, partial = (), True
            layers = [(p, tuple(q for q in m.parameters(recurse=False) if q.requires_grad)) for p, m in pairs]
            found[where] = [(p, ps) for p, ps in layers if ps]
        made = cls(found, shape, held, {p: (i, 0) for i, (p, _) in enumerate(_torch.named_modules(model))})
        made.partial = partial
        with cls._LOCK:
            cache = cls._CACHE.setdefault(model, {})
            if len(cache) >= cls._PER_MODEL and wheres not in cache:
                cache.pop(next(iter(cache)))
            cache[wheres] = made
        return made

    def layers(self, opt: torch.optim.Optimizer, where: Selector) -> Layers | None:
        """The layers of `where` whose parameters `opt` updates (None: none), sharing their
        ``cache`` with earlier steps; found again when `opt`'s param groups change. The
        optimizer itself is held weakly: it is freed when its user drops it."""
        groups = tuple((id(g["params"]), len(g["params"])) for g in opt.param_groups)
        known = self.by_opt.get((id(opt), where))
        if known is None or known.opt() is not opt or known.groups != groups:
            ids = {id(q) for g in opt.param_groups for q in g["params"]}
            kept = [(p, tuple(q for q in ps if id(q) in ids)) for p, ps in self.found[where]]
            kept = [(p, ps) for p, ps in kept if ps]
            layers: _Found = (tuple(p for p, _ in kept), tuple(ps for _, ps in kept), {})
            known = _Known(weakref.ref(opt), groups, layers if kept else None)
            self.by_opt = {k: v for k, v in self.by_opt.items() if v.opt() is not None}
            self.by_opt[id(opt), where] = known
        found = known.found
        return None if found is None else Layers(opt, *found)


class _Seen(NamedTuple):
    """What a step checks before reusing the watches' layers: every module's table of children
    and the optimizers' param groups. Tables are compared as copies, in one list comparison (C
    speed: a few µs for a hundred modules), where finding the layers again walks every
    parameter too."""

    tables: list[dict[str, nn.Module | None]]
    copies: list[dict[str, nn.Module | None]]
    groups: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, model: nn.Module, opts: tuple[torch.optim.Optimizer, ...]) -> _Seen:
        tables = [_torch.children(m) for m in _torch.walk(model)]
        return cls(tables, [dict(t) for t in tables], _groups(opts))

    def holds(self, opts: tuple[torch.optim.Optimizer, ...]) -> bool:
        return self.tables == self.copies and self.groups == _groups(opts)


def _groups(opts: tuple[torch.optim.Optimizer, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((id(g["params"]), len(g["params"])) for opt in opts for g in opt.param_groups)


def _shape(model: nn.Module) -> tuple[list[object], list[nn.Parameter | None]]:
    """What the watches' layers and their stacking plans depend on: every module (a plain
    walk, as a weak reference: two compare equal while they name one live module), its
    children's names, its own parameters (by id), their ``requires_grad``, shape, dtype and
    device (``param.data = ...`` changes them in place); and the parameters, which the cache
    holds so that no id is reused while it is compared."""
    out: list[object] = []
    held: list[nn.Parameter | None] = []
    stack = [model]
    while stack:
        module = stack.pop()
        out.append(weakref.ref(module))
        for name, child in _torch.children(module).items():
            out.append(name)
            if child is not None:
                stack.append(child)
        for name, param in _torch.own_parameters(module).items():
            held.append(param)
            out += (name, id(param)) if param is None else (name, id(param), param.requires_grad, param.shape,
                                                            param.dtype, param.device)
    return out, held
