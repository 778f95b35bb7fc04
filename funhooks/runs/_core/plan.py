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

Plans are cached per model (held weakly) and spec tuple, and only plans that hold no value of
the user's: a plan keeps its specs, so the plan of a spec holding a tensor (a patch value, a
steering vector, a Record, a tensor its function closes over) or reaching the model (a function
closing over it) lives only as long as its run or capture function, and so does the plan of
an intervention (compared by identity, such specs would fill the cache with plans never used
again). A cached plan is reused only while
the model's structure is what it was (every ``_modules`` dict holds the same children, so
``ModuleList.insert``/``del``/``pop`` and attribute assignment are seen, and so is the
replacement of a parameter a ``param_grad`` spec watches, as ``fully_shard`` does, and a
module compiled in place with ``module.compile()`` since).

Cost: building walks the model once (a few µs per module, linear in the model: the garbage
collector is paused meanwhile, see ``_CollectorPause``); reusing compares each module's
children and compiled call (about 0.1 µs per module).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, cast

import attrs
import torch
from torch import nn
from torch.nn.utils import parametrize

from funhooks import _torch
from funhooks.errors import SelectorError, SpecError, TransformError
from funhooks.specs.selector import path_label as where
from funhooks.specs.selector import resolve
from funhooks.specs.spec import Spec, check_nth

from . import forward, sharded, trace
from .entries import PreEntry
from .hooked import Hooked
from .types import Key, Selected

__all__ = ["ParamHook", "Plan", "as_copy", "never_called"]

_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Spec, ...], Plan]] = weakref.WeakKeyDictionary()
_PLANS_PER_MODEL = 32
_LOCK = threading.Lock()
Route = tuple[tuple[str, ...], int]
"""How traced code reaches a module: the ``_modules`` keys from the model (wrappers' own
included), and where in them the inner model of its ``torch.compile`` wrapper starts."""


class _Walk(NamedTuple):
    """What the walk of a model found (wrappers looked through)."""

    modules: list[tuple[str, nn.Module]]
    """``(path, module)`` in ``named_modules()`` order, a shared module once."""
    routes: dict[int, tuple[nn.Module | None, Route]]
    """By module id, for the modules under a wrapper or run by compiled code only: the
    ``torch.compile`` wrapper (or module compiled in place) whose compiled code runs it, and
    its route. Any other module has no owner and its path's segments as its route."""
    full: list[tuple[dict, tuple, tuple]]
    """Every children table with children, its keys and its children (to tell later whether
    the structure changed)."""
    empty: list[dict]
    """Every children table that is empty."""


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


class ParamHook(NamedTuple):
    """A ``param_grad`` spec on one parameter, hooked for each run (held weakly)."""

    spec: Spec
    key: Key
    ref: weakref.ref[torch.Tensor]

_REACH_LIMIT = 100_000
"""How many objects :func:`_holds_values` visits before it gives up (and the plan is not cached)."""


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


def _walk(model: nn.Module, caller: str) -> _Walk:
    """The modules of `model` in ``named_modules()`` order, wrappers looked through and a
    shared module once; with the children of every module seen. One tuple per module in the
    common case: the route and owner are kept only for modules under a wrapper or a compiled
    module (a big model is walked without making many small objects)."""
    seen: set[int] = set()
    modules: list[tuple[str, nn.Module]] = []
    routes: dict[int, tuple[nn.Module | None, Route]] = {}
    full: list[tuple[dict, tuple, tuple]] = []
    empty: list[dict] = []
    wrapper_attrs: dict[type, str | None] = {}  # by type: whether it is a wrapper (DDP, torch.compile)
    # (path, module, (owner, route) or None where the route is the path's segments and there is no owner)
    stack: list[tuple[str, nn.Module, tuple[nn.Module | None, Route] | None]] = [("", model, None)]
    while stack:
        path, module, info = stack.pop()
        kind = type(module)
        attr = wrapper_attrs[kind] if kind in wrapper_attrs else wrapper_attrs.setdefault(kind, _torch.wrapper_attr(module))
        if attr is not None:
            module, info = _unwrap(path, module, info, full, caller)
        if id(module) in seen:
            continue
        seen.add(id(module))
        if (info is None or info[0] is None) and _torch.compiled_in_place(module) is not None:  # `module.compile()`
            route = _route(path, info)[0]
            info = (module, (route, len(route)))
        if info is not None:
            routes[id(module)] = info
        modules.append((path, module))
        children = _torch.children(module)
        if not children:
            empty.append(children)
            continue
        full.append((children, tuple(children.keys()), tuple(children.values())))
        prefix = f"{path}." if path else ""
        if info is None:
            stack.extend([(prefix + n, c, None) for n, c in reversed(children.items()) if c is not None])
        else:
            owner, (route, start) = info
            stack.extend([(prefix + n, c, (owner, ((*route, n), start)))
                          for n, c in reversed(children.items()) if c is not None])
    return _Walk(modules, routes, full, empty)


def _route(path: str, info: tuple[nn.Module | None, Route] | None) -> Route:
    """A module's route: its path's segments unless the walk kept another (``_Walk.routes``)."""
    if info is not None:
        return info[1]
    return (tuple(path.split(".")) if path else (), 0)


def _unwrap(path: str, module: nn.Module, info: tuple[nn.Module | None, Route] | None,
            full: list[tuple[dict, tuple, tuple]], caller: str) -> tuple[nn.Module, tuple[nn.Module | None, Route]]:
    """The module inside the wrappers at `path` (DDP, DataParallel, ``torch.compile``), its
    owner and route; the wrappers' children tables go to `full`."""
    owner = None if info is None else info[0]
    route, start = _route(path, info)
    while (attr := _torch.wrapper_attr(module)) is not None:
        if isinstance(module, nn.DataParallel) and len(module.device_ids or ()) > 1:
            raise TransformError(
                f"{caller}: `nn.DataParallel` runs replicas, new module objects no run can see, got one over "
                f"devices {module.device_ids} at {where(path)}. Use DistributedDataParallel, or DataParallel "
                "on one device."
            )
        route = (*route, attr)
        if owner is None and _torch.is_compile_wrapper(module):
            owner, start = module, len(route)
        table = _torch.children(module)
        full.append((table, tuple(table.keys()), tuple(table.values())))
        module = getattr(module, attr)
    return module, (owner, (route, start))


def _holds_values(start: object, model: nn.Module) -> bool:
    """Whether `start` holds a value of the user's that a cached plan would keep alive: a
    tensor (a patch value, a steering vector, a Record's values, a tensor a function closes
    over, a probe's parameters), or the model itself (a function closing over the model would
    keep it alive for ever). Followed through closures, defaults, bound ``self``, partials,
    containers, object attributes and modules (not globals, which live as long as their module
    anyway). Unsure (too many objects) counts as yes."""
    seen: set[int] = set()
    stack = [start]
    while stack:
        obj = stack.pop()
        if obj is model or isinstance(obj, torch.Tensor):
            return True
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, complex, bool, type, types.ModuleType,
                                                type(None))):
            continue
        seen.add(id(obj))
        if len(seen) > _REACH_LIMIT:
            return True
        if isinstance(obj, nn.Module):
            stack += [*_torch.children(obj).values(), *_torch.own_parameters(obj).values(), *_torch.own_buffers(obj).values()]
        elif isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None)
            stack.extend((obj.__defaults__ or ()) + tuple((obj.__kwdefaults__ or {}).values()))
            stack.append(getattr(obj, "__wrapped__", None))
        elif isinstance(obj, types.MethodType):
            stack += [obj.__self__, obj.__func__]
        elif isinstance(obj, functools.partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (tuple, list, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                stack.extend(getattr(obj, s, None) for s in cls.__dict__.get("__slots__", ()) if isinstance(s, str))
    return False


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
        parametrizations: nn.ModuleDict = module.parametrizations  # type: ignore[assignment]
        for tensor, plist in parametrizations.items():
            for name, param in plist.named_parameters(recurse=False):
                yield f"{prefix}parametrizations.{tensor}.{name}", param, plist, name


_PER_CALL_BACKWARD = ("output_grad", "backward", "backward_pre")
"""Backward events tied to the module calls a run sees: not available inside compiled code."""


def _check_called(found: Iterable[tuple[str, nn.Module]], modules: list[tuple[str, nn.Module]], spec: Spec,
                  caller: str) -> None:
    """Refuse selections no wrapper would ever see: modules inside TorchScript, and modules
    fx inlined into a ``GraphModule``'s code."""
    root = modules[0][1]
    called = None
    if isinstance(root, torch.fx.GraphModule):
        called = {"", *(str(n.target) for n in root.graph.nodes if n.op == "call_module")}
    scripted = {p for p, m in modules if isinstance(m, torch.jit.ScriptModule)}
    if not scripted and called is None:
        return
    for path, _ in found:
        if scripted and any(path[:i] in scripted for i, c in enumerate(path) if c == "."):  # below a scripted module
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


class Plan:
    """Specs resolved against one model: per hooked module, its entries and its wrapper."""

    def __init__(self, model: nn.Module, specs: tuple[Spec, ...], caller: str) -> None:
        modules, self._routes, self._full, self._empty = _walk(model, caller)
        self._dicts = [m.__dict__ for _, m in modules]
        self._compiled = self._compiled_calls()  # which modules `module.compile()` compiled
        self._none_compiled = not any(self._compiled)
        owner = {mid: info[0] for mid, info in self._routes.items() if info[0] is not None}
        rank = {id(m): i for i, (_, m) in enumerate(modules)}
        hooked: dict[int, _Target] = {}
        self.params: list[ParamHook] = []
        self._watches: dict[int, _Watched] = {}  # by FSDP module
        self._held: list[tuple[dict, tuple]] = []  # the parameters `param_grad` specs watch, by module
        self.slots: list[tuple[str, str]] = []  # `run.stored`'s order: spec, then module (or given) order
        self.notes: dict[tuple[str, str | None], str] = {}
        self._nths: list[tuple[Spec, str, list[str]]] = []  # per-call `nth`s: spec, `fh.arg` name, its paths
        self.order: dict[str, tuple[int, int]] = {}
        names: dict[tuple[str, str], Spec] = {}
        manager = sharded.managers(modules)
        for spec in specs:
            found = self._select(spec, model, modules, caller)
            if isinstance(spec.nth, (int, torch.Tensor)):
                check_nth(spec, spec.nth, [p for p, _ in found], caller)
            elif spec.nth is not None:  # an `fh.arg`: checked per call
                self._nths.append((spec, spec.nth.name, [p for p, _ in found]))
            labels = dict(spec.labels)  # a standard point's Record paths, by module path
            for nth, (path, module) in enumerate(found):  # nth: the module's index in the spec's selection
                key = (labels.get(path, path), spec.name)
                if not spec.is_edit:
                    clash = names.get(key)  # type: ignore[arg-type]
                    if clash is not None:
                        raise SpecError(
                            f"{caller}: two specs store {spec.name!r} on module {path!r}, got {clash!r} and "
                            f"{spec!r}. Give one of them another `name=`."
                        )
                    names[key] = spec  # type: ignore[index]
                    if spec.hook != "param_grad":
                        self.slots.append(key)  # type: ignore[arg-type]
                mid = id(module)
                if key[0] not in self.order:  # the Record path: a standard point's label, or the module's
                    self.order[key[0]] = (rank[mid], 0)
                if spec.hook == "param_grad":
                    self._param_entries(spec, module, path, rank[mid], manager)
                    continue
                if mid in owner and spec.hook in _PER_CALL_BACKWARD:
                    raise TransformError(
                        f"{caller}: module {where(path)} runs inside a `torch.compile`d module, where backward "
                        f"events never reach a run, got {spec!r}. Run on the model before compiling it, or "
                        "compile `fh.capture(...)` for forward values."
                    )
                target = hooked.get(mid)
                if target is None:
                    target = hooked[mid] = _Target(path, weakref.ref(module), [])
                target.selected.append(Selected(spec, key, nth))  # type: ignore[arg-type]
        self.params.sort(key=lambda p: not p.spec.is_edit)  # editors first: observers see edited gradients
        for mid, (mpath, ref, _) in self._watches.items():
            if mid in owner:
                raise TransformError(
                    f"{caller}: `param_grad` specs on FSDP-sharded parameters watch them in the forward of the FSDP "
                    f"module, which runs inside a `torch.compile`d module here, got module {where(mpath)}. Run the "
                    "specs on the sharded model before compiling it."
                )
            hooked.setdefault(mid, _Target(mpath, ref, []))
        self.spec_of = {**names, **{p.key: p.spec for p in self.params}}  # parameters' keys too
        for watched in self._watches.values():
            self.spec_of.update((key, spec) for param in watched.watch.params.values() for spec, key in param.specs)
        self.name_rank = {spec.name: i for i, spec in reversed(list(enumerate(specs))) if spec.name is not None}
        self.specs = specs
        self.args = tuple(dict.fromkeys(name for spec in specs for name in spec.args))  # per-call values read
        self.paths = sorted(self.order, key=self.order.__getitem__)  # every path, in module order
        self._hooked = hooked
        self.items: list[forward.Item[Hooked]] = []
        self.slot = forward.Slot()  # the frame of the plan's run, in the common case (see `forward.Slot`)
        inside: dict[int, tuple[nn.Module, list[trace.Inside]]] = {}
        twins: dict[int, Spec] = {}
        for mid, (path, ref, entries) in hooked.items():
            module = cast(nn.Module, ref())  # alive: `walk` holds it
            attr = forward.attribute(type(module))
            wrapper = owner.get(mid)
            if wrapper is None:
                table = Hooked(path, entries, watch=self._watch(mid) if self._watches else None)
                self.items.append((ref, forward.Forward(module, attr, forward.call, table, self.slot), table))
            else:  # recorded by the wrapper's compiled recorder, storing copies
                keys, start = self._routes[mid][1]
                copies = _copies(entries, twins)
                item = trace.Inside(ref, ".".join(keys[start:]), attr, Hooked(path, copies, copies=True),
                                    trace.stores_of(copies))
                inside.setdefault(id(wrapper), (wrapper, []))[1].append(item)
        self.wrappers: list[forward.Item[trace.Compiled]] = [
            (weakref.ref(w), forward.Forward(w, _torch.compile_attr(w), trace.compiled_call), trace.Compiled(group, caller))
            for w, group in inside.values()]
        self.pauses = len(self.items) >= _PAUSE_FROM  # whether `attaching` pauses the collector
        self._copy_items: list[forward.Item[Hooked]] | None = None
        self._traced: trace.Traced | None = None

    def check_values(self, values: Mapping[str, object], caller: str) -> None:
        """Refuse a call's per-call `nth` (``fh.arg``) past the modules its spec selected."""
        for spec, name, paths in self._nths:
            check_nth(spec, values.get(name), paths, caller)

    def _select(self, spec: Spec, model: nn.Module, modules: list[tuple[str, nn.Module]],
                caller: str) -> list[tuple[str, nn.Module]]:
        found = resolve(spec.where, model, caller=caller, spec=spec, modules=modules)
        _check_called(found, modules, spec, caller)
        given = spec.where.given()
        if given is not None:  # an ordered list of modules: `run.stored` follows the list
            position = {id(m): i for i, m in enumerate(given)}
            found = tuple(sorted(found, key=lambda pm: position.get(id(pm[1]), len(position))))
        if spec.hook == "param_grad":
            if not any(True for p, m in found for _ in _own_params(m, p)):
                raise SelectorError(
                    f"{caller}: a `param_grad` spec watches the own parameters of the modules it selects, got none "
                    f"in {[p for p, _ in found]} for {spec!r}. Select modules that hold parameters themselves: a "
                    "container's belong to its children."
                )
            return list(found)
        containers: list[tuple[str, nn.Module]] = []
        called: list[tuple[str, nn.Module]] = []
        for pm in found:
            (containers if never_called(pm[1]) else called).append(pm)
        if not called:
            path, module = containers[0]
            raise SelectorError(
                f"{caller}: {spec!r} selects only containers that never run themselves, got module {where(path)} "
                f"({type(module).__name__}). Select the modules inside it, e.g. {f'{path}.*' if path else '*'!r}."
            )
        for path, module in containers:
            self.notes[(path, None)] = (
                f"{where(path)} is a {type(module).__name__}, a container that is never called itself: "
                f"select the modules inside it ({f'{path}.*' if path else '*'!r})"
            )
        return called

    def _param_entries(self, spec: Spec, module: nn.Module, path: str, rank: int,
                    manager: Callable[[str], tuple[str, nn.Module] | None]) -> None:
        holders: dict[int, dict] = {}
        for i, (ppath, param, holder, name) in enumerate(_own_params(module, path)):
            holders[id(holder)] = _torch.own_parameters(holder)
            self.order.setdefault(ppath, (rank, i + 1))
            key = (ppath, spec.name)
            found = manager(path)
            shard = None if found is None else sharded.shard_of(found[1], param)
            if shard is None:
                self.params.append(ParamHook(spec, key, weakref.ref(param)))  # type: ignore[arg-type]
                continue
            mpath, fsdp_module = found  # type: ignore[misc]
            watched = self._watches.get(id(fsdp_module))
            if watched is None:
                watched = self._watches[id(fsdp_module)] = _Watched(mpath, weakref.ref(fsdp_module), sharded.Watch(mpath))
            watched.watch.param(ppath, holder, name, shard).add(spec, key)  # type: ignore[arg-type]
            self.notes.setdefault(key, (
                f"{where(ppath)} is an FSDP-sharded parameter: its gradient is seen when the forward and the "
                "backward both run inside the block, at the backward that reduces gradients"
            ))
        self._held += [(d, tuple(d.items())) for d in holders.values()]

    def _watch(self, mid: int) -> PreEntry | None:
        found = self._watches.get(mid)
        return None if found is None else found.watch.entry

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
                entries = _copies(self._hooked[id(module)].selected, twins)
                hooked = Hooked(h.path, entries, copies=True, watch=self._watch(id(module)))
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
        for mid, (path, ref, entries) in self._hooked.items():
            if (module := ref()) is not None:
                copies = _copies(entries, twins)
                users: list[trace.User] = [(0, Hooked(path, copies, copies=True), trace.stores_of(copies))]
                route = _route(path, self._routes.get(mid))[0]
                modules.append((".".join(route), forward.attribute(type(module)), path, users))
        return trace.layout(modules)

    def current(self) -> bool:
        """Whether the model still has the structure this plan was built for."""
        if any(self._empty):
            return False
        if not all(len(d) == len(keys) and tuple(d.keys()) == keys and tuple(d.values()) == children
                   for d, keys, children in self._full):
            return False
        if not all(len(d) == len(items) and all(k == n and v is p for (k, v), (n, p) in zip(d.items(), items))
                   for d, items in self._held):  # a parameter replaced (`fully_shard` replaces them all)
            return False
        if self._none_compiled:  # the common case: no list made
            return not any(map(dict.get, self._dicts, itertools.repeat(_torch.COMPILED_CALL)))
        return self._compiled_calls() == self._compiled  # a module compiled in place since, or no more

    def _compiled_calls(self) -> list[object]:
        """Each module's compiled call (``module.compile()``), or None (one C-level pass)."""
        return list(map(dict.get, self._dicts, itertools.repeat(_torch.COMPILED_CALL, len(self._dicts))))

    @staticmethod
    def get(model: nn.Module, specs: tuple[Spec, ...], caller: str) -> Plan:
        """The plan of `specs` on `model`: cached, unless a spec holds a value of the user's
        (:func:`_holds_values`) or is an intervention (compared by identity, so a cache of them
        would fill up with plans never used again); those plans live as long as their run."""
        cache = _PLANS.get(model)  # a read needs no lock: each lookup is one step under the GIL
        plan = None if cache is None else cache.get(specs)
        if plan is not None and plan.current():
            return plan
        with _PAUSE:
            plan = Plan(model, specs, caller)
            if any(spec.intervenes or _holds_values(spec, model) for spec in specs):
                return plan
        with _LOCK:
            cache = _PLANS.setdefault(model, {})
            if len(cache) >= _PLANS_PER_MODEL and specs not in cache:
                cache.pop(next(iter(cache)))
            cache[specs] = plan
        return plan


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
