"""The standard points of a transformer: one spelling for every supported family.

``fh.transformer.points(model)`` finds the model's :class:`~funhooks.transformer.Architecture`
and returns a :class:`Points` value whose attributes (``resid_pre``, ``q``, ``pattern`` ...)
are :class:`Point` values, usable as ``where`` in the spec constructors (``fh.outputs``,
``fh.grads``, ``fh.patch``, ``fh.steer``, ``fh.scale``, ``fh.ablate``, and ``fh.observe`` /
``fh.edit``, whose ``fn(module, args, value)`` gets the point's value in place of the output). A point makes the spec
of the place that holds it on this model:

- a module's output (``resid_post``: the block's; ``resid_pre[L]``: block ``L - 1``'s, or the
  embeddings' for layer 0): the very spec a module path makes, so it costs what the path costs;
- a view of a module's output or input (``q``/``k``/``v``: the projection's output with the heads
  split off; ``z``: the output projection's input), read through the view and edited through it;
- an op inside a module (``resid_mid``: the block's first ``add``; ``pattern`` and ``attn_scores``:
  ``fh.attention_pattern`` / ``fh.attention_scores``, read off eager attention's ``softmax`` or
  computed from what SDPA receives, so both are ``(batch, head, query, key)`` under either).

Values are stored under the point's Record path, ``"blocks.3.resid_pre"`` for a per-layer point
and ``"embed"`` / ``"final_norm"`` / ``"logits"`` for the others, whatever the family, so one
analysis runs on all of them and a Record of points is a source for a patch of points.

Cost: building a ``Points`` walks the model's modules once; a spec made from a point is built
once, like any spec; nothing runs per forward beyond what the spec made does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import attrs
from torch import Tensor, nn

from funhooks import _frozen
from funhooks.errors import SpecError
from funhooks.specs.attention import attention_pattern, attention_scores
from funhooks.specs.editing import Intervention, View
from funhooks.specs.ops import Op, around_spec, op
from funhooks.specs.selector import Selector, select
from funhooks.specs.spec import Event, Located, Spec, check_flags, record_name

from . import _result
from .architectures import Architecture, architecture
from .views import Heads, Interleaved, Thirds

__all__ = ["Point", "Points", "points"]

_PER_LAYER = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_in", "mlp_pre", "mlp_post", "mlp_out",
             "q", "k", "v", "z", "result", "pattern", "attn_scores")
_GLOBAL = ("embed", "pos_embed", "final_norm", "logits")
_NAMES = ("embed", "pos_embed", *_PER_LAYER, "final_norm", "logits")
"""The standard names, in the order a forward meets them."""
_STORES = ("outputs", "grads")
_EDITS = ("patch", "steer", "scale", "ablate")
_CALLS = ("observe", "edit")


class _Read:
    """A point's read of the value a hook sees: element 0 of a tuple output (or of the
    args, or of the gradients), through the point's view. Its empty ``__name__`` keeps the
    spec's repr that of the point."""

    __name__ = ""
    __slots__ = ("at", "view")

    def __init__(self, view: View | None, at: int) -> None:
        self.view, self.at = view, at  # at: which hook argument holds the value (after the module)

    def __call__(self, module: nn.Module, *hook_args: Any) -> Any:
        value = hook_args[self.at]
        if value is not None and not isinstance(value, Tensor):  # a tuple: its first tensor
            value = value[0]
        return value if self.view is None or value is None else self.view.get(value)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Read and (other.view, other.at) == (self.view, self.at)

    def __hash__(self) -> int:
        return hash((_Read, self.view, self.at))


class _Call:
    """A user's function on a point's value: ``fn(module, args, value)`` (the forward hook's
    signature with the point's value in place of the output), called by the hook that sees the
    point (a forward hook for an output, a forward-pre hook for an input, an op editor for an op's
    result). An editor's result is written back where the value was read: through the view, into
    element 0 of a tuple, as the first argument. Named after `fn`, so the spec's repr and record
    name are `fn`'s."""

    __slots__ = ("__name__", "edits", "fn", "kind", "view")

    def __init__(self, fn: Callable[..., object], kind: str, view: View | None, edits: bool) -> None:
        self.fn, self.kind, self.view, self.edits = fn, kind, view, edits
        self.__name__ = getattr(fn, "__name__", repr(fn))

    def __call__(self, module: nn.Module, args: tuple, *rest: Any) -> Any:
        held = args if self.kind == "input" else rest[-1]  # op editors also get the op's kwargs
        whole = held[0] if isinstance(held, tuple) else held
        value = whole if self.view is None else self.view.get(whole)
        new: Any = self.fn(module, args, value)
        if not self.edits or new is None:
            return new
        if not hasattr(new, "shape") or new.shape != value.shape:
            raise ValueError(f"an editor of a standard point returns a tensor shaped like the point's value, "
                             f"{tuple(value.shape)}, got {getattr(new, 'shape', type(new).__name__)}. Return one "
                             "of that shape (or None to leave it)")
        new = new if self.view is None else self.view.put(whole, new)
        return (new, *held[1:]) if isinstance(held, tuple) else new

    def __eq__(self, other: object) -> bool:
        return type(other) is _Call and (other.fn, other.kind, other.view, other.edits) == (
            self.fn, self.kind, self.view, self.edits)

    def __hash__(self) -> int:
        return hash((_Call, self.fn, self.kind, self.view, self.edits))


@_frozen.frozen
@attrs.frozen(repr=False)
class Point(Located):
    """A standard point of one model, for all its layers or some of them: a where-value.

    Index it to take layers (``pts.resid_pre[3]``, ``pts.q[-1]``, ``pts.z[:2]``, ``pts.v[[0, 2]]``).

    Example:
        >>> import transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> pts = fh.transformer.points(model)
        >>> pts.resid_pre[1], fh.outputs(pts.resid_pre[1])
        (resid_pre[1], outputs(resid_pre[1]))
    """

    name: str
    kind: str
    """Where the value is: a module's ``output``, its ``input`` (first argument), or an ``op``'s
    result inside it; ``result`` for the heads' results computed on the output projection
    (``heads.py``); ``none`` where this model has no such point (`why` says so)."""
    paths: tuple[tuple[int | None, str], ...]
    """``(layer, module path)`` per layer taken (layer None for a global point)."""
    n_layers: int
    view: View | None = None
    op: Op | None = None
    why: str = ""
    layered: bool = False
    """Taken by indexing: the repr names the layers."""
    tensor: bool = True
    """The module returns the value itself (not a tuple holding it): stored by the plain spec."""
    width: int = 0
    """The size of the value's last dimension on this model (``d_model`` for the residual stream,
    ``d_head`` for ``q``/``k``/``v``/``z``, the MLP's width for ``mlp_pre``/``mlp_post``, the
    vocabulary for ``logits``), read when the points are made; 0 where it is not read (an op's
    value, a module of a registered family that is neither ``nn.Linear``, ``Conv1D``,
    ``nn.Embedding`` nor a norm, layers of different widths)."""
    heads: int = 0
    """The size of the head dimension before the last (``q``/``k``/``v``/``z``/``result``);
    0 for a value without one."""

    def __repr__(self) -> str:
        if not self.layered:
            return self.name
        layers = [layer for layer, _ in self.paths]
        return f"{self.name}[{layers[0]}]" if len(layers) == 1 else f"{self.name}[{layers}]"

    def __getitem__(self, layers: int | slice | Sequence[int]) -> Point:
        if self.paths and self.paths[0][0] is None:
            raise SpecError(f"points: `{self.name}` is one value for the whole model, not one per layer, got "
                            f"`{self.name}[{layers!r}]`. Use `{self.name}` without an index.")
        by_layer = dict(self.paths)
        n = self.n_layers
        if isinstance(layers, slice):
            taken = list(range(n))[layers]
        else:
            wanted = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else list(layers) \
                if isinstance(layers, Sequence) else [layers]
            taken = []
            for layer in wanted:
                if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer < n:
                    raise SpecError(f"points: `{self.name}` has one value per layer of the model's {n} layers, got "
                                    f"layer {layer!r}. Pass a layer in [{-n}, {n}) (negative from the last), a "
                                    "slice or a list of them.")
                taken.append(layer % n)
        if not taken:
            raise SpecError(f"points: `{self.name}[{layers!r}]` takes no layer of the model's {n}. Take at least one.")
        missing = [layer for layer in taken if layer not in by_layer]
        if missing:
            raise SpecError(f"points: `{self.name}` here holds layers {[layer for layer, _ in self.paths]}, got {missing}. Index the "
                            f"full point, `pts.{self.name}[...]`.")
        return attrs.evolve(self, paths=tuple((layer, by_layer[layer]) for layer in taken), layered=True)

    @property
    def keys(self) -> tuple[str, ...]:
        """The Record paths its values are stored under, in layer order.

        Example:
            >>> import transformers, funhooks as fh
            >>> transformers.logging.set_verbosity_error()
            >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
            >>> fh.transformer.points(model).resid_post.keys
            ('blocks.0.resid_post', 'blocks.1.resid_post')
        """
        return tuple(self.name if layer is None else f"blocks.{layer}.{self.name}" for layer, _ in self.paths)

    def spec(self, label: str, **options: Any) -> Spec:
        """The spec constructor `label` makes for this point (see :class:`~funhooks.specs.spec.Located`)."""
        if self.kind == "none":
            raise SpecError(f"{label}: {self.why}, got `{self!r}`. Use another point (see docs/transformers.md).")
        if label not in _STORES + _EDITS + _CALLS:
            raise SpecError(
                f"{label}: a standard point is a value, not a module, and takes `fh.outputs`, `fh.grads`, "
                f"`fh.observe`, `fh.edit`, `fh.patch`, `fh.steer`, `fh.scale` or `fh.ablate`, got `{self!r}`. "
                f"Read it with `fh.outputs(pts.{self.name})`, or give {label} modules: `pts.blocks`, `pts.attn`, "
                "`pts.mlp` or a module path."
            )
        where = select([path for _, path in self.paths])
        if self.kind == "result":  # computed from `z` and the projection's weight (_result.py)
            made = _result.result_spec(label, where, cast(Heads, self.view).n, repr(self), **options)
            return attrs.evolve(made, labels=tuple(zip((p for _, p in self.paths), self.keys)), shown=repr(self))
        made = self._edit(label, where, **options) if label in _EDITS else self._call(label, where, **options) \
            if label in _CALLS else self._store(label, where, **options)
        return attrs.evolve(made, labels=tuple(zip((p for _, p in self.paths), self.keys)), shown=repr(self))

    def _store(self, label: str, where: Selector, **flags: bool) -> Spec:
        if self.op is not None:
            if label == "grads":
                raise SpecError(f"grads: `{self.name}` is the value of an op inside a module, where no gradient is "
                                f"watched, got `{self!r}`. Take the gradient of a module's point (e.g. "
                                "`pts.resid_post`, `pts.mlp_in`).")
            return around_spec(label, where, self.op, "output", name="output", **check_flags(label, **flags))
        name: Literal["output", "grad"] = "output" if label == "outputs" else "grad"
        event: Event
        if self.kind == "output" and self.view is None and self.tensor:  # the module path's own spec
            event = "forward" if label == "outputs" else "backward_pre"
            return Spec(where=where, event=event, role=name, name=name, label=label, **check_flags(label, **flags))
        events: dict[tuple[str, str], Event] = {("output", "outputs"): "forward", ("input", "outputs"): "forward_pre",
                  ("output", "grads"): "backward_pre", ("input", "grads"): "backward"}
        event = events[(self.kind, label)]
        at = {"forward": 1, "forward_pre": 0, "backward_pre": 0, "backward": 0}[event]
        return Spec(where=where, event=event, role="call", name=name, fn=_Read(self.view, at), label=label,
                    **check_flags(label, **flags))

    def _call(self, label: str, where: Selector, *, fn: Callable[..., object], event: str, name: str | None,
              **flags: bool) -> Spec:
        if event != "forward":
            raise SpecError(f"{label}: a standard point is a value of the forward pass, seen with "
                            f"`event=\"forward\"`, got event={event!r} with `{self!r}`. Leave `event` out (for its "
                            f"gradient, use `fh.grads(pts.{self.name})`).")
        edits = label == "edit"
        if self.op is not None:
            if not edits:
                raise SpecError(f"observe: `{self.name}` is the value of an op inside a module, which no observer "
                                f"sees, got `{self!r}`. Store it with `fh.outputs(pts.{self.name})` and apply the "
                                f"function to the Record's values, or edit it with `fh.edit(pts.{self.name}, fn)`.")
            return around_spec("edit", where, self.op, "edit", _Call(fn, "op", None, True), name=name)
        plain = self.kind == "output" and self.view is None and self.tensor  # fn is the module path's hook
        call = fn if plain else _Call(fn, self.kind, self.view, edits)
        hook: Event = "forward" if self.kind == "output" else "forward_pre"
        if edits:
            return Spec(where=where, event=hook, role="call", name=name, fn=call, is_edit=True, label="edit")
        return Spec(where=where, event=hook, role="call", name=record_name("observe", fn, name), fn=call, label="observe",
                    **check_flags("observe", **flags))

    def _edit(self, label: str, where: Selector, *, intervention: Intervention, op: object = None) -> Spec:
        if op is not None:
            raise SpecError(f"{label}: a standard point already says where the value is, got `op={op!r}` with "
                            f"`{self!r}`. Leave `op` out, or give {label} a module (`pts.attn`) with `op=`.")
        if self.op is not None:
            return around_spec(label, where, self.op, "intervene", intervention=intervention)
        event: Event = "forward" if self.kind == "output" else "forward_pre"
        return Spec(where=where, event=event, role="intervene", name=None, action=attrs.evolve(intervention, view=self.view),
                    is_edit=True, label=label)


@_frozen.frozen
@attrs.frozen(repr=False)
class Points:
    """The standard points of one model (see :func:`points`): one :class:`Point` per
    standard name, the module-level where-values ``blocks``, ``attn``, ``mlp``, and the sizes.

    Example:
        >>> import transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        ...     vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        ...     intermediate_size=64))
        >>> pts = fh.transformer.points(model)
        >>> pts.n_layers, pts.n_heads, pts.n_kv_heads, pts.d_head
        (2, 4, 2, 8)
    """

    arch: Architecture
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    blocks: Selector
    """Every block (a plain selector, for module-level and op specs)."""
    attn: Selector
    """Every block's attention module."""
    mlp: Selector
    """Every block's MLP."""
    embed: Point
    pos_embed: Point
    """The learned position embedding's output (GPT-2's ``wpe``), added to `embed`; none for rotary families."""
    resid_pre: Point
    resid_mid: Point
    resid_post: Point
    attn_out: Point
    mlp_in: Point
    mlp_pre: Point
    mlp_post: Point
    mlp_out: Point
    q: Point
    k: Point
    v: Point
    z: Point
    result: Point
    """Each head's output after the output projection, ``(batch, position, head, d_model)``, its bias
    left out (see ``heads.py``)."""
    pattern: Point
    attn_scores: Point
    final_norm: Point
    logits: Point

    def __repr__(self) -> str:
        return f"Points({self.arch.name}, {self.n_layers} layers)"

    @property
    def writers(self) -> tuple[Point, ...]:
        """The points that write the residual stream, to record for
        :func:`~funhooks.transformer.decompose_resid`: ``embed``, ``pos_embed`` (where the family
        has one), every layer's ``result`` and ``mlp_out`` (the output projections' biases are
        read off the model).

        Example:
            >>> import transformers, funhooks as fh
            >>> transformers.logging.set_verbosity_error()
            >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
            >>> fh.transformer.points(model).writers
            (embed, pos_embed, result, mlp_out)
        """
        return tuple(p for p in (self.embed, self.pos_embed, self.result, self.mlp_out) if p.kind != "none")


def _join(*parts: str | None) -> str:
    return ".".join(p for p in parts if p)


def _base_path(model: nn.Module) -> str:
    base = getattr(model, "base_model", model)
    if base is model or not isinstance(base, nn.Module):
        return ""
    return next((path for path, m in model.named_modules() if m is base), "")


def _block_returns_tensor(block: nn.Module) -> bool:
    """Whether a block returns the residual stream itself, so that a point on its output is the
    module path's own spec. Hugging Face's blocks do from transformers 5 on; under 4.x GPT-2's,
    NeoX's and BERT's return a 1-tuple, and the point reads its element 0 (``_Read``, which takes
    a tensor as it is). A block from outside transformers (a registered family) is taken to
    return a tensor."""
    if not type(block).__module__.startswith("transformers."):
        return True
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def _width(module: nn.Module, side: Literal["in", "out"]) -> int:
    """The width a module reads (`side` ``"in"``) or writes (``"out"``), from its weight: an
    ``nn.Linear``, transformers' ``Conv1D`` (weight ``(d_in, d_out)``), an ``nn.Embedding`` or a
    norm (a 1-d weight); 0 for another module."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        return 0
    if isinstance(module, nn.Linear):
        return module.in_features if side == "in" else module.out_features
    if isinstance(module, nn.Embedding):
        return module.embedding_dim if side == "out" else 0
    if type(module).__name__ == "Conv1D" and weight.ndim == 2:
        return int(weight.shape[0 if side == "in" else 1])
    return int(weight.shape[0]) if weight.ndim == 1 else 0


def _sized(point: Point, model: nn.Module, side: Literal["in", "out"]) -> Point:
    """`point` with the width its modules read or write, where all its layers agree on one."""
    found = {_width(model.get_submodule(path), side) for _, path in point.paths}
    return attrs.evolve(point, width=found.pop()) if len(found) == 1 else point


def points(model: nn.Module) -> Points:
    """The standard points of a Hugging Face transformer (or of a family you registered).

    Args:
        model: a model of a family :func:`~funhooks.transformer.architecture` knows, with or
            without its head (``logits`` needs the unembedding).

    Returns:
        A :class:`Points`.

    Raises:
        SelectorError: for a family no architecture is registered for.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> pts = fh.transformer.points(model)
        >>> ids = torch.arange(6).reshape(1, 6)
        >>> _, rec = fh.capture(model, [fh.outputs(pts.resid_pre), fh.outputs(pts.z[1])])(ids)
        >>> list(rec)
        ['blocks.0.resid_pre', 'blocks.1.resid_pre', 'blocks.1.z']
        >>> rec["blocks.1.z"]["output"].shape                 # (batch, position, head, d_head)
        torch.Size([1, 6, 4, 8])
    """
    arch = architecture(model)
    config = getattr(model, "config", None)
    base = _base_path(model)
    blocks = _join(base, arch.blocks)
    try:
        n_layers = len(model.get_submodule(blocks))  # type: ignore[arg-type]
    except (AttributeError, TypeError):
        raise SpecError(f"points: the blocks of a {arch.name!r} model are the sequence at {blocks!r}, got none "
                        f"there in {type(model).__name__}. Fix the architecture's `blocks`.") from None
    hidden = getattr(config, "hidden_size", None)
    n_heads = getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(n_heads, int):
        raise SpecError(f"points: the model's config gives `hidden_size` and `num_attention_heads`, got "
                        f"{hidden!r} and {n_heads!r}. Give the model a config with both.")
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    d_head = getattr(config, "head_dim", None) or hidden // n_heads
    layers = range(n_layers)
    paths = {name: p for name, p in model.named_modules()}

    def each(rel: str | None, name: str, kind: str, **kw: Any) -> Point:
        if rel is None:
            return Point(name, "none", (), n_layers, why=kw.pop("why"))
        return Point(name, kind, tuple((L, _join(blocks, str(L), rel)) for L in layers), n_layers, **kw)

    def single(path: str | None, name: str, why: str) -> Point:
        if path is None or path not in paths:
            return Point(name, "none", (), n_layers, why=why)
        return Point(name, "output", ((None, path),), n_layers)

    parallel = arch.parallel and getattr(config, "use_parallel_residual", True)
    first = _join(base, arch.resid_in or arch.embed)
    whole = _block_returns_tensor(model.get_submodule(_join(blocks, "0"))) if n_layers else True
    resid_pre = Point("resid_pre", "output", ((0, first), *((L, _join(blocks, str(L - 1))) for L in layers[1:])),
                      n_layers, tensor=whole, width=hidden)
    if parallel:
        resid_mid = each(None, "resid_mid", "", why=f"`resid_mid` is the stream between attention and MLP, which "
                         f"read the same input in the parallel blocks of {arch.name!r}")
    elif arch.post_norm:
        resid_mid = each(arch.attn, "resid_mid", "output", tensor=False, width=hidden)
    else:
        resid_mid = each("", "resid_mid", "op", op=op("add", call=0), width=hidden)
    if len(arch.qkv) == 3:
        q, k, v = (each(p, n, "output", view=Heads(h), width=d_head, heads=h)
                   for p, n, h in zip(arch.qkv, "qkv", (n_heads, n_kv, n_kv)))
    else:
        fused = Thirds if arch.fused == "thirds" else Interleaved
        q, k, v = (each(arch.qkv[0], n, "output", view=fused(i, n_heads), width=d_head, heads=n_heads)
                   for i, n in enumerate("qkv"))
    core = arch.qkv[0].rpartition(".")[0]  # the module calling the attention
    pattern = each(core, "pattern", "op", op=attention_pattern)
    scores = each(core, "attn_scores", "op", op=attention_scores)
    return Points(
        arch, n_layers, n_heads, n_kv, d_head,
        blocks=select([_join(blocks, str(L)) for L in layers]),
        attn=select([_join(blocks, str(L), arch.attn) for L in layers]),
        mlp=select([_join(blocks, str(L), arch.mlp) for L in layers]),
        embed=_sized(single(_join(base, arch.embed), "embed", "`embed` is the token embedding, which this model "
                            "lacks"), model, "out"),
        pos_embed=_sized(single(None if arch.pos_embed is None else _join(base, arch.pos_embed), "pos_embed",
                                f"`pos_embed` is a learned position embedding, which {arch.name!r} models have not"),
                         model, "out"),
        resid_pre=resid_pre,
        resid_mid=resid_mid,
        resid_post=each("", "resid_post", "output", tensor=whole, width=hidden),
        attn_out=each(arch.attn_out or arch.attn, "attn_out", "output", tensor=arch.attn_out is not None, width=hidden),
        mlp_in=each(arch.mlp_in or arch.mlp, "mlp_in", "input", width=hidden),
        mlp_pre=_sized(each(arch.mlp_pre, "mlp_pre", "output", why=f"the architecture {arch.name!r} names no "
                            "`mlp_pre`"), model, "out"),
        mlp_post=_sized(each(arch.mlp_proj, "mlp_post", "input"), model, "in"),
        mlp_out=each(arch.mlp_out or arch.mlp, "mlp_out", "output", width=hidden),
        q=q, k=k, v=v,
        z=each(arch.attn_proj, "z", "input", view=Heads(n_heads), width=d_head, heads=n_heads),
        result=each(arch.attn_proj, "result", "result", view=Heads(n_heads), width=hidden, heads=n_heads),
        pattern=pattern, attn_scores=scores,
        final_norm=_sized(single(None if arch.final_norm is None else _join(base, arch.final_norm), "final_norm",
                                 f"`final_norm` is the norm after the last block, which {arch.name!r} models have "
                                 "not"), model, "out"),
        logits=_sized(single(arch.unembed, "logits", f"`logits` is the unembedding's output, which this "
                             f"{type(model).__name__} has not (a model without its language-modelling head)"),
                      model, "out"),
    )
