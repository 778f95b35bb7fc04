"""Property-testing kit: Hypothesis strategies and invariant checks for your own models.

The same kit proves funhooks' own invariants in its test suite.

- :func:`models_and_inputs` draws small random models (linear, conv, norm and activation
  layers, nested containers, in-place activations, a module instance used twice, a module
  returning a tuple, a module called with keyword arguments) with a matching input;
- :func:`specs` draws valid specs for a model, with selectors taken from its real paths
  and types;
- :func:`assert_transparent` checks that observers change no output, gradient or buffer;
- :func:`assert_no_hooks` checks that nothing is left attached to a model;
- :func:`check_invariant` runs a model on drawn inputs and a predicate over every stored
  tensor (or over the whole Record), and reports the shrunk input with the module path
  that broke it;
- ready-made invariants, each blaming the innermost module where it first breaks:
  :func:`check_batch_independence`, :func:`check_causality` (``independence.py``),
  :func:`check_equivariance`, :func:`check_determinism`,
  :func:`check_train_eval_consistency` (``symmetry.py``),
  :func:`check_finite`, :func:`check_gradients_reach` (``flow.py``),
  :func:`check_init_scale`, :func:`check_dead_units` (``health.py``).

Hypothesis is an optional dependency (the ``test`` extra): it is imported when a strategy
or :func:`check_invariant` is called, never by ``import funhooks``.

Cost: :func:`assert_transparent` runs the model twice (forward and backward) and keeps a
copy of its gradients and buffers; strategies draw tiny models (a few hundred parameters).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _invariant, _models, _torch
from ._core import forward as _forward
from ._core.plan import never_called
from . import run as _run
from . import spec as _spec
from .errors import SpecError
from .selector import path_label
from .flow import check_finite, check_gradients_reach
from .health import check_dead_units, check_init_scale
from .independence import check_batch_independence, check_causality
from .record import Record
from .symmetry import check_determinism, check_equivariance, check_train_eval_consistency

if TYPE_CHECKING:  # pragma: no cover - types only
    import hypothesis
    from hypothesis import strategies as st

__all__ = [
    "assert_no_hooks",
    "assert_transparent",
    "check_batch_independence",
    "check_causality",
    "check_dead_units",
    "check_determinism",
    "check_equivariance",
    "check_finite",
    "check_gradients_reach",
    "check_init_scale",
    "check_invariant",
    "check_train_eval_consistency",
    "models_and_inputs",
    "specs",
    "tensors",
]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _hypothesis() -> Any:
    try:
        import hypothesis
    except ImportError:
        raise ImportError(
            "funhooks.testing: the strategies and `check_invariant` need Hypothesis, got no module "
            "named 'hypothesis'. Install the test extra: `pip install funhooks[test]`."
        ) from None
    return hypothesis


# -- hooks left behind -----------------------------------------------------------------------


def _function(hook: Any) -> Any:
    """The plain function behind a hook (bound methods and partials looked through)."""
    while True:
        inner = getattr(hook, "__func__", None) or getattr(hook, "func", None)
        if inner is None or inner is hook:
            return hook
        hook = inner


def _owner(hook: Any) -> str:
    fn = _function(hook)
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{getattr(fn, '__qualname__', type(fn).__name__)}"


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _is_funhooks(hook: Any) -> bool:
    """Whether the hook's code lives in this package (not: whose module name it claims)."""
    code = getattr(_function(hook), "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_PACKAGE + os.sep)


def _left(where: str, what: str, hooks: list[Any], funhooks_only: bool) -> None:
    """Raise for the hooks in `what`: funhooks' own always, others' unless `funhooks_only`."""
    ours = [h for h in hooks if _is_funhooks(h)]
    if ours:
        raise AssertionError(
            f"assert_no_hooks: {where} has {len(ours)} funhooks hook(s) in `{what}`, got {ours!r}. Exit every "
            "`with_hooks` block and close every `train`/`evaluate` generator."
        )
    if hooks and not funhooks_only:
        owners = sorted({_owner(h) for h in hooks})
        raise AssertionError(
            f"assert_no_hooks: {where} has {len(hooks)} hook(s) in `{what}` installed by {owners}, not by funhooks, "
            f"got {hooks!r}. Remove them, or pass `funhooks_only=True` to check only what funhooks attaches."
        )


def assert_no_hooks(model: nn.Module, *, funhooks_only: bool = False) -> None:
    """Assert that nothing is attached to `model`: no module, parameter or buffer hook, and no
    ``forward`` still wrapped by a funhooks run.

    funhooks itself registers no module hook; a run wraps the hooked modules' ``forward`` and
    sets hooks on watched tensors only while its block is open. Other libraries keep hooks on
    purpose (HF ``transformers`` installs output-capturing hooks after an
    ``output_hidden_states=True`` call): the message names their owner, and
    ``funhooks_only=True`` checks only what funhooks attaches. The hooks FSDP2's
    ``fully_shard`` puts on the modules it shards are part of the sharded model, as its class
    is, and are never counted; the unsharded parameters it all-gathers for a forward are
    checked with the module's own tensors.

    Args:
        model: the model to inspect (DDP / ``torch.compile`` wrappers included).
        funhooks_only: ignore hooks whose function is not funhooks'.

    Raises:
        AssertionError: naming the module path, what is left and who left it.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> with fh.with_hooks(model, fh.grads("0")) as run:
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> fh.testing.assert_no_hooks(model)
        >>> handle = model[0].register_forward_hook(lambda m, i, o: None)
        >>> fh.testing.assert_no_hooks(model, funhooks_only=True)
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise SpecError(f"assert_no_hooks: `model` is an nn.Module, got {type(model).__name__}. Pass the model.")
    for path, module in model.named_modules(remove_duplicate=False):
        where = f"module {path_label(path)}"
        for attr in ("forward", "_call_impl"):
            wrapped = module.__dict__.get(attr)
            if isinstance(wrapped, _forward.Forward):
                raise AssertionError(
                    f"assert_no_hooks: {where} still has its `{attr}` wrapped by funhooks, got {wrapped!r} with "
                    f"{len(wrapped.users)} active run(s). Exit every `with_hooks` block and close every "
                    "`train`/`evaluate` generator."
                )
        reducer = module.__dict__.get("__reduce_ex__")
        if isinstance(getattr(reducer, "__self__", None), _forward.Forward):
            raise AssertionError(
                f"assert_no_hooks: {where} still has a `__reduce_ex__` set by a funhooks run, got {reducer!r}. "
                "Exit every `with_hooks` block."
            )
        fsdp = _torch.is_fsdp_module(module)
        for attr in _HOOK_DICTS:
            hooks = list(getattr(module, attr, {}).values())
            _left(where, attr, [h for h in hooks if not _torch.is_fsdp_hook(h)] if fsdp else hooks, funhooks_only)
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if fsdp:
            tensors += [(f"{path} (unsharded by FSDP)", t) for path, _, t in _torch.fsdp_parameters(module) if t is not None]
        for name, tensor in tensors:
            for attr in _TENSOR_HOOK_DICTS:
                _left(f"tensor {name!r} of {where}", attr, list((getattr(tensor, attr, None) or {}).values()),
                      funhooks_only)


# -- transparency ----------------------------------------------------------------------------


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in _torch.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical up to NaN payloads: same shape, dtype, device and values."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _leaf_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Fresh copies of the float tensors in ``(args, kwargs)``, made leaves that need grad."""
    leaves: list[torch.Tensor] = []

    def fresh(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach().clone()
            if x.is_floating_point():
                x.requires_grad_(True)
                leaves.append(x)
        return x

    new_args, new_kwargs = _torch.tree_map(fresh, (args, kwargs))
    return new_args, new_kwargs, leaves


def _one_pass(model: nn.Module, args: tuple, kwargs: dict, state: dict[str, torch.Tensor],
              run: Any) -> dict[str, list[torch.Tensor]]:
    """Forward and backward from `state`; what a user of the model can see afterwards."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.copy_(state[name])
    params = list(model.parameters())
    for p in params:
        p.grad = None
    args, kwargs, leaves = _leaf_inputs(args, kwargs)
    with contextlib.nullcontext() if run is None else run:
        out = model(*args, **kwargs)
        _backward(out)
    outputs = [t.detach() for t in _tensor_leaves(out)]
    return {
        "output": outputs,
        "input gradient": [x.grad if x.grad is not None else torch.zeros(0) for x in leaves],
        "parameter gradient": [p.grad if p.grad is not None else torch.zeros(0) for p in params],
        "buffer": [b.detach().clone() for b in model.buffers()],
    }


def _backward(out: Any) -> None:
    needs = [t for t in _tensor_leaves(out) if t.requires_grad]
    if needs:
        torch.stack([t.float().sum() for t in needs]).sum().backward()


def assert_transparent(model: nn.Module, specs: _spec.Spec | Iterable[_spec.Spec], *args: Any, **kwargs: Any) -> None:
    """Assert that running observer `specs` changes nothing the model computes.

    Runs ``model(*args, **kwargs)`` and a backward pass (of the sum of its float outputs)
    once bare and once inside ``with_hooks(model, specs)``, from the same parameters and
    buffers, and compares bit for bit: every output, the gradient of every float input,
    every parameter gradient and every buffer (BatchNorm statistics). Afterwards the model's
    state and gradients are as before and :func:`assert_no_hooks` holds. The model must be
    deterministic (on CUDA set ``torch.backends.cudnn.deterministic = True``).

    Args:
        model: the model.
        specs: observers (a Spec or an iterable of Specs); editors change values by design.
        *args, **kwargs: the model's inputs (float tensors are copied and made to need grad).

    Raises:
        SpecError: when `specs` holds an editor (``fh.edit``).
        AssertionError: naming what changed (output, input gradient, parameter gradient or
            buffer), its index and the largest difference.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
        >>> fh.testing.assert_transparent(model, [fh.outputs("**", clone=True), fh.grads("0")], torch.randn(2, 3))
    """
    spec_tuple = _run._as_specs(specs, "assert_transparent")
    for s in spec_tuple:
        if s.is_edit:
            raise SpecError(
                f"assert_transparent: `specs` are observers, got the editor {s!r}. Editors change "
                "values by design; drop them, or compare the edited model yourself."
            )
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    grads_before = [p.grad for p in model.parameters()]
    try:
        bare = _one_pass(model, args, kwargs, state, None)
        hooked = _one_pass(model, args, kwargs, state, _run.with_hooks(model, spec_tuple))
    finally:
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                t.copy_(state[name])
        for p, g in zip(model.parameters(), grads_before):
            p.grad = g
    for what, values in bare.items():
        other = hooked[what]
        if len(values) != len(other):
            raise AssertionError(
                f"assert_transparent: observers must change no {what}, got {len(other)} {what}(s) "
                f"with {spec_tuple!r} and {len(values)} without. Fix the observer's function."
            )
        for i, (a, b) in enumerate(zip(values, other)):
            if not _same(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
                raise AssertionError(
                    f"assert_transparent: observers must change no {what}, got {what} {i} changed "
                    f"(largest difference {diff}) by {spec_tuple!r}. An observer's function must not "
                    "modify its arguments in place; return a new value instead."
                )
    assert_no_hooks(model)


# -- strategies ----------------------------------------------------------------------------


def tensors(shape: Iterable[int], *, min_value: float = -10.0, max_value: float = 10.0,
            dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> st.SearchStrategy[torch.Tensor]:
    """A strategy for float tensors of `shape` whose elements Hypothesis draws and shrinks.

    Every element is drawn, so keep `shape` small (up to a few hundred elements); for large
    inputs map a seed to ``torch.randn`` instead.

    Args:
        shape: the tensor's shape.
        min_value, max_value: the range of the elements (rounded to `dtype`).
        dtype: a floating dtype.
        device: where the tensor lives.

    Returns:
        A Hypothesis strategy.

    Example:
        >>> import funhooks as fh
        >>> from hypothesis import find
        >>> big = find(fh.testing.tensors((2, 3), min_value=0, max_value=1), lambda x: x.sum() > 2)
        >>> big.shape, bool(((0 <= big) & (big <= 1)).all())
        (torch.Size([2, 3]), True)
    """
    st = _hypothesis().strategies
    shape = tuple(int(n) for n in shape)
    count = 1
    for n in shape:
        count *= n
    elements = st.floats(min_value, max_value, allow_nan=False)
    return st.lists(elements, min_size=count, max_size=count).map(
        lambda xs: torch.tensor(xs, dtype=dtype, device=device).reshape(shape)
    )


# Random models are built from these small modules; each has a readable repr for Hypothesis.


def models_and_inputs(*, max_depth: int = 2, device: str | torch.device = "cpu") -> st.SearchStrategy[tuple[nn.Module, torch.Tensor]]:
    """A strategy for ``(model, x)``: a small random model and an input it accepts.

    Models are nested containers (``nn.Sequential``, loops over ``nn.ModuleList``,
    residual blocks) of linear, conv, norm (BatchNorm, LayerNorm, GroupNorm) and activation
    layers, including in-place activations (only where autograd allows them), one module
    instance called twice, a module returning a tuple that is unpacked into the next, and a
    module called with a keyword argument. Inputs are ``(batch, features)`` or
    ``(batch, channels, height, width)`` float tensors with a batch of 2 to 4 (BatchNorm
    needs two), drawn from a seed. Models are in training mode and deterministic.

    Args:
        max_depth: how deeply containers nest.
        device: where the model and input live.

    Returns:
        A Hypothesis strategy; shrinking simplifies the model and the seed.

    Example:
        >>> import funhooks as fh
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=5, deadline=None)
        ... @given(fh.testing.models_and_inputs())
        ... def test_runs(model_and_input):
        ...     model, x = model_and_input
        ...     assert model(x) is not None
        >>> test_runs()
    """
    hyp = _hypothesis()
    st = hyp.strategies

    @st.composite
    def draw_pair(draw: Callable[..., Any]) -> tuple[nn.Module, torch.Tensor]:
        batch = draw(st.integers(2, 4))
        if draw(st.booleans()):
            shape: tuple = ("vec", draw(st.integers(1, _models.MAX_FEATURES)))
            size: tuple = (batch, shape[1])
        else:
            side = draw(st.integers(2, _models.MAX_SIDE))
            shape = ("img", draw(st.integers(1, _models.MAX_CHANNELS)), side)
            size = (batch, shape[1], side, side)
        layers, _, _ = _models.blocks(draw, st, shape, max_depth, False)
        seed = draw(st.integers(0, 2**31 - 1))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = nn.Sequential(*layers)
            x = torch.randn(size)
        return model.to(device), x.to(device)

    return draw_pair()


# -- specs for a model -------------------------------------------------------------------


def _output_mean(module: nn.Module, args: tuple, output: Any) -> torch.Tensor:
    """The mean of every float tensor in `output`, stacked (a forward observer)."""
    return torch.stack([t.float().mean() for t in _tensor_leaves(output)] or [torch.zeros(())])


def _arg_count(module: nn.Module, args: tuple) -> torch.Tensor:
    """The number of positional arguments (a ``forward_pre`` observer)."""
    return torch.tensor(len(args))


def _grad_norm(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The norm of a parameter's gradient (a ``param_grad`` observer)."""
    return grad.detach().norm()


def specs(model: nn.Module, *, clone: bool | None = None, max_specs: int = 3) -> st.SearchStrategy[tuple[_spec.Spec, ...]]:
    """A strategy for a tuple of valid observer specs for `model`.

    Each spec is one of ``outputs``, ``inputs``, ``grads`` or ``observe`` (forward,
    forward_pre and param_grad events, with tensor-valued functions), at most one per
    record name so they never clash. Selectors are drawn from the model's real paths
    (``""`` is the root), its module types, ``"**"``, path patterns with a ``*`` segment,
    and its module instances; flags (``detach``, ``cpu``, ``clone``) are drawn too.

    Args:
        model: the model the specs are for.
        clone: force ``clone=`` on every spec (``True`` makes every Record readable after
            in-place ops); ``None`` draws it.
        max_specs: the most specs in one draw.

    Returns:
        A Hypothesis strategy of tuples of Specs, each of which ``with_hooks`` accepts.

    Example:
        >>> import torch, funhooks as fh
        >>> from hypothesis import given, settings
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> @settings(max_examples=5, deadline=None)
        ... @given(fh.testing.specs(model))
        ... def test_transparent(specs):
        ...     fh.testing.assert_transparent(model, specs, torch.ones(2, 2))
        >>> test_transparent()
    """
    st = _hypothesis().strategies
    every = list(_torch.named_modules(model))
    modules = [(p, m) for p, m in every if not never_called(m)]  # a ModuleList alone is refused
    paths = [p for p, _ in modules]
    types = sorted({type(m) for _, m in modules}, key=lambda t: t.__qualname__)
    patterns = sorted({".".join("*" if i == k else s for i, s in enumerate(p.split("."))) + tail
                       for p, _ in every if p for k in range(p.count(".") + 1) for tail in ("", ".**")})
    patterns = [p for p in patterns if any(not never_called(m) for _, m in _spec.select(p).resolve(model))]
    param_modules = [m for _, m in modules if any(True for _ in m.parameters(recurse=False))]
    where = st.one_of(
        st.sampled_from(paths),
        st.sampled_from(types),
        st.just("**"),
        st.sampled_from(patterns) if patterns else st.just("**"),
        st.sampled_from([m for _, m in modules]),
    )
    flag = st.booleans()

    @st.composite
    def draw_specs(draw: Callable[..., Any]) -> tuple[_spec.Spec, ...]:
        kinds = ["outputs", "inputs", "grads", "observe_forward", "observe_pre"]
        if param_modules:
            kinds.append("observe_param")
        chosen = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=max_specs, unique=True))
        out = []
        for kind in chosen:
            sel = draw(where)
            if kind == "observe_param":
                sel = draw(st.sampled_from(param_modules))
            flags = {"detach": draw(flag), "cpu": draw(flag),
                     "clone": draw(flag) if clone is None else clone}
            if kind == "outputs":
                out.append(_spec.outputs(sel, **flags))
            elif kind == "inputs":
                out.append(_spec.inputs(sel, **flags))
            elif kind == "grads":
                out.append(_spec.grads(sel, **flags))
            elif kind == "observe_forward":
                out.append(_spec.observe(sel, _output_mean, name="mean", **flags))
            elif kind == "observe_pre":
                out.append(_spec.observe(sel, _arg_count, event="forward_pre", name="arg_count", **flags))
            else:
                out.append(_spec.observe(sel, _grad_norm, event="param_grad", name="grad_norm", **flags))
        return tuple(out)

    return draw_specs()


# -- invariants ----------------------------------------------------------------------------

_MAX_REPORTED = 5


def _failures(predicate: Callable[..., Any], rec: Any) -> list[tuple[str, str]]:
    """Every ``(path, where)`` for which `predicate` fails, innermost modules first: a
    container fails because a submodule did, so the submodule is the one to report."""
    found = []
    for path, node in rec.items():
        for name in node:
            calls = node.calls(name)
            for i, value in enumerate(calls):
                leaves = _tensor_leaves(value)
                for j, t in enumerate(leaves):
                    if not bool(predicate(path, name, t)):
                        part = f" (tensor {j + 1} of {len(leaves)})" if len(leaves) > 1 else ""
                        found.append((path, f"the {name!r} of module {path_label(path)}{part}, call {i + 1} of {len(calls)}"))
                        break
    paths = {p for p, _ in found}

    def is_outer(path: str) -> bool:
        return any(q != path and (not path or q.startswith(path + ".")) for q in paths)

    return sorted(found, key=lambda f: is_outer(f[0]))


def _takes_record(predicate: Callable[..., Any]) -> bool:
    """Whether `predicate` takes one argument (a Record) rather than ``(path, name, tensor)``."""
    try:
        params = inspect.signature(predicate).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: the per-tensor form
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len([p for p in positional if p.default is p.empty]) == 1


def _record_failure(predicate: Callable[[Record], Any], rec: Record) -> str | None:
    """Where a Record predicate fails: the innermost module, first in module order, whose
    record alone makes it false; the whole Record when none does; None when it holds."""
    if bool(predicate(rec)):
        return None
    alone = []
    for path, node in rec.items():
        try:
            holds = bool(predicate(Record({path: {name: node.calls(name) for name in node}})))
        except Exception:  # noqa: BLE001, S112 - a predicate about several modules need not accept one alone
            continue
        if not holds:
            alone.append(path)
    inner = _invariant.innermost(alone)
    if inner is None:
        return "the whole Record (no module's record alone makes it false)"
    return f"the record of module {path_label(inner)} alone"


def check_invariant(
    model: nn.Module,
    predicate: Callable[[str, str, torch.Tensor], Any] | Callable[[Record], Any],
    inputs_strategy: st.SearchStrategy[Any],
    *,
    specs: _spec.Spec | Iterable[_spec.Spec] = _spec.outputs("**"),
    settings: hypothesis.settings | None = None,
) -> None:
    """Check that `predicate` holds for what `model` stores on every drawn input.

    For each input drawn from `inputs_strategy` (a tuple is spread as positional
    arguments), the model runs inside ``with_hooks(model, specs)`` (and, when a spec has a
    backward event, a backward pass of the sum of its outputs). A predicate of three
    arguments, ``predicate(path, name, tensor)``, is called for every stored tensor of the
    Record: every call, every tensor of a tuple output or an ``(args, kwargs)`` input. A
    predicate of one argument, ``predicate(record)``, is called with the whole Record, for
    invariants across modules. A falsy result is a failure: Hypothesis shrinks the input and
    the error names the module path (for a Record predicate: the innermost module whose
    record alone makes it false, if any), with the shrunk input. Call it from a plain test,
    not a ``@given`` one.

    Args:
        model: the model (its train/eval mode is used as it is).
        predicate: ``(path, name, tensor) -> bool`` or ``(record) -> bool``.
        inputs_strategy: a Hypothesis strategy of inputs.
        specs: what to store; every module's output by default.
        settings: Hypothesis settings; default: the loaded profile without a deadline.

    Raises:
        AssertionError: first line ``check_invariant: ...`` naming the module path, then
            the shrunk input.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        >>> in_range = lambda path, name, out: bool((out.abs() <= 1).all())
        >>> fh.testing.check_invariant(model, in_range, fh.testing.tensors((3, 2)), specs=fh.outputs(nn.Tanh))
        >>> shrinks = lambda rec: rec["1"]["output"].abs().sum() <= rec["0"]["output"].abs().sum()
        >>> fh.testing.check_invariant(model, shrinks, fh.testing.tensors((3, 2)))
    """
    hyp = _hypothesis()
    spec_tuple = _run._as_specs(specs, "check_invariant")
    if not callable(predicate):
        raise SpecError(
            "check_invariant: `predicate` is a callable `(path, name, tensor) -> bool` or `(record) -> bool`, "
            f"got {predicate!r}. Pass a function such as `lambda path, name, out: bool(out.isfinite().all())`."
        )
    on_record = _takes_record(predicate)
    needs_backward = any(s.needs_backward for s in spec_tuple)
    if settings is None:
        settings = hyp.settings(hyp.settings.default, deadline=None)

    @settings
    @hyp.given(inputs_strategy)
    def holds(drawn: Any) -> None:
        args = drawn if isinstance(drawn, tuple) else (drawn,)
        with torch.set_grad_enabled(needs_backward), _run.with_hooks(model, spec_tuple) as run:
            out = model(*args)
            if needs_backward:
                _backward(out)
        if on_record:
            where = _record_failure(predicate, run.record)  # type: ignore[arg-type]
            if where is not None:
                raise AssertionError(
                    f"check_invariant: `predicate` must hold for the Record, got False for {where}. "
                    f"Fix the model or the invariant.\ninput: {drawn!r}"
                )
            return
        failures = _failures(predicate, run.record)
        if failures:
            also = "".join(f"\nalso false for {where}" for _, where in failures[1:_MAX_REPORTED])
            more = len(failures) - _MAX_REPORTED
            raise AssertionError(
                f"check_invariant: `predicate` must hold for every stored tensor, got False for "
                f"{failures[0][1]}. Fix the model or the invariant.{also}"
                + (f"\n... and {more} more" if more > 0 else "")
                + f"\ninput: {drawn!r}"
            )

    holds()
