"""The one place that touches private or version-dependent torch APIs.

Everything else in funhooks imports these helpers instead of reaching into
``torch.utils._pytree``, ``torch._C._functorch`` or wrapper classes directly, so a change
in PyTorch is fixed here once (tests/project/test_layout.py checks that no other module names a
private torch API).

Two private attributes are read where they are used, on the hot path, because a helper's
call would cost more than the read: a tensor's ``_version`` counter (how stored values are
checked for later in-place changes; stable since PyTorch 1.0) and a module's
``_parameters`` / ``_buffers`` dicts (swapping tensors in place for ``capture``'s
functional calls). Both are attribute reads on instances, which that check does not see.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "TorchDispatchMode",
    "call_impl",
    "children",
    "is_higher_order_op",
    "walk",
    "is_functorch_active",
    "own_buffers",
    "own_parameters",
    "pytree",
    "register_pytree",
    "top_dispatch_mode",
    "tree_leaves",
    "tree_map",
    "unwrap",
    "wrapper_attr",
    "named_modules",
    "is_compiling",
    "TRACES_RECORDING",
    "weights_only_reads_complex",
    "peek_transform",
    "graph_task_id",
    "saving_hooks_active",
    "jit_tracing",
    "transform_level",
    "MODULE_CALL_CODES",
    "in_backward",
    "backward_pass",
    "after_backward",
    "backward_hook",
    "COMPILED_CALL",
    "compiled_in_place",
    "compile_attr",
    "compiled_model",
    "dynamo_context",
    "is_compile_wrapper",
    "Structure",
    "flatten",
    "unflatten",
    "map_tensors",
    "tensor_leaves",
    "is_dtensor",
    "shard_group",
    "is_fsdp_module",
    "own_class",
    "is_fsdp_hook",
    "sharding_kept",
    "fsdp_parameters",
]

tree_map = pytree.tree_map
tree_leaves = pytree.tree_leaves


def is_higher_order_op(func: object) -> bool:
    """True for a higher-order operator (``cond``, ``flex_attention``, ...) met by a dispatch mode."""
    return isinstance(func, torch._ops.HigherOrderOperator)


def top_dispatch_mode() -> TorchDispatchMode | None:
    """The dispatch mode an op would meet first (the top of this thread's mode stack); None without one."""
    return torch.utils._python_dispatch._get_current_dispatch_mode()


# -- a module's own tables: read directly where a walk runs per step or per plan, and in traced
# code, which must reach modules the way their own forward does (by `_modules` key)


def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """`module`'s own children by name, ``None`` entries included (``module._modules``)."""
    return module._modules


def walk(model: nn.Module) -> list[nn.Module]:
    """``model.modules()`` (each module once, `model` first), by a plain walk of the children
    tables: no generators, no path strings, for walks made per step."""
    found, seen = [model], {id(model)}
    for module in found:  # grows while it is walked
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
    return found


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """`module`'s own parameters by name, ``None`` entries included (``module._parameters``)."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """`module`'s own buffers by name, ``None`` entries included (``module._buffers``)."""
    return module._buffers


def call_impl(module: nn.Module) -> Callable[..., Any]:
    """PyTorch's own call of `module` (``Module._call_impl``), bypassing a compiled call."""
    return module._call_impl

_WRAPPER_ATTRS = {"OptimizedModule": "_orig_mod"}


def wrapper_attr(module: nn.Module) -> str | None:
    """The attribute holding the wrapped model, for DDP / DataParallel / torch.compile."""
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return "module"
    # OptimizedModule is matched by name: importing torch._dynamo costs about a second.
    return _WRAPPER_ATTRS.get(type(module).__name__)


def unwrap(module: nn.Module) -> nn.Module:
    """Strip DDP / DataParallel / ``torch.compile`` wrappers, however deeply nested."""
    attr = wrapper_attr(module)
    while attr is not None:
        module = getattr(module, attr)
        attr = wrapper_attr(module)
    return module


def named_modules(model: nn.Module, *, every_path: bool = False) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` without wrapper modules or their prefixes.

    A shared module is yielded once, at its first path (at every path with `every_path`);
    wrappers (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``, also around
    submodules) never appear.
    """
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        path, module = stack.pop()
        module = unwrap(module)
        if id(module) in seen:
            if every_path:
                yield path, module
            continue
        seen.add(id(module))
        yield path, module
        children = [(f"{path}.{n}" if path else n, c) for n, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))


_HAS_KEY_PATHS = "flatten_with_keys_fn" in inspect.signature(pytree.register_pytree_node).parameters
"""Whether this torch has pytree key paths (``tree_flatten_with_path``, ``keystr``; torch >= 2.3)."""


def register_pytree(cls: type, flatten: Callable, unflatten: Callable, name: str, *,
                    flatten_with_keys: Callable | None = None) -> None:
    """Register ``cls`` as a pytree node so ``torch.func`` transforms see its tensors.

    `flatten_with_keys` (``obj -> ([(key_entry, child), ...], context)``, the children and
    context of `flatten`) names each child for ``tree_flatten_with_path``,
    ``tree_map_with_path`` and ``keystr``; a torch without key paths registers without it.
    """
    keys = {"flatten_with_keys_fn": flatten_with_keys} if flatten_with_keys is not None and _HAS_KEY_PATHS else {}
    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=name, **keys)




def is_functorch_active() -> bool:
    """True inside a ``torch.func`` transform (vmap, grad, jacrev, ...)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def is_compiling() -> bool:
    """True while dynamo traces the calling code."""
    return torch.compiler.is_compiling()


_RELEASE: Any = torch.__version__
"""The torch release: a ``TorchVersion``, which compares with tuples such as ``(2, 13)`` (typed
Any: torch's annotations of ``TorchVersion`` compare it with str alone)."""

TRACES_RECORDING = _RELEASE >= (2, 11) and not (2, 12) <= _RELEASE < (2, 13)
"""Whether dynamo traces a recording (modules' forwards wrapped in their ``__dict__``) into
compiled code; where it does not, the recording runs eagerly inside the compiled code, in a
frame dynamo skips, with the same Records. Releases tried (docs/field.md): 2.13 traces it as
one graph, 2.11 with graph breaks; on 2.12 dynamo replays the restored ``__dict__`` wrongly
and raises ``AttributeError``; 2.6 and 2.4 warn that they cannot trace
``peek_interpreter_stack``; 2.7-2.10 are untried."""


def weights_only_reads_complex() -> None:
    """Let ``torch.load(weights_only=True)`` read Python complex numbers, as it does by itself
    from torch 2.5 on: on torch 2.4 this adds ``complex`` to its allowlist (once, for the process;
    a builtin type that runs no code), so Records holding complex numbers save and load there."""
    if _RELEASE < (2, 5) and complex not in torch.serialization.get_safe_globals():
        torch.serialization.add_safe_globals([complex])


peek_transform = torch._C._functorch.peek_interpreter_stack
"""The innermost active ``torch.func`` interpreter, or None outside transforms (a C call)."""
graph_task_id = torch._C._current_graph_task_id
"""The id of the backward pass running in this thread, -1 outside one (a C call)."""
_TOP_SAVING_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saving_hooks_active() -> bool:
    """Whether saved-tensor hooks are in force (a non-reentrant activation checkpoint's first
    pass, ``save_on_cpu``); True on a torch that cannot tell (a C call)."""
    return _TOP_SAVING_HOOKS is None or _TOP_SAVING_HOOKS(False) is not None
jit_tracing = torch._C._get_tracing_state
"""The state of a ``torch.jit.trace`` running in this thread, None outside one (a C call)."""


def transform_level() -> int:
    """The level of the innermost active ``torch.func`` transform; 0 outside transforms."""
    interpreter = peek_transform()
    return 0 if interpreter is None else interpreter.level()


MODULE_CALL_CODES = frozenset({nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__})
"""The code objects of ``Module.__call__``'s frames: a frame running one of them is a module call."""


def in_backward() -> bool:
    """True while autograd runs a backward pass in this thread: a module called now is being
    recomputed (activation checkpointing), not called by the user's forward."""
    return graph_task_id() != -1


def backward_pass() -> int:
    """An id of the backward pass running now (-1 outside one), to group gradients by pass."""
    return graph_task_id()


def after_backward(fn: Callable[[], None]) -> None:
    """Run `fn` when the backward pass running now has finished: after every callback queued
    during it (FSDP's, which completes the reduce-scatters, is one), whatever the order of
    queueing, since a callback queued by a callback runs after all of them. Call it from a hook
    that fires during the backward pass."""
    queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(lambda: queue(fn))


def backward_hook(module: nn.Module, hooks: list, pre_hooks: list) -> torch.utils.hooks.BackwardHook:
    """PyTorch's per-call full backward hook machinery (``setup_input_hook`` /
    ``setup_output_hook``), what ``Module._call_impl`` builds for registered backward hooks."""
    return torch.utils.hooks.BackwardHook(module, hooks, pre_hooks)


COMPILED_CALL = "_compiled_call_impl"
"""The instance attribute ``module.compile()`` sets: the module's ``_call_impl``, compiled, which
``Module.__call__`` calls instead of the plain one."""


def compiled_in_place(module: nn.Module) -> Callable[..., object] | None:
    """The compiled call ``module.compile()`` gave `module`, or None."""
    return module.__dict__.get(COMPILED_CALL)


def compile_attr(owner: nn.Module) -> str:
    """The instance attribute through which a compiled module is called: the ``forward`` of a
    ``torch.compile`` wrapper, the compiled call of a module compiled in place."""
    return "forward" if is_compile_wrapper(owner) else COMPILED_CALL


def compiled_model(owner: nn.Module) -> nn.Module:
    """The model a compiled module runs: a ``torch.compile`` wrapper's inner model, or the module
    compiled in place itself."""
    return owner._orig_mod if is_compile_wrapper(owner) else owner  # type: ignore[return-value]


def dynamo_context(owner: nn.Module, compiled: object) -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
    """The compile settings of a compiled module, as a function decorator: a ``torch.compile``
    wrapper's own; for a module compiled in place, those its compiled call (`compiled`) was made
    with, or None where they cannot be found."""
    if is_compile_wrapper(owner):
        return owner.dynamo_ctx  # type: ignore[return-value]
    # dynamo is imported already: the module was compiled
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            found = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(found, _TorchDynamoContext):
            return found
    return None


def is_compile_wrapper(module: nn.Module) -> bool:
    """True for the ``OptimizedModule`` that ``torch.compile(module)`` returns."""
    return type(module).__name__ in _WRAPPER_ATTRS


# -- trees with dataclasses: pytree's nodes, plus dataclass instances by their fields ---------


def _is_dataclass_value(x: object) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


_T = TypeVar("_T")

_Part: TypeAlias = "tuple[object, list[str], int, Structure] | None"
"""How :func:`flatten` took one leaf of pytree's apart: None for a leaf it kept; for a dataclass
instance, the instance without its field values, the field names, how many leaves the fields
gave and their structure."""
Structure: TypeAlias = "tuple[pytree.TreeSpec, list[_Part] | None]"
"""What :func:`unflatten` needs: pytree's spec, and how each of its leaves was taken apart
(None when no leaf is a dataclass instance). A plain tuple: it is made for every stored value."""


def flatten(value: object) -> tuple[list[Any], Structure]:
    """``pytree.tree_flatten`` that also looks inside dataclass instances (which pytree treats
    as opaque leaves unless registered), so their tensors are detached, checked and given
    gradients like any other output's. Returns the leaves and what :func:`unflatten` needs."""
    leaves, spec = pytree.tree_flatten(value)
    if not any(_is_dataclass_value(leaf) for leaf in leaves):
        return leaves, (spec, None)
    out: list[Any] = []
    parts: list[_Part] = []
    for leaf in leaves:
        if not _is_dataclass_value(leaf):
            parts.append(None)
            out.append(leaf)
            continue
        names = [f.name for f in dataclasses.fields(leaf)]
        inner, inner_spec = flatten([getattr(leaf, name) for name in names])
        skeleton = copy.copy(leaf)  # the instance without its field values
        for name in names:
            object.__setattr__(skeleton, name, None)
        parts.append((skeleton, names, len(inner), inner_spec))
        out.extend(inner)
    return out, (spec, parts)


def unflatten(leaves: list[Any], structure: Structure) -> Any:
    """The inverse of :func:`flatten`: dataclass instances come back as copies."""
    spec, parts = structure
    if parts is None:
        return pytree.tree_unflatten(leaves, spec)
    it = iter(leaves)
    top: list[object] = []
    for part in parts:
        if part is None:
            top.append(next(it))
            continue
        skeleton, names, n, inner_spec = part
        values = unflatten([next(it) for _ in range(n)], inner_spec)
        rebuilt = copy.copy(skeleton)
        for name, v in zip(names, values):
            object.__setattr__(rebuilt, name, v)
        top.append(rebuilt)
    return pytree.tree_unflatten(top, spec)


def map_tensors(fn: Callable[[torch.Tensor], object], value: _T) -> _T:
    """`value` with `fn` applied to every tensor in it (dataclass fields included)."""
    leaves, structure = flatten(value)
    return unflatten([fn(t) if isinstance(t, torch.Tensor) else t for t in leaves], structure)


def tensor_leaves(value: object) -> list[torch.Tensor]:
    """Every tensor in `value` (dataclass fields included), in flattening order."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in flatten(value)[0] if isinstance(t, torch.Tensor)]


# -- FSDP2 and DTensor: looked up only where torch.distributed has loaded them ----------------

_FSDP_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
"""Where ``FSDPModule`` lives: public since torch 2.6, ``_composable`` in torch 2.4 and 2.5."""
_DTENSOR_HOMES = ("torch.distributed.tensor", "torch.distributed._tensor")
"""Where ``DTensor`` lives: public since torch 2.5, ``_tensor`` in torch 2.4."""


def _loaded(homes: tuple[str, ...], name: str) -> type | None:
    """Class `name` from the first of `homes` already imported, else None: a module nobody
    imported defines no object anywhere, so nothing is imported here (FSDP takes seconds)."""
    for home in homes:
        cls = getattr(sys.modules.get(home), name, None)
        if isinstance(cls, type):
            return cls
    return None


def is_dtensor(t: object) -> bool:
    """True for a ``torch.distributed`` ``DTensor`` (a sharded or replicated tensor)."""
    cls = _loaded(_DTENSOR_HOMES, "DTensor")
    return cls is not None and isinstance(t, cls)


def shard_group(t: torch.Tensor) -> ProcessGroup | None:
    """For a ``DTensor`` sharded along a one-dimensional mesh (FSDP2's parameters and their
    gradients), the process group whose ranks' local shards together make the whole tensor;
    None for any other tensor (a plain one, or a ``DTensor`` replicated or on a larger mesh)."""
    if not is_dtensor(t):
        return None
    mesh = t.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim != 1 or not all(p.is_shard() for p in t.placements):  # type: ignore[attr-defined]
        return None
    return mesh.get_group()


def is_fsdp_module(module: nn.Module) -> bool:
    """True for a module ``fully_shard`` (FSDP2) has sharded: its class is then a subclass of
    ``FSDPModule`` made for it, with FSDP's forward hooks around every call."""
    cls = _loaded(_FSDP_HOMES, "FSDPModule")
    return cls is not None and isinstance(module, cls)


def own_class(module: nn.Module) -> type:
    """The class of `module` before ``fully_shard`` made it a subclass of ``FSDPModule``
    (``FSDPLinear`` -> ``Linear``); its class for any other module."""
    fsdp = _loaded(_FSDP_HOMES, "FSDPModule")
    if fsdp is None or not isinstance(module, fsdp):
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, fsdp))


def is_fsdp_hook(hook: object) -> bool:
    """True for a hook FSDP itself registered (its function lives in ``torch.distributed.fsdp``)."""
    fn = getattr(hook, "__func__", hook)
    return (getattr(fn, "__module__", None) or "").startswith(_FSDP_HOMES)


@contextlib.contextmanager
def sharding_kept(model: nn.Module) -> Iterator[None]:
    """A block after which `model`'s FSDP2 modules are sharded as before it: a forward without
    backward (under ``no_grad``) leaves the root's parameters unsharded, which ``reshard()``
    (FSDP's public method) undoes."""
    if _loaded(_FSDP_HOMES, "FSDPModule") is None:
        yield
        return
    before = [id(p) for p in model.parameters()]
    try:
        yield
    finally:
        if [id(p) for p in model.parameters()] != before:
            for module in model.modules():
                if is_fsdp_module(module):
                    module.reshard()  # type: ignore[operator]


def fsdp_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """``(path, sharded, unsharded)`` of each parameter an FSDP module manages: its path below
    the module, its ``DTensor`` shard, and the tensor FSDP all-gathers it into for a forward
    (None before the first). Read from FSDP's private state: empty where this torch keeps it
    elsewhere."""
    try:
        state = module._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        paths = {id(m): p for p, m in module.named_modules()}
        found = []
        for group in groups:
            for param in getattr(group, "fsdp_params", ()):
                info = param._module_info
                prefix = paths.get(id(info.module), "?")
                path = f"{prefix}.{info.param_name}" if prefix else info.param_name
                found.append((path, param.sharded_param, getattr(param, "_unsharded_param", None)))
        return found
    except (AttributeError, TypeError):
        return []
