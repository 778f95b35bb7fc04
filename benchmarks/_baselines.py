"""What bench_capture.py measures funhooks against: one-line forward wrappers (the floor of
funhooks' design), hand-written hooks (registered once, or per call), fastai's ``hook_outputs`` or an emulation of it, one no-op global hook (PyTorch's
hooked call path), and peers (nnsight, TransformerLens, torchlens) when importable. Each
builds ``f(x) -> (output, captured outputs in module order)``."""

from __future__ import annotations

import contextvars
import copy
import importlib.util
import inspect
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.modules.module as global_hooks
from torch import nn

import _common


def wrappers_once(model: nn.Module) -> Callable[[torch.Tensor], tuple[Any, list]]:
    """The floor of a design that wraps forwards: on a private copy, each module's ``forward``
    replaced once by a one-line wrapper appending ``(path, out.detach())`` to a list; a call
    starts a new list and runs the model (the list is in call order, as captured)."""
    model = copy.deepcopy(model)
    store: list[tuple[str, torch.Tensor]] = []

    def wrap(path: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            store.append((path, out.detach()))
            return out

        return wrapper

    for path, m in model.named_modules():
        if path:
            m.forward = wrap(path, m.forward)

    def call(x: torch.Tensor) -> tuple[Any, list]:
        store.clear()
        y = model(x)
        return y, store[:]

    return call


def wrappers_with_contract(model: nn.Module) -> Callable[[torch.Tensor], tuple[Any, list]]:
    """The floor with the contract's own work, each step in one-line form (on a private copy,
    like the other floor). Per call of the function:

    - the model's structure checked (a model edited between runs is hooked as it is now):
      every ``_modules`` table compared with a copy, every module's ``__dict__`` asked for a
      compiled call (``module.compile()`` since);
    - each module reached through a weak reference (a run holds no model alive between calls)
      and its ``forward`` (and ``__reduce_ex__``, so copies stay plain) set in its
      ``__dict__``, under a lock (runs in two threads share the wrapping), removed after;
    - per module call: a context-variable read (scope to the context), the ``torch.func``
      level read (a call inside ``vmap``/``grad`` of a block entered outside it must be
      refused), the backward-pass id read (a recomputation under activation checkpointing
      stores nothing), the output detached when it requires grad, and its version read;
    - the tree ``{path: {"output": (value,)}}`` built, each version compared (in-place safety).
    """
    model = copy.deepcopy(model)
    scope: contextvars.ContextVar[tuple] = contextvars.ContextVar("floor", default=())
    peek, task = torch._C._functorch.peek_interpreter_stack, torch._C._current_graph_task_id
    lock = threading.RLock()
    modules = [m for _, m in model.named_modules()]
    full = [(m._modules, tuple(m._modules), tuple(m._modules.values())) for m in modules if m._modules]
    empty = [m._modules for m in modules if not m._modules]
    dicts = [m.__dict__ for m in modules]
    store: list[tuple[str, torch.Tensor, int]] = []

    def wrap(path: str, m: nn.Module) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = type(m).forward(m, *args, **kwargs)
            if scope.get() and peek() is None and task() == -1:
                kept = out.detach() if out.requires_grad else out
                store.append((path, kept, kept._version))
            return out

        return wrapper

    wrappers = [(weakref.ref(m), wrap(path, m), m.__reduce_ex__) for path, m in model.named_modules() if path]

    def call(x: torch.Tensor) -> tuple[Any, dict]:
        if (any(empty) or any(tuple(t) != keys or tuple(t.values()) != values for t, keys, values in full)
                or any(map(dict.get, dicts, itertools.repeat("_compiled_call_impl")))):
            raise RuntimeError("the model changed")
        store.clear()
        with lock:
            for ref, w, r in wrappers:
                d = ref().__dict__
                d["forward"] = w
                d["__reduce_ex__"] = r
        token = scope.set((call,))
        try:
            y = model(x)
        finally:
            scope.reset(token)
            with lock:
                for ref, _, _ in wrappers:
                    d = ref().__dict__
                    del d["forward"]
                    del d["__reduce_ex__"]
        tree: dict[str, dict[str, tuple]] = {}
        for path, t, version in store:
            if t._version != version:
                raise RuntimeError(f"{path} changed in place")
            tree[path] = {"output": (t,)}
        return y, tree

    return call


def hand_once(model: nn.Module) -> Callable[[torch.Tensor], tuple[Any, list]]:
    """Hooks registered once on a private copy; a call resets their dict and runs the model."""
    model = copy.deepcopy(model)
    modules = _common.hooked_modules(model)
    store: dict[nn.Module, torch.Tensor] = {}

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        store[module] = out.detach()

    for m in modules:
        m.register_forward_hook(hook)

    def call(x: torch.Tensor) -> tuple[Any, list]:
        store.clear()
        y = model(x)
        return y, [store[m] for m in modules]

    return call


def hand_per_call(model: nn.Module, modules: list[nn.Module] | None = None) -> Callable[[torch.Tensor], tuple[Any, list]]:
    """Hooks on `modules` (default: every module below the root) registered before and
    removed after every call."""
    modules = _common.hooked_modules(model) if modules is None else modules

    def call(x: torch.Tensor) -> tuple[Any, list]:
        store: dict[nn.Module, torch.Tensor] = {}

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            store[module] = out.detach()

        handles = [m.register_forward_hook(hook) for m in modules]
        try:
            y = model(x)
        finally:
            for h in handles:
                h.remove()
        return y, [store[m] for m in modules]

    return call


def _detached(value: Any) -> Any:
    """Detach every tensor in a nested structure (what fastai-style hooks do per value)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class _OneHook:
    """A registration object per module, keeping the last stored value (fastai's shape)."""

    def __init__(self, module: nn.Module) -> None:
        self.stored: Any = None
        self.handle = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: tuple, out: Any) -> None:
        self.stored = _detached(out)

    def remove(self) -> None:
        self.handle.remove()


class _ManyHooks:
    """A context manager over one ``_OneHook`` per module, removed on exit."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.hooks = [_OneHook(m) for m in modules]

    @property
    def stored(self) -> list[Any]:
        return [h.stored for h in self.hooks]

    def __enter__(self) -> _ManyHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.hooks:
            h.remove()


def fastai_per_call(model: nn.Module) -> tuple[str, Callable[[torch.Tensor], tuple[Any, list]]]:
    modules = _common.hooked_modules(model)
    if importlib.util.find_spec("fastai") is not None:
        try:
            from fastai.callback.hook import hook_outputs
        except Exception:  # fastai installed but broken beside this torch build
            hook_outputs = None
        if hook_outputs is not None:

            def call_fastai(x: torch.Tensor) -> tuple[Any, list]:
                with hook_outputs(modules) as hooks:
                    y = model(x)
                return y, hooks.stored

            return "fastai hook_outputs, per call", call_fastai

    def call(x: torch.Tensor) -> tuple[Any, list]:
        with _ManyHooks(modules) as hooks:
            y = model(x)
        return y, hooks.stored

    return "fastai-style Hooks emulation", call


class NoOpGlobalHook:
    """The bare forward with a global forward hook that does nothing: the part of any hook's
    cost that is PyTorch's own hooked call path, the floor under every capture case."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        if "with_kwargs" in inspect.signature(global_hooks.register_module_forward_hook).parameters:
            self.handle = global_hooks.register_module_forward_hook(self._noop, with_kwargs=True)
        else:  # torch 2.4: global hooks take no kwargs
            self.handle = global_hooks.register_module_forward_hook(lambda m, args, out: None)

    @staticmethod
    def _noop(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        return None

    def __call__(self, x: torch.Tensor) -> tuple[Any, None]:
        return self.model(x), None

    def close(self) -> None:
        self.handle.remove()


# -- peers, only when importable --------------------------------------------------------------


def _call_order(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Indices into ``hooked_modules(model)`` in the order their outputs become available."""
    modules = _common.hooked_modules(model)
    index = {id(m): i for i, m in enumerate(modules)}
    order: list[int] = []
    handles = [m.register_forward_hook(lambda m, a, o: order.append(index[id(m)])) for m in modules]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return order


def _nnsight(model: nn.Module, x: torch.Tensor) -> Callable[[torch.Tensor], tuple[Any, list]]:
    """nnsight: one trace per call saving every module's output (asked for in call order)."""
    import nnsight

    # NNsight installs its own forwards on the model it wraps, for good: a copy keeps them off the other cases
    wrapped = nnsight.NNsight(copy.deepcopy(model))
    paths = [n for n, _ in model.named_modules() if n]
    order = _call_order(model, x)

    def envoy(path: str) -> Any:
        node = wrapped
        for part in path.split("."):
            node = getattr(node, part)
        return node

    envoys = [envoy(paths[i]) for i in order]

    def call(x: torch.Tensor) -> tuple[Any, list]:
        saved: list[Any] = []
        with wrapped.trace(x):
            for e in envoys:
                saved.append(e.output.save())
            out = wrapped.output.save()
        by_module = dict(zip(order, saved))
        return out, [by_module[i] for i in range(len(paths))]

    return call


def _transformer_lens(model: nn.Module) -> Callable[[torch.Tensor], tuple[Any, list]]:
    """TransformerLens ``run_with_cache`` on a copy whose every module ends in a ``HookPoint``
    (as a model written for TransformerLens would call one after each layer)."""
    from transformer_lens import HookedRootModule
    from transformer_lens.hook_points import HookPoint

    inner = copy.deepcopy(model)
    modules = _common.hooked_modules(inner)

    class Hooked(HookedRootModule):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.points = nn.ModuleList(HookPoint() for _ in modules)
            for m, point in zip(modules, self.points):
                m.register_forward_hook(lambda m, a, o, point=point: point(o))
            self.setup()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    hooked = Hooked()
    names = [f"points.{i}" for i in range(len(modules))]

    def call(x: torch.Tensor) -> tuple[Any, list]:
        y, cache = hooked.run_with_cache(x)
        return y, [cache[n] for n in names]

    return call


def _torchlens(model: nn.Module) -> Callable[[torch.Tensor], tuple[Any, None]]:
    """torchlens ``trace`` saving every layer (it logs ops, not modules); torch functions are
    unwrapped after each call so the other cases are not slowed down."""
    import torchlens
    from torchlens.options import CaptureOptions

    options = CaptureOptions(unwrap_when_done=True)

    def call(x: torch.Tensor) -> tuple[Any, None]:
        log = torchlens.trace(model, x, capture=options)
        return log[log.output_layers[0]].tensor, None

    return call


PEERS = {
    "nnsight trace + save": ("nnsight", lambda model, x: _nnsight(model, x)),
    "TransformerLens run_with_cache": ("transformer_lens", lambda model, x: _transformer_lens(model)),
    "torchlens trace": ("torchlens", lambda model, x: _torchlens(model)),
}


def peers(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[torch.Tensor], tuple[Any, Any]]]:
    """The peer libraries that import here (``pip install funhooks[bench]``); others are skipped."""
    found: dict[str, Callable[[torch.Tensor], tuple[Any, Any]]] = {}
    for name, (module, build) in PEERS.items():
        if importlib.util.find_spec(module) is None:
            continue
        try:
            found[name] = build(model, x)
        except Exception as err:  # a peer that imports but fails here is reported, not fatal
            print(f"{name} skipped: {type(err).__name__}: {err}")
    return found
