"""Plans: specs resolved against one model, built once and reused run after run.

A plan walks the model once (wrappers looked through: ``module.`` of DDP/DataParallel,
``_orig_mod.`` of ``torch.compile``), resolves every spec's selector, and keeps per hooked
module a ``Hooked`` table of entries and the ``Forward`` that will wrap it; modules inside a
``torch.compile`` wrapper, or inside a module compiled in place (``module.compile()``), are
recorded by that compiled module's compiled recorder instead. A
``param_grad`` spec hooks parameters, except FSDP2-sharded ones (``DTensor`` parameters under
an ``FSDPModule``), which the forward of the FSDP module managing them watches (``sharded``).
Everything is validated here, before anything is attached: selectors must match, record
names must not clash, a spec may not select only containers that never run.

Plans are cached per model (held weakly) and spec tuple while the model's structure is what it
was (every ``_modules`` dict holds the same children, so ``ModuleList.insert``/``del``/``pop``
and attribute assignment are seen, and so is the replacement of a parameter a ``param_grad``
spec watches, as ``fully_shard`` does, and a module compiled in place with ``module.compile()``
since).

NOTE [where plans are cached]: a plan keeps its specs, and with them every value they hold, so
no cache may keep a plan longer than the user keeps those values. The plans of specs holding
no value of the user's are kept in one table by model (held weakly), found again by equal
specs. A spec holding a tensor (a patch value, a steering vector, a Record, a tensor its
function closes over) or reaching the model (a function closing over it) would be kept alive
by that table: its plan lives only as long as its run or capture function, except the plan of
an intervention (compared by identity, and so found again only through the same spec object),
which is kept in the ``memo`` of the intervention's own spec, by model (held weakly): reusing
the spec reuses the plan, and dropping the spec drops it, unless a spec reaches the model,
which the memo would then keep alive as long as the spec.

Cost: building walks the model once (a few µs per module, linear in the model: the garbage
collector is paused meanwhile, see ``_CollectorPause``); reusing compares each module's
children and compiled call (about 0.1 µs per module).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import weakref
from collections.abc import Container, Iterable, Mapping
from typing import NamedTuple, cast

import attrs
import torch
from torch import nn
from torch.nn.utils import parametrize

from funhooks import _torch
from funhooks.errors import SelectorError, SpecError, TransformError
from funhooks.specs.selector import path_label, resolve
from funhooks.specs.spec import Spec, check_nth

from . import forward, sharded, trace, walk
from .entries import PreEntry
from .hooked import Hooked
from .types import Key, Selected

__all__ = ["Plan", "as_copy", "never_called"]

_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Spec, ...], Plan]] = weakref.WeakKeyDictionary()
_PLANS_PER_MODEL = 32
_LOCK = threading.Lock()

_Found = list[tuple[str, nn.Module]]
"""``(path, module)`` pairs a spec selects."""


class _Target(NamedTuple):
    """A module specs hook through its wrapped forward: where, which module (held weakly), and
    the specs selecting it."""

    path: str
    ref: weakref.ref[nn.Module]
    selected: list[Selected]


class _Watched(NamedTuple):
    """An FSDP module whose forward watches the sharded parameters it manages (``sharded``)."""

    path: str
    ref: weakref.ref[nn.Module]
    watch: sharded.Watch


class _ParamHook(NamedTuple):
    """A ``param_grad`` spec on one parameter, hooked for each run (held weakly)."""

    spec: Spec
    key: Key
    ref: weakref.ref[torch.Tensor]


class _PerCallNth(NamedTuple):
    """An intervention's `nth` given per call (``fh.arg``): checked per call against the
    modules its spec selected."""

    spec: Spec
    name: str
    """The ``fh.arg`` name."""
    paths: list[str]


class _CollectorPause:
    """The cyclic garbage collector, paused while plans are made.

    A plan makes a few small objects per module, all of which live as long as the plan: the
    collector would scan them again and again while they are made, and a full collection of
    the whole heap (hundreds of milliseconds in a real session) lands inside a big plan. Plans
    made at once in several threads share one pause; the collector is turned back on when the
    last of them ends, however it ends, and only if it was on when the first began.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_on = False

    def __enter__(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.was_on = gc.isenabled()
                gc.disable()
            self.depth += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.was_on:
                gc.enable()


_PAUSE = _CollectorPause()
_PAUSE_FROM = 1_000
"""Plans of at least this many hooked modules pause the collector while attached, too (a
few objects per module live as long as the run); smaller ones are not worth the pause."""


def never_called(module: nn.Module) -> bool:
    """Containers without a forward of their own (``ModuleList``, ``ModuleDict``)."""
    return type(module).forward is nn.Module.forward and "forward" not in module.__dict__


def _name(spec: Spec) -> str:
    """The record name in the keys of `spec` (``(Record path, record name)``). An editor
    stores nothing: its name, None where it has none, only labels messages."""
    return spec.name  # type: ignore[return-value]  # an editor's name may be None


def as_copy(spec: Spec) -> Spec:
    """The spec storing copies: where version counters are not kept (compiled graphs,
    ``vmap``'s batched tensors) a copy is the only value an in-place op cannot change."""
    return attrs.evolve(spec, clone=True) if not spec.is_edit and spec.role != "call" else spec


def _own_params(module: nn.Module, path: str) -> Iterable[tuple[str, torch.Tensor, nn.Module, str]]:
    """A module's own parameters, and the originals behind its parametrized tensors
    (``parametrize``, ``weight_norm``), each under its own path: ``(path, parameter, the
    module holding it, its name there)``."""
    prefix = f"{path}." if path else ""
    for name, param in module.named_parameters(recurse=False):
        yield prefix + name, param, module, name
    if parametrize.is_parametrized(module):
        parametrizations = cast(nn.ModuleDict, module.parametrizations)
        for tensor, plist in parametrizations.items():
            for name, param in plist.named_parameters(recurse=False):
                yield f"{prefix}parametrizations.{tensor}.{name}", param, plist, name


_PER_CALL_BACKWARD = ("output_grad", "backward", "backward_pre")
"""Backward events tied to the module calls a run sees: not available inside compiled code."""


def _check_called(found: Iterable[tuple[str, nn.Module]], modules: _Found, spec: Spec, caller: str) -> None:
    """Refuse selections no wrapper would ever see: modules inside TorchScript, and modules
    fx inlined into a ``GraphModule``'s code."""
    scripted = {p for p, m in modules if isinstance(m, torch.jit.ScriptModule)}
    called = _fx_called(modules[0][1])
    if not scripted and called is None:
        return
    for path, _ in found:
        if scripted and _below(path, scripted):
            raise TransformError(
                f"{caller}: hooks on modules inside a TorchScript module never fire, got module "
                f"{path!r} selected by {spec!r}. Hook the eager model before scripting it."
            )
        if called is not None and path not in called:
            raise TransformError(
                f"{caller}: fx inlined module {path!r} into the GraphModule's code, so hooks on it "
                f"never fire, got it selected by {spec!r}; the called modules are {sorted(called)}. "
                "Hook the eager model, or keep the module a leaf when tracing."
            )


def _fx_called(root: nn.Module) -> set[str] | None:
    """The modules a ``GraphModule``'s code calls (itself included); None for other roots."""
    if not isinstance(root, torch.fx.GraphModule):
        return None
    return {"", *(str(n.target) for n in root.graph.nodes if n.op == "call_module")}


def _below(path: str, paths: set[str]) -> bool:
    """Whether the module at `path` is below one of `paths`."""
    return any(path[:i] in paths for i, c in enumerate(path) if c == ".")


def _in_given_order(spec: Spec, found: Iterable[tuple[str, nn.Module]]) -> _Found:
    """`found` in the order of the selector's list of modules, where it is one (``run.stored``
    follows the list); else as found (module order)."""
    given = spec.where.given()
    if given is None:
        return list(found)
    position = {id(m): i for i, m in enumerate(given)}
    return sorted(found, key=lambda pm: position.get(id(pm[1]), len(position)))


def _check_holds_params(found: _Found, spec: Spec, caller: str) -> None:
    """Refuse a ``param_grad`` spec on modules that hold no parameter themselves."""
    if not any(True for p, m in found for _ in _own_params(m, p)):
        raise SelectorError(
            f"{caller}: a `param_grad` spec watches the own parameters of the modules it selects, got none "
            f"in {[p for p, _ in found]} for {spec!r}. Select modules that hold parameters themselves: a "
            "container's belong to its children."
        )


class _Structure:
    """What a plan compares to tell whether the model still has the structure it was built
    for: every children table (so ``ModuleList.insert``/``del``/``pop`` and attribute
    assignment are seen), the parameter tables ``param_grad`` specs watch (a parameter
    replaced, as ``fully_shard`` replaces them all), and each module's compiled call
    (``module.compile()`` since, or no more)."""

    __slots__ = ("compiled", "dicts", "empty", "full", "held", "none_compiled")

    def __init__(self, found: walk.Walk, held: list[tuple[dict, tuple]]) -> None:
        self.full, self.empty, self.held = found.full, found.empty, held
        self.dicts = [m.__dict__ for _, m in found.modules]
        self.compiled = self.compiled_calls()
        self.none_compiled = not any(self.compiled)

    def current(self) -> bool:
        """Whether the model still has this structure."""
        if any(self.empty):
            return False
        for d, keys, children in self.full:  # a loop, not a generator: this runs once per run
            if tuple(d) != keys or tuple(d.values()) != children:
                return False
        if self.held and not _same_params(self.held):
            return False
        if self.none_compiled:  # the common case: no list made
            return not any(map(dict.get, self.dicts, itertools.repeat(_torch.COMPILED_CALL)))
        return self.compiled_calls() == self.compiled

    def compiled_calls(self) -> list[object]:
        """Each module's compiled call (``module.compile()``), or None (one C-level pass)."""
        return list(map(dict.get, self.dicts, itertools.repeat(_torch.COMPILED_CALL, len(self.dicts))))


def _same_params(held: list[tuple[dict, tuple]]) -> bool:
    """Whether each parameter table `param_grad` specs watch holds the very parameters it held."""
    return all(len(d) == len(items) and all(k == n and v is p for (k, v), (n, p) in zip(d.items(), items))
               for d, items in held)


@attrs.define
class _Resolved:
    """What a plan's specs select on one walk of the model, and the Record's layout."""

    targets: dict[int, _Target] = attrs.Factory(dict)
    """The modules hooked through their wrapped forward, by id, in the order first selected."""
    params: list[_ParamHook] = attrs.Factory(list)
    watches: dict[int, _Watched] = attrs.Factory(dict)
    """By FSDP module id: the one watching sharded parameters."""
    held: list[tuple[dict, tuple]] = attrs.Factory(list)
    """The parameter tables ``param_grad`` specs watch, as they were."""
    stored: list[Key] = attrs.Factory(list)
    """Where each storing spec stores, in ``run.stored``'s order: spec, then module (or given) order."""
    storing: dict[Key, Spec] = attrs.Factory(dict)
    """The spec storing at each key (parameters' and sharded parameters' not yet)."""
    notes: dict[tuple[str, str | None], str] = attrs.Factory(dict)
    nths: list[_PerCallNth] = attrs.Factory(list)
    order: dict[str, tuple[int, int]] = attrs.Factory(dict)
    """Each Record path's place in module order."""


class _Resolver:
    """Resolves specs, one by one, against one walk of the model (:meth:`add`), into a
    :class:`_Resolved` (:meth:`finish`). Everything is validated here."""

    def __init__(self, model: nn.Module, found: walk.Walk, caller: str) -> None:
        self.model, self.found, self.caller = model, found, caller
        self.rank = {id(m): i for i, (_, m) in enumerate(found.modules)}
        self.owned = {mid for mid, placed in found.placed.items() if placed.owner is not None}
        self.manager = sharded.managers(found.modules)
        self.out = _Resolved()

    def add(self, spec: Spec) -> None:
        """Resolve `spec`: the modules it selects, each with the key it stores at."""
        found = self._select(spec)
        paths = [p for p, _ in found]
        if isinstance(spec.nth, (int, torch.Tensor)):
            check_nth(spec, spec.nth, paths, self.caller)
        elif spec.nth is not None:  # an `fh.arg`: checked per call
            self.out.nths.append(_PerCallNth(spec, spec.nth.name, paths))
        labels, name = dict(spec.labels), _name(spec)  # labels: a standard point's Record paths, by module path
        for nth, (path, module) in enumerate(found):  # nth: the module's index in the spec's selection
            self._on(spec, (labels.get(path, path), name), nth, path, module)

    def _on(self, spec: Spec, key: Key, nth: int, path: str, module: nn.Module) -> None:
        """`spec` on one module it selects, the `nth`."""
        out, mid = self.out, id(module)
        if not spec.is_edit:
            clash = out.storing.get(key)
            if clash is not None:
                raise SpecError(
                    f"{self.caller}: two specs store {spec.name!r} on module {path!r}, got {clash!r} and "
                    f"{spec!r}. Give one of them another `name=`."
                )
            out.storing[key] = spec
            if spec.hook != "param_grad":
                out.stored.append(key)
        if key[0] not in out.order:  # the Record path: a standard point's label, or the module's
            out.order[key[0]] = (self.rank[mid], 0)
        if spec.hook == "param_grad":
            self._params(spec, module, path, self.rank[mid])
            return
        if mid in self.owned and spec.hook in _PER_CALL_BACKWARD:
            raise TransformError(
                f"{self.caller}: module {path_label(path)} runs inside a `torch.compile`d module, where backward "
                f"events never reach a run, got {spec!r}. Run on the model before compiling it, or "
                "compile `fh.capture(...)` for forward values."
            )
        target = out.targets.get(mid)
        if target is None:
            target = out.targets[mid] = _Target(path, weakref.ref(module), [])
        target.selected.append(Selected(spec, key, nth))

    def _select(self, spec: Spec) -> _Found:
        modules = self.found.modules
        found = resolve(spec.where, self.model, caller=self.caller, spec=spec, modules=modules)
        _check_called(found, modules, spec, self.caller)
        selected = _in_given_order(spec, found)
        if spec.hook == "param_grad":
            _check_holds_params(selected, spec, self.caller)
            return selected
        return self._called(spec, selected)

    def _called(self, spec: Spec, found: _Found) -> _Found:
        """The modules of `found` that are called; a note for each container that never is."""
        containers: _Found = []
        called: _Found = []
        for pm in found:
            (containers if never_called(pm[1]) else called).append(pm)
        if not called:
            path, module = containers[0]
            raise SelectorError(
                f"{self.caller}: {spec!r} selects only containers that never run themselves, got module "
                f"{path_label(path)} ({type(module).__name__}). Select the modules inside it, e.g. "
                f"{f'{path}.*' if path else '*'!r}."
            )
        for path, module in containers:
            self.out.notes[(path, None)] = (
                f"{path_label(path)} is a {type(module).__name__}, a container that is never called itself: "
                f"select the modules inside it ({f'{path}.*' if path else '*'!r})"
            )
        return called

    def _params(self, spec: Spec, module: nn.Module, path: str, rank: int) -> None:
        """A ``param_grad`` spec on the own parameters of `module`: hooked, or, sharded by FSDP,
        watched by the forward of the FSDP module managing them."""
        holders: dict[int, dict] = {}
        manager = self.manager(path)
        for i, (ppath, param, holder, name) in enumerate(_own_params(module, path)):
            holders[id(holder)] = _torch.own_parameters(holder)
            self.out.order.setdefault(ppath, (rank, i + 1))
            key = (ppath, _name(spec))
            shard = None if manager is None else sharded.shard_of(manager[1], param)
            if manager is None or shard is None:
                self.out.params.append(_ParamHook(spec, key, weakref.ref(param)))
            else:
                self._watch(manager, ppath, holder, name, shard).add(spec, key)
                self.out.notes.setdefault(key, (
                    f"{path_label(ppath)} is an FSDP-sharded parameter: its gradient is seen when the forward and "
                    "the backward both run inside the block, at the backward that reduces gradients"
                ))
        self.out.held += [(d, tuple(d.items())) for d in holders.values()]

    def _watch(self, manager: tuple[str, nn.Module], ppath: str, holder: nn.Module, name: str,
               shard: torch.Tensor) -> sharded.Param:
        """The watch of one sharded parameter by the forward of the FSDP module `manager`."""
        mpath, fsdp_module = manager
        watched = self.out.watches.get(id(fsdp_module))
        if watched is None:
            watched = _Watched(mpath, weakref.ref(fsdp_module), sharded.Watch(mpath))
            self.out.watches[id(fsdp_module)] = watched
        return watched.watch.param(ppath, holder, name, shard)

    def finish(self) -> _Resolved:
        """Every spec added: editors of parameters first (observers see edited gradients), and
        the FSDP modules watching sharded parameters hooked too."""
        out = self.out
        out.params.sort(key=lambda p: not p.spec.is_edit)
        for mid, (mpath, ref, _) in out.watches.items():
            if mid in self.owned:
                raise TransformError(
                    f"{self.caller}: `param_grad` specs on FSDP-sharded parameters watch them in the forward of the "
                    f"FSDP module, which runs inside a `torch.compile`d module here, got module {path_label(mpath)}. "
                    "Run the specs on the sharded model before compiling it."
                )
            out.targets.setdefault(mid, _Target(mpath, ref, []))
        return out


def _spec_of(resolved: _Resolved) -> dict[Key, Spec]:
    """The spec storing at each key, parameters' and sharded parameters' included."""
    spec_of = {**resolved.storing, **{p.key: p.spec for p in resolved.params}}
    for watched in resolved.watches.values():
        spec_of.update((key, spec) for param in watched.watch.params.values() for spec, key in param.specs)
    return spec_of


def _watch_entry(watches: dict[int, _Watched], mid: int) -> PreEntry | None:
    """The forward-pre entry of the FSDP module `mid` watching sharded parameters, if it is one."""
    found = watches.get(mid)
    return None if found is None else found.watch.entry


class _Wrapping(NamedTuple):
    """How a plan reaches its hooked modules: a wrapped forward each (``forward``), or through
    the compiled recorder of the ``torch.compile`` wrapper whose code runs them (``trace``)."""

    items: list[forward.Item[Hooked]]
    wrappers: list[forward.Item[trace.Compiled]]


def _wrap(resolved: _Resolved, found: walk.Walk, slot: forward.Slot, caller: str) -> _Wrapping:
    """Each hooked module's table and wrapped forward (sharing the plan's `slot`); modules
    run by compiled code are recorded by their wrapper's compiled recorder, storing copies."""
    items: list[forward.Item[Hooked]] = []
    inside: dict[int, tuple[nn.Module, list[trace.Inside]]] = {}
    twins: dict[int, Spec] = {}
    for mid, (path, ref, selected) in resolved.targets.items():
        module = cast(nn.Module, ref())  # alive: the walk holds it
        attr = forward.attribute(type(module))
        placed = found.placed.get(mid)
        if placed is None or placed.owner is None:
            watch = _watch_entry(resolved.watches, mid) if resolved.watches else None
            table = Hooked(path, type(module), selected, watch=watch)
            items.append((ref, forward.Forward(module, attr, forward.call, table, slot), table))
            continue
        keys, start = placed.keys
        copies = _copies(selected, twins)
        item = trace.Inside(ref, ".".join(keys[start:]), attr, Hooked(path, type(module), copies, copies=True),
                            trace.stores_of(copies))
        inside.setdefault(id(placed.owner), (placed.owner, []))[1].append(item)
    wrappers: list[forward.Item[trace.Compiled]] = [
        (weakref.ref(w), forward.Forward(w, _torch.compile_attr(w), trace.compiled_call), trace.Compiled(group, caller))
        for w, group in inside.values()]
    return _Wrapping(items, wrappers)


class Plan:
    """Specs resolved against one model: per hooked module, its entries and its wrapper."""

    def __init__(self, model: nn.Module, specs: tuple[Spec, ...], caller: str) -> None:
        found = walk.walk(model, caller)
        resolver = _Resolver(model, found, caller)
        for spec in specs:
            resolver.add(spec)
        resolved = resolver.finish()
        self.specs = specs
        self.kept = _kept(specs, model, resolver.rank)
        """Whether the plan is cached (see :meth:`get`)."""
        self._structure = _Structure(found, resolved.held)
        self._placed = found.placed
        self._targets = resolved.targets
        self._watches = resolved.watches
        self._nths = resolved.nths
        self.params = resolved.params
        self.stored = resolved.stored
        """The keys storing specs store at, in ``run.stored``'s order."""
        self.notes = resolved.notes
        self.order = resolved.order
        self.spec_of = _spec_of(resolved)
        self.name_rank = {spec.name: i for i, spec in reversed(list(enumerate(specs))) if spec.name is not None}
        self.args = tuple(dict.fromkeys(name for spec in specs for name in spec.args))  # per-call values read
        self.paths = sorted(self.order, key=self.order.__getitem__)  # every path, in module order
        self.slot = forward.Slot()
        """The frame of the plan's one run, in the common case (see ``forward.Slot``)."""
        self.items, self.wrappers = _wrap(resolved, found, self.slot, caller)
        self.pauses = len(self.items) >= _PAUSE_FROM  # whether `attaching` pauses the collector
        self._copy_items: list[forward.Item[Hooked]] | None = None
        self._traced: trace.Traced | None = None

    def check_values(self, values: Mapping[str, object], caller: str) -> None:
        """Refuse a call's per-call `nth` (``fh.arg``) past the modules its spec selected."""
        for spec, name, paths in self._nths:
            check_nth(spec, values.get(name), paths, caller)

    def attaching(self) -> contextlib.AbstractContextManager[None]:
        """Where the plan is attached: the collector paused for a big plan (``_CollectorPause``)."""
        return _PAUSE if self.pauses else contextlib.nullcontext()

    def copy_items(self) -> list[forward.Item[Hooked]]:
        """The eager items with entries that store copies (runs inside ``torch.func`` transforms)."""
        if self._copy_items is None:
            with _PAUSE:
                self._copy_items = self._make_copy_items()
        return self._copy_items

    def _make_copy_items(self) -> list[forward.Item[Hooked]]:
        items: list[forward.Item[Hooked]] = []
        twins: dict[int, Spec] = {}
        for ref, fwd, h in self.items:
            if (module := ref()) is not None:
                entries = _copies(self._targets[id(module)].selected, twins)
                hooked = Hooked(h.path, type(module), entries, copies=True,
                                watch=_watch_entry(self._watches, id(module)))
                items.append((ref, forward.Forward(module, fwd.attr, forward.call), hooked))
        return items

    def traced(self) -> trace.Traced:
        """What a trace reads to record every hooked module, storing copies (``trace``)."""
        if self._traced is None:
            with _PAUSE:
                self._traced = self._make_traced()
        return self._traced

    def _make_traced(self) -> trace.Traced:
        modules: list[tuple[str, str, str, list[trace.User]]] = []
        twins: dict[int, Spec] = {}
        for mid, (path, ref, entries) in self._targets.items():
            if (module := ref()) is not None:
                copies = _copies(entries, twins)
                table = Hooked(path, type(module), copies, copies=True)
                users: list[trace.User] = [(0, table, trace.stores_of(copies))]
                keys = walk.keys_of(path, self._placed.get(mid)).keys
                modules.append((".".join(keys), forward.attribute(type(module)), path, users))
        return trace.layout(modules)

    def current(self) -> bool:
        """Whether the model still has the structure this plan was built for."""
        return self._structure.current()

    @staticmethod
    def get(model: nn.Module, specs: tuple[Spec, ...], caller: str) -> Plan:
        """The plan of `specs` on `model`, cached (NOTE [where plans are cached]) while the
        model's structure holds."""
        caches = _caches(specs)
        cache = caches.get(model)  # a read needs no lock: each lookup is one step under the GIL
        plan = None if cache is None else cache.get(specs)
        if plan is not None and plan.current():
            return plan
        with _PAUSE:
            plan = Plan(model, specs, caller)
        if plan.kept:
            with _LOCK:
                cache = caches.setdefault(model, {})
                if len(cache) >= _PLANS_PER_MODEL and specs not in cache:
                    cache.pop(next(iter(cache)))
                cache[specs] = plan
        return plan


def _caches(specs: tuple[Spec, ...]) -> weakref.WeakKeyDictionary[nn.Module, dict[tuple[Spec, ...], Plan]]:
    """Where the plans of `specs` are cached, by model (NOTE [where plans are cached]): the
    memo of their first intervention, else the plans of every model."""
    for spec in specs:
        if spec.intervenes:
            return spec.memo
    return _PLANS


def _kept(specs: tuple[Spec, ...], model: nn.Module, inside: Container[int]) -> bool:
    """Whether the plan of `specs` is cached (NOTE [where plans are cached]): in the memo of
    their first intervention unless a spec reaches the model; else unless a spec holds a value
    of the user's."""
    if any(spec.intervenes for spec in specs):
        return not any(walk.reaches(spec, model, inside) for spec in specs)
    return not any(walk.holds_values(spec, model, inside) for spec in specs)


def _copies(entries: list[Selected], twins: dict[int, Spec]) -> list[Selected]:
    """`entries` with specs storing copies; `twins` keeps each spec's copying twin by the
    spec's id, so a plan makes one per spec, not one per module (``attrs.evolve`` is slow)."""
    copies = []
    for spec, key, rank in entries:
        twin = twins.get(id(spec))
        if twin is None:
            twin = twins[id(spec)] = as_copy(spec)
        copies.append(Selected(twin, key, rank))
    return copies
