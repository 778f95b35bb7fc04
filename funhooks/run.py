"""Context-scoped runs: the only code that attaches anything to a model.

On an eager model, forward events reach a run through *wrapped forwards* (``_patch``): each
hooked module's ``forward`` is wrapped for the duration of the block, so PyTorch's module
call keeps its hook-free fast path (capturing all 96 modules of a deep-narrow MLP costs
about 1.25x the bare forward, what a single global forward hook doing nothing costs).
Where code is compiled or a ``torch.func`` transform is active, forward events go through
one persistent *dispatcher* instead: a global forward hook (and a global forward-pre hook
while a run needs one) that looks the called module up in every active run's table, which
dynamo traces, so it works on models compiled before the run. Backward events use
per-module full backward hooks; ``grads`` uses tensor hooks on the outputs (right even
when an in-place op follows); ``param_grad`` uses parameter hooks. All of them are removed
when the block exits, however it exits.

Cost: per hooked module call, one wrapper call (or, through the dispatcher, PyTorch's
hooked call path for every module and one dict lookup per active run); per stored tensor,
a version-counter read (and a ``detach()`` where it has autograd history). Resolved plans
are cached per model and spec set, and invalidated when any module is registered
(attribute assignment, ``add_module``); call ``with_hooks`` after editing
``model._modules`` directly and the cache may be stale.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import torch
import torch.nn.modules.module as _module_hooks
from torch import nn

from . import _entries, _patch, _torch
from .errors import FrozenError, SpecError, StaleTensorError, TransformError
from .record import Record
from .select import resolve
from .spec import Spec

__all__ = ["Run", "with_hooks"]

Tensor = torch.Tensor

# -- the persistent dispatcher ------------------------------------------------------------

_STACK: list[_Frame] = []
"""Active frames, outermost first. The global hooks route every module call through it."""

_HANDLES: dict[str, Any] = {}
_USERS: dict[str, int] = {"forward": 0, "forward_pre": 0}


def _on_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    changed = False
    for frame in _STACK:
        entries = frame.forward.get(id(module))
        if entries is None or not frame.active:
            continue
        for entry in entries:
            new = entry(frame, module, args, kwargs, output)
            if new is not None:
                output, changed = new, True
    return output if changed else None


def _on_forward_pre(module: nn.Module, args: tuple) -> Any:
    changed = False
    for frame in _STACK:
        entries = frame.forward_pre.get(id(module))
        if entries is None or not frame.active:
            continue
        for entry in entries:
            new = entry(frame, module, args, None)
            if new is not None:
                args, changed = (new if isinstance(new, tuple) else (new,)), True
    return args if changed else None


def acquire(kind: str) -> None:
    """Install the global `kind` hook if no run holds it yet (reference counted)."""
    if _USERS[kind] == 0:
        if kind == "forward":
            _HANDLES[kind] = _module_hooks.register_module_forward_hook(_on_forward, with_kwargs=True)
        else:
            _HANDLES[kind] = _module_hooks.register_module_forward_pre_hook(_on_forward_pre)
    _USERS[kind] += 1


_STICKY: set[str] = set()


def hold_forever(kinds: Iterable[str]) -> None:
    """Keep the global `kinds` hooks installed for the rest of the process.

    Dynamo does not retrace code compiled before a global hook existed, so the first run on
    a compiled model installs the dispatcher for good and drops compiled code once
    (``torch.compiler.reset()``: every compiled function recompiles on its next call).
    From then on every module call in the process takes PyTorch's hook path.
    """
    new = [k for k in kinds if k not in _STICKY]
    for kind in new:
        acquire(kind)
        _STICKY.add(kind)
    if new:
        _torch.reset_compiled()


def release(kind: str) -> None:
    """Drop one hold on the global `kind` hook; the last one removes it."""
    _USERS[kind] -= 1
    if _USERS[kind] == 0:
        _HANDLES.pop(kind).remove()


# -- plan cache --------------------------------------------------------------------------

_GENERATION = [0]


def _bump(*_: Any) -> None:
    _GENERATION[0] += 1


# Any module registration anywhere (attribute assignment, add_module) invalidates plans.
_module_hooks.register_module_module_registration_hook(_bump)

_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Spec, ...], _Plan]] = weakref.WeakKeyDictionary()
_PLANS_PER_MODEL = 32


# -- plans -------------------------------------------------------------------------------


_FASTAI_LISTS = ("Hooks", "hook_outputs")


class _Plan:
    """Specs resolved against one model: per-module entry tables, built once and cached."""

    def __init__(self, model: nn.Module, specs: tuple[Spec, ...], caller: str) -> None:
        self.generation = _GENERATION[0]
        forward: dict[int, list] = {}
        forward_pre: dict[int, list] = {}
        self.backward: list[tuple[Spec, tuple[str, str | None], weakref.ref]] = []
        self.params: list[tuple[Spec, tuple[str, str | None], weakref.ref]] = []
        self.slots: list[tuple[str, str]] = []
        order: dict[str, tuple[int, int]] = {}
        names: dict[tuple[str, str], Spec] = {}
        modules = list(_torch.named_modules(model))  # one walk, shared by every spec
        module_order = {id(m): i for i, (_, m) in enumerate(modules)}
        self.hooked: dict[int, weakref.ref] = {}
        for spec in specs:
            found = resolve(spec.where, model, caller=caller, spec=spec, modules=modules)
            if spec.label in _FASTAI_LISTS:  # fastai's `stored` follows the order of `ms`
                rank = {id(m): i for i, m in enumerate(spec.where.instances())}
                found = tuple(sorted(found, key=lambda pm: rank.get(id(pm[1]), len(rank))))
            for path, module in found:
                key = (path, spec.name)
                if not spec.is_edit:
                    clash = names.get(key)  # type: ignore[arg-type]
                    if clash is not None:
                        raise SpecError(
                            f"{caller}: two specs store {spec.name!r} on module {path!r}, got {clash!r} and "
                            f"{spec!r}. Give one of them another `name=`."
                        )
                    names[key] = spec  # type: ignore[index]
                    if spec.event != "param_grad":
                        self.slots.append(key)  # type: ignore[arg-type]
                order.setdefault(path, (module_order[id(module)], 0))
                if spec.event in ("forward", "forward_pre") or spec.role in ("grad", "grad_output"):
                    self.hooked[id(module)] = weakref.ref(module)
                if spec.event == "forward" or spec.role in ("grad", "grad_output"):
                    forward.setdefault(id(module), []).append(_entries.forward_entry(spec, key))
                elif spec.event == "forward_pre":
                    forward_pre.setdefault(id(module), []).append(_entries.forward_pre_entry(spec, key))
                    if spec.role == "input":
                        forward.setdefault(id(module), []).append(_entries.forward_entry(spec, key))
                elif spec.event in ("backward", "backward_pre"):
                    self.backward.append((spec, key, weakref.ref(module)))
                else:  # param_grad
                    for i, (pname, param) in enumerate(module.named_parameters(recurse=False)):
                        ppath = f"{path}.{pname}" if path else pname
                        order.setdefault(ppath, (module_order[id(module)], i + 1))
                        self.params.append((spec, (ppath, spec.name), weakref.ref(param)))
        self.wrappers = _torch.wrappers_in(model)
        self.compiled = _torch.COMPILED in self.wrappers
        self.forward = {k: tuple(v) for k, v in forward.items()}
        self.forward_pre = {k: tuple(v) for k, v in forward_pre.items()}
        # eager runs wrap the hooked modules' forwards (see _patch)
        self.patchable = all(_patch.patchable(type(ref())) for ref in self.hooked.values())
        self.wrapped = [(ref, _patch.Forward(ref()), self.forward_pre.get(mid, ()), self.forward.get(mid, ()))
                        for mid, ref in self.hooked.items()]
        self.order = order
        self.paths = sorted(order, key=order.__getitem__)  # every path, in module order
        self.spec_of = names
        self.specs = specs
        self._copy_specs: tuple[Spec, ...] | None = None

    def copy_specs(self) -> tuple[Spec, ...]:
        """The specs storing copies (see :func:`as_copy`), made once per plan."""
        if self._copy_specs is None:
            self._copy_specs = tuple(as_copy(s) for s in self.specs)
        return self._copy_specs

    @staticmethod
    def get(model: nn.Module, specs: tuple[Spec, ...], caller: str) -> _Plan:
        if any(spec.where.instances() for spec in specs):
            # a spec naming a module instance holds it strongly: caching it under the
            # weakly-held model would keep the model alive forever
            return _Plan(model, specs, caller)
        cache = _PLANS.setdefault(model, {})
        plan = cache.get(specs)
        if plan is None or plan.generation != _GENERATION[0]:
            plan = _Plan(model, specs, caller)
            if len(cache) >= _PLANS_PER_MODEL:
                cache.pop(next(iter(cache)))
            cache[specs] = plan
        return plan


def as_copy(spec: Spec) -> Spec:
    """The spec storing copies: where version counters are not kept (compiled graphs,
    ``vmap``'s batched tensors) a copy is the only value an in-place op cannot change."""
    return attrs.evolve(spec, clone=True) if not spec.is_edit and spec.role != "call" else spec


class _Frame:
    """One active run's mutable state, private to it: the buffer the hooks append to."""

    __slots__ = ("forward", "forward_pre", "buffer", "pending", "extra_checks", "open", "active")

    def __init__(self, plan: _Plan) -> None:
        self.forward, self.forward_pre = plan.forward, plan.forward_pre
        self.buffer: list[tuple[Any, Any, Any]] = []
        self.pending: list[_entries.Slot] = []
        self.extra_checks: list[tuple[Any, Any]] = []
        self.open = False
        self.active = True


def _stale(caller: str, key: tuple[str, str], spec: Spec | None) -> StaleTensorError:
    path, name = key
    where = repr(path) if path else "'' (the root)"
    return StaleTensorError(
        f"{caller}: a stored tensor must not change after it is stored, got the {name!r} of module "
        f"{where} (spec {spec!r}) changed in place by a later op such as `inplace=True`. "
        "Pass `clone=True` to the spec to store a copy."
    )


def _build(buffer: list, extra: list, plan: _Plan, caller: str, *, copies: bool = False) -> Record:
    """Group the buffer into a Record, checking that no stored tensor changed since
    (unless the values are copies taken where version counters are not kept)."""
    data: dict[str, dict[str, Any]] = {}
    several = False  # a (path, name) with more than one call: its calls are a list until the end
    for key, value, check in buffer:
        if check is not None and not copies:
            if type(check) is int:
                if value._version != check:
                    raise _stale(caller, key, plan.spec_of.get(key))
            elif any(t._version != v for t, v in check):
                raise _stale(caller, key, plan.spec_of.get(key))
        if type(value) is _entries.Slot:
            ok, value = value.resolve()
            if not ok:
                continue
        path, name = key
        node = data.get(path)
        if node is None:
            data[path] = {name: (value,)}
            continue
        calls = node.get(name)
        if calls is None:
            node[name] = (value,)
        elif type(calls) is tuple:
            node[name], several = [*calls, value], True
        else:
            calls.append(value)
    if not copies:
        for key, check in extra:
            if any(t._version != v for t, v in check):
                raise _stale(caller, key, plan.spec_of.get(key))
    if several:
        for node in data.values():
            for name, calls in node.items():
                if type(calls) is list:
                    node[name] = tuple(calls)
    paths = list(data)
    if paths != plan.paths:  # not every module, or not in module order: sort if needed
        order = plan.order
        if any(order[a] > order[b] for a, b in zip(paths, paths[1:])):
            data = {p: data[p] for p in sorted(data, key=order.__getitem__)}
    return Record._trusted(data)


# -- the public run ------------------------------------------------------------------------


def _as_specs(specs: Spec | Iterable[Spec], caller: str) -> tuple[Spec, ...]:
    if isinstance(specs, Spec):
        return (specs,)
    try:
        items = tuple(specs)
    except TypeError:
        items = None
    if items is None or isinstance(specs, str) or not all(isinstance(s, Spec) for s in items):
        bad = specs if items is None or isinstance(specs, str) else next(s for s in items if not isinstance(s, Spec))
        raise SpecError(
            f"{caller}: `specs` is a Spec or an iterable of Specs, got {bad!r}. "
            "Build specs with fh.outputs, fh.inputs, fh.grads, fh.observe or fh.edit."
        )
    return tuple(dict.fromkeys(items))  # equal specs are installed once


def _check_model(model: Any, caller: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise SpecError(f"{caller}: `model` is an nn.Module, got {type(model).__name__}. Pass the model to hook.")
    if isinstance(model, torch.jit.ScriptModule):
        raise TransformError(
            f"{caller}: hooks on a TorchScript module never fire, got {type(model).__name__}. "
            "Hook the eager model before scripting it."
        )
    return model


class _Wrapped:
    """The forwards a run wrapped, unwrapped by ``remove()`` like a hook handle."""

    __slots__ = ("frame", "installed")

    def __init__(self, frame: _Frame, items: list[tuple[weakref.ref, _patch.Forward, tuple, tuple]]) -> None:
        self.frame = frame
        self.installed = _patch.install(frame, items)

    def remove(self) -> None:
        _patch.uninstall(self.frame, self.installed)


class _FullBackwardFlag:
    """Restores ``module._is_full_backward_hook`` once the module has no backward hook left,
    so a run leaves no mark that would forbid the user's own ``register_backward_hook``."""

    __slots__ = ("module", "flag")

    def __init__(self, module: nn.Module) -> None:
        self.module, self.flag = module, getattr(module, "_is_full_backward_hook", None)

    def remove(self) -> None:
        if not self.module._backward_hooks:
            self.module._is_full_backward_hook = self.flag


class Run:
    """A context-scoped run of specs on a model. Use it through :func:`with_hooks`.

    Inside the block the model is called as usual (``model(x)`` or ``run(x)``); hooks are
    installed on entry and removed on exit, whatever the exit. ``run.record`` is a snapshot
    valid inside and after the block; ``run.stored`` is fastai's list, one value (the last
    call's) per hooked module and spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with fh.with_hooks(model, fh.outputs("0")) as run:
        ...     for _ in range(3):
        ...         y = run(torch.randn(4, 2))     # run(x) is model(x)
        ...     first = run.take()                  # the record so far; the buffer restarts
        ...     y = run(torch.randn(4, 2))
        >>> len(first.calls("0", "output")), len(run.record.calls("0", "output"))
        (3, 1)
    """

    __slots__ = ("_model", "_specs", "_plan", "_frame", "_handles", "_state", "_caller", "_copies", "_per_module")

    def __init__(self, model: nn.Module, specs: Spec | Iterable[Spec], *, caller: str = "with_hooks",
                 per_module: bool | None = None) -> None:
        """Args: `per_module` None wraps the hooked modules' forwards on eager models;
        False always uses the global dispatcher."""
        set_ = object.__setattr__
        set_(self, "_per_module", per_module)
        set_(self, "_caller", caller)
        set_(self, "_model", _check_model(model, caller))
        set_(self, "_specs", _as_specs(specs, caller))
        set_(self, "_plan", _Plan.get(_torch.unwrap(model), self._specs, caller))
        set_(self, "_copies", False)
        set_(self, "_frame", _Frame(self._plan))
        set_(self, "_handles", [])
        set_(self, "_state", "new")

    def __setattr__(self, key: str, value: Any) -> None:
        raise FrozenError(f"Run: a run cannot be assigned to, got `.{key} = ...`. Start a new run.")

    @property
    def specs(self) -> tuple[Spec, ...]:
        """The specs of this run, equal specs once."""
        return self._specs

    def __enter__(self) -> Run:
        if self._state != "new":
            raise RuntimeError(f"{self._caller}: a run is entered once, got a second `with`. Call `with_hooks` again.")
        object.__setattr__(self, "_state", "open")
        plan = self._plan
        wrappers = plan.wrappers | _torch.wrappers_around(self._model)
        compiled = _torch.COMPILED in wrappers
        if compiled or _torch.is_compiling() or _torch.is_functorch_active():
            # no version counters there: store copies, and keep the dispatcher traced
            plan = _Plan.get(_torch.unwrap(self._model), plan.copy_specs(), self._caller)
            object.__setattr__(self, "_plan", plan)
            object.__setattr__(self, "_frame", _Frame(plan))
            object.__setattr__(self, "_copies", True)
            if compiled:
                hold_forever(("forward", "forward_pre") if plan.forward_pre else ("forward",))
        frame = self._frame
        # wrapped forwards on eager models; the dispatcher where compiled code must trace it,
        # and under DataParallel, whose replicas would copy a wrapper bound to the original
        local = (self._per_module is not False and plan.patchable and not self._copies
                 and _torch.REPLICATED not in wrappers)
        try:
            if local:
                self._handles.append(_Wrapped(frame, plan.wrapped))
            else:
                for kind in ("forward", "forward_pre"):
                    if kind == "forward" or plan.forward_pre:
                        acquire(kind)
                        self._handles.append(kind)
            for spec, key, ref in plan.backward:
                module = ref()
                if module is None:
                    continue
                if spec.event == "backward":
                    # PyTorch marks a module full-backward-hooked for good; restored on exit
                    self._handles.append(_FullBackwardFlag(module))
                    register = module.register_full_backward_hook
                else:
                    register = module.register_full_backward_pre_hook
                self._handles.append(register(_entries.backward_entry(spec, key, frame)))
            for spec, key, ref in plan.params:
                param = ref()
                if param is not None and param.requires_grad:
                    self._handles.append(param.register_hook(_entries.param_entry(spec, key, param, frame)))
            frame.open = True
            if not local:
                _STACK.append(frame)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        frame = self._frame
        frame.open = False
        for i, f in enumerate(_STACK):
            if f is frame:
                del _STACK[i]
                break
        for handle in reversed(self._handles):
            if isinstance(handle, str):
                release(handle)
            else:
                handle.remove()
        self._handles.clear()
        object.__setattr__(self, "_state", "closed")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the model: ``run(x)`` is ``model(x)``."""
        return self._model(*args, **kwargs)

    @property
    def record(self) -> Record:
        """A Record of everything stored so far (a snapshot).

        Raises:
            StaleTensorError: when a stored tensor was changed in place after it was stored.
        """
        return _build(self._frame.buffer, self._frame.extra_checks, self._plan, self._caller, copies=self._copies)

    def take(self) -> Record:
        """The Record of everything stored since the last ``take``, then start afresh.

        Use it to get one Record per batch from a single block around a loop.
        """
        frame = self._frame
        rec = _build(frame.buffer, frame.extra_checks, self._plan, self._caller, copies=self._copies)
        frame.buffer, frame.extra_checks = [], []
        return rec

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside this block the run stores nothing: its holds on the global dispatcher are
        released (so module calls cost nothing when no other run or compiled model holds
        it) and its wrapped forwards stay in place but only call the module."""
        frame = self._frame
        if not frame.active:
            yield
            return
        kinds = [h for h in self._handles if isinstance(h, str)]
        frame.active = False
        for kind in kinds:
            release(kind)
        try:
            yield
        finally:
            for kind in kinds:
                acquire(kind)
            frame.active = True

    @property
    def stored(self) -> list[Any]:
        """fastai's ``hooks.stored``: the last call's value for each (spec, module), in spec
        then module order; ``None`` where the module did not run."""
        rec = self.record
        out = []
        for path, name in self._plan.slots:
            calls = rec._data.get(path, {}).get(name, ())
            out.append(calls[-1] if calls else None)
        return out

    def __repr__(self) -> str:
        return f"Run({type(self._model).__name__}, specs={list(self._specs)!r}, {self._state})"


def with_hooks(model: nn.Module, specs: Spec | Iterable[Spec]) -> Run:
    """Run `specs` on `model` for the duration of a ``with`` block.

    Everything is validated before anything is attached: selectors must match, module
    instances must belong to the model, record names must not clash on one module.

    Args:
        model: the model (DDP, DataParallel and ``torch.compile`` wrappers are looked through:
            paths are those of the inner model).
        specs: a Spec or an iterable of Specs; equal specs are installed once.

    Returns:
        A :class:`Run` to use as a context manager.

    Raises:
        SpecError: for things that are not specs, or two specs storing one name on one module.
        SelectorError: for a selector that matches nothing or a foreign module instance.
        HookError: (inside the block) when a spec's function raises.
        StaleTensorError: (on reading the record) when a stored tensor was changed in place.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> with fh.with_hooks(model, [fh.outputs(nn.Linear), fh.inputs("2")]) as run:
        ...     y = model(torch.randn(8, 4))
        >>> rec = run.record
        >>> list(rec), rec["2"]["output"].shape
        (['0', '2'], torch.Size([8, 1]))
        >>> fh.testing.assert_no_hooks(model)
    """
    return Run(model, specs)
