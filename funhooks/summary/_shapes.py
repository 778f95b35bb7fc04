"""One pass recording each selected module's input and output shapes, its output's bytes and
whether fastai's ``_track`` would mark it as keeping its input's shape, and (when asked) the
FLOPs ``torch.utils.flop_counter``'s formulas give per module (the rules are in
:mod:`funhooks.summary`).

Which pass: a small one runs for real under ``torch.no_grad()`` (the meta device runs most
kernels as Python reference code, about a hundred times a real small kernel's cost), watched
by a budget: once it has done more than :data:`_REAL_FLOPS` FLOPs or made a tensor of more
than :data:`_REAL_BYTES` bytes it is stopped and the pass is redone on the meta device. A
model the meta device cannot run gets a real pass without a budget, as does a lazy or sharded
one; inputs already on the meta device go to the meta device at once.

FLOPs are counted by a dispatch mode with ``torch.utils.flop_counter``'s formulas and its
rules (an op without a formula is decomposed where PyTorch can); PyTorch's own counter has no
formula for the CPU's fused attention kernel (``_scaled_dot_product_flash_attention_for_cpu``),
which the counter here counts as attention. Each module's FLOPs are the counter's total at
its exit minus its total at entry, over all its calls. A call whose FLOPs its module's class
gives from the input's shape (``nn.Linear``, Hugging Face's ``Conv1D``: a matrix product;
PyTorch's norms, embeddings and activations: 0) runs off the counter, its FLOPs added
at its end: the same numbers, without a Python dispatch per op of the call."""

from __future__ import annotations

import contextlib
import contextvars
import enum
import itertools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import attrs
import torch
from torch import nn
from torch.utils import flop_counter

from funhooks import _torch
from funhooks._modes import in_mode
from funhooks.records.record import Record
from funhooks.runs.introspect import isolated
from funhooks.runs.run import with_hooks
from funhooks.specs.selector import Where
from funhooks.specs.spec import Spec, observe

from .table import Shape, ShapeTree, shape_tree

__all__ = ["NOT_RUN", "Pass", "Track", "is_leaf", "last_shape", "nbytes", "record_shapes", "tracks"]

_T = TypeVar("_T")
Tensor = torch.Tensor

_REAL_FLOPS = 2_000_000_000
"""A real pass that has done more FLOPs than this is stopped and redone on the meta device."""
_REAL_BYTES = 64 * 2**20
"""A real pass that makes a tensor of more bytes than this is stopped and redone on the meta device."""


def is_leaf(path: str, module: nn.Module) -> bool:
    return not any(c is not None for c in _torch.children(module).values())


def _same(args: tuple[object, ...], output: object) -> bool:
    """fastai's ``any(i.shape[1:] == o.shape for i, o in zip(args, output))`` on shapes: a
    tensor output iterates over its first dimension, a tuple or list over its items (an
    item that is no tensor, or a dict or 0-d output, where fastai raises, gives False)."""
    if isinstance(output, torch.Tensor):
        if output.ndim == 0:
            return False
        shape = output.shape[1:]  # the first `output.shape[0]` arguments are compared with it
        return any(isinstance(a, torch.Tensor) and a.shape[1:] == shape for a in args[:output.shape[0]])
    if isinstance(output, (tuple, list)):
        return any(isinstance(a, torch.Tensor) and isinstance(o, torch.Tensor) and a.shape[1:] == o.shape
                   for a, o in zip(args, output))
    return False


@attrs.frozen
class Track:
    """What the rows need of one call of a module (a class, not a tuple: the Record stores it
    without walking into it)."""

    shape: ShapeTree  # the output's
    same: bool  # fastai's "size unchanged"
    inputs: ShapeTree  # the positional arguments' (keyword arguments are not seen by a forward hook)
    output_bytes: int  # the bytes of the output's tensors
    flops: int  # the pass's FLOPs counted up to the call's end (0 when not counted)


NOT_RUN = Track(None, False, None, 0, 0)


class Pass(NamedTuple):
    """What :func:`record_shapes` found."""

    record: Record  # a Track per call under "shape", for each selected module
    output: ShapeTree  # the model's output
    flops: dict[str, int] | None  # per module path (those that ran), "" the whole pass; None: not counted


def nbytes(value: object) -> int:
    """The bytes of the tensors in `value` (meta tensors included: their size, not their storage)."""
    if type(value) is torch.Tensor:
        return value.numel() * value.element_size()
    if type(value) is tuple and all(type(x) is torch.Tensor or x is None for x in value):  # most outputs: no tree walk
        return sum([x.numel() * x.element_size() for x in value if x is not None])
    return sum(t.numel() * t.element_size() for t in _torch.tensor_leaves(value))


def _shapes_of(value: object) -> ShapeTree:
    """:func:`shape_tree`, without the tree walk for the common cases (a tensor; a tuple of
    tensors and Nones, which a module's positional arguments mostly are)."""
    if type(value) is torch.Tensor:
        return Shape(value.shape)
    if type(value) is tuple and all(type(x) is torch.Tensor or x is None for x in value):
        return tuple([None if x is None else Shape(x.shape) for x in value])
    return shape_tree(value)


class _Op(enum.Enum):
    """What the counter does with an op that has no formula."""

    LEAVE = "leave"  # a shape query or a higher-order op: left to the tensor, as torch's counter does
    DECOMPOSE = "decompose"  # decomposed where PyTorch can, its parts counted
    RUN = "run"  # run, counted 0


class _Counter(_torch.TorchDispatchMode):
    """Counts FLOPs with ``torch.utils.flop_counter``'s formulas and rules (an op without a
    formula is decomposed where PyTorch can, a higher-order op is left alone), plus the CPU's
    fused attention; with `budget`, stops the pass (:class:`_OverBudget`) once it has done more
    than ``_REAL_FLOPS`` FLOPs or made a tensor of more than ``_REAL_BYTES`` bytes.

    A formula is a function of shapes: its result is kept per op and shapes for this pass, so a
    model's repeated layers cost one call of it."""

    supports_higher_order_operators = True  # and leaves them alone (NotImplemented), as torch's counter does

    def __init__(self, *, budget: bool) -> None:
        super().__init__()
        self.total = 0
        self.budget = budget
        self.over = False  # set once over budget: a model that catches the error is stopped again
        self.formulas: dict[object, Callable[..., int]] = {**flop_counter.flop_registry, **_extra_formulas()}
        self.ops: dict[object, _Op | Callable[..., int]] = {}  # per op overload: its formula, or what to do
        self.counts: dict[object, int] = {}  # per op and shapes: the formula's result
        self.paused = False  # off the mode stack for a call whose FLOPs its module's class gives
        self.pending = 0  # that call's FLOPs, added when it ends

    def _kind(self, func: Any) -> _Op | Callable[..., int]:
        if func in _QUERIES or _torch.is_higher_order_op(func):
            return _Op.LEAVE
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            return formula
        return _Op.DECOMPOSE if func is not _DEVICE and func._can_decompose() else _Op.RUN

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.over:
            raise _OverBudget
        kind = self.ops.get(func)
        if kind is None:
            kind = self.ops[func] = self._kind(func)
        if kind is _Op.RUN:  # most ops: no formula, nothing to decompose
            out = func(*args, **kwargs)
            if self.budget:
                if type(out) is Tensor:
                    if out.numel() * out.element_size() > _REAL_BYTES:
                        self._stop()
                elif _largest(out) > _REAL_BYTES:
                    self._stop()
            return out
        if kind is _Op.LEAVE:
            return NotImplemented
        if kind is _Op.DECOMPOSE:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
            out = func(*args, **kwargs)
        else:
            flops, key = self._before(kind, func, args, kwargs)
            if self.budget and flops is not None and self.total + flops > _REAL_FLOPS:
                self._stop()  # before a matrix product or attention over the budget runs
            out = func(*args, **kwargs)
            if flops is None:
                flops = self._after(kind, key, args, kwargs, out)
            self.total += flops
        if self.budget and (self.total > _REAL_FLOPS or _largest(out) > _REAL_BYTES):
            self._stop()
        return out

    def _stop(self) -> None:
        self.over = True
        raise _OverBudget

    def pause(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """Before a call of `module`: when its class gives the call's FLOPs from its input's shape
        (:func:`_known_flops`), leave the mode stack for the call, its ops uncounted, one by one
        about as costly as the ops themselves; :meth:`resume` adds the FLOPs."""
        flops = _known_flops(module, args)
        if flops is None or self.over or _torch.top_dispatch_mode() is not self:
            return
        if self.budget and self.total + flops > _REAL_FLOPS:
            self.over = True  # the next op stops the pass, before the product runs
            return
        self.__exit__(None, None, None)
        self.paused, self.pending = True, flops

    def resume(self, output: object) -> None:
        """After the call :meth:`pause` left the stack for: back on it, the call's FLOPs added."""
        if not self.paused:
            return
        self.__enter__()
        self.paused, self.total = False, self.total + self.pending
        if self.budget and (self.total > _REAL_FLOPS or _largest(output) > _REAL_BYTES):
            self.over = True  # the next op stops the pass; `_run` checks at the end

    def __exit__(self, *exc: object) -> None:
        if self.paused:  # the paused call raised: the mode is off the stack already
            self.paused = False
            return
        super().__exit__(*exc)

    def _before(self, formula: Callable[..., int], func: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[int | None, Any]:
        """The op's FLOPs before it runs, where they are known from its arguments (kept per op and
        argument shapes for this pass; an op's output shape follows from them), and the key."""
        if not _takes_shapes(formula):
            return None, None
        try:
            key: Any = (func, _frozen_shapes(_shape_args((args, kwargs))))
            return self.counts[key], key
        except TypeError:  # an argument that cannot be a key
            return None, None
        except KeyError:
            pass
        try:  # a formula that needs no output shape (matrix products, attention)
            flops = formula.__wrapped__(*_shape_args(args), out_shape=None, **_shape_args(kwargs))  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - it needs the output's shape (convolutions): counted after the op
            return None, key
        self.counts[key] = flops
        return flops, key

    def _after(self, formula: Callable[..., int], key: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               out: Any) -> int:
        if not _takes_shapes(formula):  # a formula that reads tensors
            return formula(*args, **kwargs, out_val=out)
        flops = formula.__wrapped__(*_shape_args(args), out_shape=_shape_args(out),  # type: ignore[attr-defined]
                                    **_shape_args(kwargs))
        if key is not None:
            self.counts[key] = flops
        return flops


def _takes_shapes(formula: Callable[..., int]) -> bool:
    """Whether `formula` is one torch wrapped to take shapes (its ``__wrapped__`` is called here
    with the shapes); a formula registered to read tensors is called as torch calls it."""
    return getattr(formula, "__code__", None) is _WRAPPED and hasattr(formula, "__wrapped__")


def _largest(out: Any) -> int:
    """The bytes of the largest tensor an op returned (a tensor, or a tuple or list of them)."""
    if type(out) is torch.Tensor:
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return max([_largest(x) for x in out], default=0)
    return out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0


def _known_flops(module: nn.Module, args: tuple[object, ...]) -> int | None:
    """The FLOPs the counter would count in a call of `module` on `args`, where its own class
    (not a subclass; its class's ``forward``, not one set on the instance) makes them a function of the input's shape:
    ``mm``'s ``2 * m * k * n`` for ``nn.Linear`` and Hugging Face's ``Conv1D`` (an ``addmm``) on a
    plain tensor of 2 or more dimensions, and 0 for PyTorch's norms, embeddings and activations,
    whose ops have no formula. None: the call is counted op by op."""
    cls = type(module)
    # the class's own forward: also through a run's wrapper, whose `__func__` is the one it wraps
    if not args or type(args[0]) is not Tensor or getattr(module.forward, "__func__", None) is not cls.forward:
        return None
    x = args[0]
    if cls in _NO_FLOPS or cls.__module__ == "transformers.activations":
        return 0
    if x.ndim < 2:
        return None
    weight = getattr(module, "weight", None)  # Linear's: (out, in); Conv1D's: (in, out)
    if cls is nn.Linear and type(weight) is nn.Parameter and weight.ndim == 2 and x.shape[-1] == weight.shape[1]:
        return 2 * x.numel() * weight.shape[0]
    if (cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils" and type(weight) is nn.Parameter
            and weight.ndim == 2 and x.shape[-1] == weight.shape[0]):
        return 2 * x.numel() * weight.shape[1]
    return None


_NO_FLOPS = frozenset({  # PyTorch modules whose ops have no FLOP formula (each runs one or a few elementwise ops;
    # dropouts and Identity are not here: in eval mode they run no op, and leaving the stack costs more than nothing)
    nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.Embedding, nn.ReLU, nn.ReLU6,
    nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softmax, nn.LogSoftmax, nn.Hardswish,
    nn.Hardsigmoid, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
})


def _shape_args(value: Any) -> Any:
    """torch's counter's ``tree_map(get_shape, value)`` for an op's arguments (tensors, lists,
    tuples and dicts of them, numbers), without the tree walk."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if type(value) is tuple or type(value) is list:
        return type(value)([_shape_args(x) for x in value])
    if type(value) is dict:
        return {k: _shape_args(x) for k, x in value.items()}
    return value


def _frozen_shapes(value: Any) -> Any:
    """`value` (shapes from :func:`_shape_args`) as a key: lists as tuples, dicts as item tuples,
    each container marked with its type."""
    if type(value) is list or type(value) is tuple:
        return (type(value), *[_frozen_shapes(x) for x in value])
    if type(value) is dict:
        return (dict, *[(k, _frozen_shapes(x)) for k, x in value.items()])
    hash(value)
    return value


_WRAPPED = flop_counter.shape_wrapper(len).__code__  # the code of a formula torch wrapped to take shapes


class _OverBudget(Exception):  # noqa: N818 - not an error: the pass goes on on the meta device
    """A real pass passed its budget."""


_aten = torch.ops.aten
_QUERIES = frozenset(  # shape and layout queries: left to the tensor, as torch's counter leaves them
    getattr(getattr(space, name), "default" if overload is None else overload)
    for space, name, overload in (
        (_aten, "sym_is_contiguous", None), (_aten, "is_contiguous", None), (_aten, "is_contiguous", "memory_format"),
        (_aten, "is_strides_like_format", None), (_aten, "is_non_overlapping_and_dense", None), (_aten, "size", None),
        (_aten, "sym_size", None), (_aten, "stride", None), (_aten, "sym_stride", None),
        (_aten, "storage_offset", None), (_aten, "sym_storage_offset", None), (_aten, "numel", None),
        (_aten, "sym_numel", None), (_aten, "dim", None), (torch.ops.prim, "layout", None),
    ) if hasattr(space, name)
)
_DEVICE = torch.ops.prim.device.default


def _extra_formulas() -> dict[object, Callable[..., int]]:
    """Attention kernels torch's counter has no formula for: the CPU's fused attention (what
    ``scaled_dot_product_attention`` runs on the CPU) and the fused kernel of other backends,
    each counted as torch counts attention (``sdpa_flop``)."""
    attention = flop_counter.flop_registry[_aten._scaled_dot_product_flash_attention]  # query, key, value first
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")
    return {getattr(_aten, n): attention for n in names if hasattr(_aten, n)}


_COUNTER: contextvars.ContextVar[_Counter | None] = contextvars.ContextVar("funhooks.summary.counter", default=None)
"""The counter of the pass running in this context, read by the hooks; None outside a pass."""


def _counted() -> int:
    counter = _COUNTER.get()
    return 0 if counter is None else counter.total


def _enter(module: nn.Module, args: tuple[object, ...]) -> int:
    counter = _COUNTER.get()
    if counter is None:
        return 0
    counted = counter.total
    counter.pause(module, args)
    return counted


def _track(module: nn.Module, args: tuple[object, ...], output: object) -> Track:
    counter = _COUNTER.get()
    if counter is not None:
        counter.resume(output)
    return Track(_shapes_of(output), _same(args, output), _shapes_of(args), nbytes(output), _counted())


def _meta(value: _T) -> _T:
    return _torch.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, value)


@contextlib.contextmanager
def _attributes_kept(modules: list[nn.Module]) -> Iterator[None]:
    """A plain tensor attribute of one of `modules` (a model's, each once) that the block set (a
    cache made in ``forward``) is put back as it was after the block, or removed when it is
    new: the pass leaves no trace."""
    tensors = [(vars(m), dict(vars(m))) for m in modules]
    try:
        yield
    finally:
        for attributes, before in tensors:
            for key, value in list(attributes.items()):
                if isinstance(value, Tensor) and value is not before.get(key):
                    if key in before:
                        attributes[key] = before[key]
                    else:
                        del attributes[key]


@contextlib.contextmanager
def _on_meta(model: nn.Module) -> Iterator[None]:
    """Inside the block every parameter and buffer of `model` is a meta tensor of its shape;
    the originals are put back after, however the block exits. Each module is visited
    once, so a module shared under several paths is swapped and restored once."""
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (_torch.own_parameters(module), _torch.own_buffers(module))
            for table in tables:
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    meta = torch.empty_like(t, device="meta")
                    saved.append((table, name, t))
                    table[name] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def _flops_by_path(model: nn.Module, rec: Record, total: int) -> dict[str, int]:
    """Per hooked module path, the FLOPs counted between each call's entry and exit, summed
    over its calls; ``""`` is the whole pass."""
    flops = {}
    for path in rec:
        if path:
            enters, exits = rec.calls(path, "enter"), rec.calls(path, "shape")
            flops[path] = sum(t.flops - e for e, t in zip(enters, exits))
    return {**flops, "": total}


def _run(model: nn.Module, specs: tuple[Spec, ...], args: tuple[object, ...], kwargs: dict[str, object],
         count_flops: bool, *, budget: bool) -> Pass:
    counter = _Counter(budget=budget) if count_flops or budget else None
    token = _COUNTER.set(counter)
    try:
        with with_hooks(model, specs) as run, counter or contextlib.nullcontext():
            out = model(*args, **kwargs)
    finally:
        _COUNTER.reset(token)
    if counter is not None and counter.over:  # the model caught the stop: still over budget
        raise _OverBudget
    flops = None if not count_flops or counter is None else _flops_by_path(model, run.record, counter.total)
    return Pass(run.record, shape_tree(out), flops)


def _has_meta(value: object) -> bool:
    return any(t.is_meta for t in _torch.tensor_leaves(value))


def record_shapes(model: nn.Module, where: Where | None, args: tuple[object, ...],
                  kwargs: dict[str, object] | None = None, *, count_flops: bool = False) -> Pass:
    """Run `model` on `args` and `kwargs` in eval mode, storing a :class:`Track` per call of the
    modules `where` selects (none when `where` is None), and counting FLOPs when asked (not on
    a sharded model). A real pass within the budget, else on the meta device when it can, else
    a real pass (see the module's text). Lazy modules always get the real pass (it initialises
    them, as users of fastai's ``dummy_eval`` expect)."""
    model = _torch.unwrap(model)
    kwargs = kwargs or {}
    # one walk of the model for every check and guard below (each walk of `model.modules()` or
    # `model.parameters()` costs about 0.3 ms on a 4-layer GPT-2, a few % of its summary)
    modules = _torch.walk(model)
    params = [p for m in modules for p in _torch.own_parameters(m).values() if p is not None]
    buffers = [b for m in modules for b in _torch.own_buffers(m).values() if b is not None]
    # a sharded model (an FSDP2 module, or DTensor parameters: tensor parallelism) swaps its own
    # parameters in and out around each call: it runs for real
    sharded = any(map(_torch.is_fsdp_module, modules)) or any(map(_torch.is_dtensor, params))
    count_flops = count_flops and not sharded
    specs: tuple[Spec, ...] = ()
    if where is not None:
        specs = (observe(where, _track, name="shape", detach=False),)
        if count_flops:
            specs = (observe(where, _enter, event="forward_pre", name="enter", detach=False), *specs)
    with_hooks(model, specs)  # validates the selector before anything runs
    lazy = any(map(nn.parameter.is_lazy, itertools.chain(params, buffers)))
    meta = not lazy and not sharded
    # only a sharded model's forward can leave its parameters unsharded (`sharding_kept` walks it twice)
    kept = _torch.sharding_kept(model) if sharded else contextlib.nullcontext()
    with in_mode(model, False, modules), torch.no_grad(), isolated(), kept:  # funhooks' own pass
        if meta and not _has_meta((args, kwargs)):
            try:
                with _attributes_kept(modules):
                    return _run(model, specs, args, kwargs, count_flops, budget=True)
            except _OverBudget:
                pass
        if meta:
            try:
                with _attributes_kept(modules), _on_meta(model):
                    return _run(model, specs, _meta(args), _meta(kwargs), count_flops, budget=False)
            except Exception:  # noqa: BLE001 - no meta kernel, real tensors made in forward, data-dependent ops
                pass
        return _run(model, specs, args, kwargs, count_flops, budget=False)


def tracks(rec: Record, path: str) -> tuple[Track, ...]:
    """A :class:`Track` per call of the module at `path`, in call order."""
    return rec.calls(path, "shape") if path in rec else ()


def _last_track(rec: Record, path: str) -> Track:
    """The module's last call; shape None and `same` False when it did not run."""
    calls = tracks(rec, path)
    return calls[-1] if calls else NOT_RUN


def last_shape(rec: Record, path: str) -> ShapeTree:
    return _last_track(rec, path).shape
