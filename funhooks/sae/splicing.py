"""Splicing an SAE into a model at one point: its features recorded, edited, decoded.

``splice(where, sae)`` gives the specs that run `sae` at `where` (a standard point of one layer,
``pts.resid_post[3]``, or a module path) on every call of it:

- the features ``sae.encode(x)`` are stored under the point's Record path with ``.sae`` added
  (``"blocks.3.resid_post.sae"``, record name ``"features"``), the path a later patch reads;
- with an `edit`, the point's value becomes ``x + decode(edit(f)) - decode(f)``: the
  reconstruction of the edited features plus the SAE's error term ``x - decode(f)``, so only
  the edit changes the model (an edit that changes no feature changes no bit of the output);
  the stored features are then the edited ones, those the decoder saw;
- with ``error=False`` the value becomes ``decode(edit(f))`` alone: the model run on the SAE's
  reconstruction (what "loss recovered" measures).

Without an edit and with the error term the model's output is its own, bit for bit: only the
encoder runs. The SAE sees the value in its own device and dtype (``protocol``), any leading
shape ``(..., d_in)``. The specs are forward editors and observers, so they run under
``fh.with_hooks``, ``fh.capture`` and ``fh.generate`` (every decode step) alike.

Cost: per call of the point, one ``encode``, and with an edit two ``decode`` (one with
``error=False``), the edit, and a dictionary entry handing the features from the editor to the
recorder.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from funhooks.errors import SpecError
from funhooks.specs import Spec, edit, observe
from funhooks.transformer import Point

from .edits import Edit
from .protocol import Shape, as_read, encoded, shape_of

__all__ = ["FEATURES", "splice"]

FEATURES = "features"
"""The record name of a spliced SAE's feature activations."""
_CALLER = "sae.splice"


def _where_held(t: Tensor) -> tuple[object, ...]:
    """What identifies `t`'s values while `t` lives: its memory and layout, which a detached
    alias (what a recorder sees under autograd) shares; its id where there is no memory to
    read (a tensor batched by ``vmap``)."""
    try:
        return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    except RuntimeError:
        return (id(t),)


class _Handed(dict):
    """The features an editor computed, by the value it returned, for the recorder that sees
    that value next (or a detached alias of it). Entries leave when read; copies and pickles
    start empty."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _Handed, ()

    def give(self, value: Tensor, features: Tensor) -> None:
        for key in [key for key, (ref, _) in self.items() if ref() is None]:  # values no recorder saw (a replay)
            del self[key]
        self[_where_held(value)] = (weakref.ref(value), features)

    def take(self, value: Tensor) -> Tensor | None:
        held = self.pop(_where_held(value), None)
        return held[1] if held is not None and held[0]() is not None else None


def _first(value: Any) -> Tensor:
    return value if isinstance(value, Tensor) else value[0]


class _Run:
    """The SAE on one value: checked, moved to the SAE's place, encoded (and decoded)."""

    __slots__ = ("__name__", "handed", "records", "sae", "shape", "shown", "error", "edits")

    def __init__(self, sae: Any, shape: Shape, shown: str, edits: tuple[Callable[[Tensor], Tensor], ...],
                 error: bool, records: bool) -> None:
        self.sae, self.shape, self.shown, self.edits, self.error, self.records = sae, shape, shown, edits, error, records
        self.handed = _Handed()
        self.__name__ = FEATURES

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`x` in the SAE's place (its heads flattened for an SAE as wide as all of them, as
        SAELens' ``hook_z`` SAEs are, unless the SAE flattens them itself), and its features."""
        d = self.shape.d_in
        x, width = as_read(self.sae, d, x, _CALLER)
        if d and width != d:
            raise SpecError(
                f"{_CALLER}: the SAE reads vectors of its width d_in={d}, got values of width {width} "
                f"(shape {tuple(x.shape)}) at `{self.shown}` for the {type(self.sae).__name__}. Splice it at the "
                f"point it was trained on, or train one of width {x.shape[-1]}."
            )
        device, dtype = self.shape.device, self.shape.dtype
        if (device is not None and x.device != device) or (dtype is not None and x.dtype != dtype):
            x = x.to(device=device, dtype=dtype)
        return x, encoded(self.sae, x)

    def edited(self, f: Tensor) -> Tensor:
        new = f
        for fn in self.edits:
            new = fn(new)
            if not isinstance(new, Tensor) or new.shape != f.shape:
                raise SpecError(f"{_CALLER}: a feature edit returns a tensor shaped like the features, "
                                f"{tuple(f.shape)}, got {getattr(new, 'shape', type(new).__name__)} from {fn!r} at "
                                f"`{self.shown}`. Return the edited features.")
        return new

    def __call__(self, module: nn.Module, args: tuple, value: Any) -> Any:
        """The editor: the point's new value (None: unchanged)."""
        x = _first(value)
        xs, f = self.encode(x)
        new_f = self.edited(f)
        if self.error and new_f is f:
            if self.records:
                self.handed.give(x, f)
            return None
        out = self.sae.decode(new_f)
        if self.error:
            out = out - self.sae.decode(f)
        out = out.to(device=x.device, dtype=x.dtype).reshape(x.shape)
        new = x + out if self.error else out
        if self.records:
            self.handed.give(new, new_f)
        return new if isinstance(value, Tensor) else (new, *value[1:])

    def features(self, module: nn.Module, args: tuple, value: Any) -> Tensor:
        """The recorder: the features of the value it sees (handed over by the editor)."""
        x = _first(value)
        handed = self.handed.take(x)
        if handed is not None:
            return handed.detach()
        if not torch.is_grad_enabled():
            return self.encode(x)[1]
        with torch.no_grad():  # stored detached: no graph to build
            return self.encode(x)[1]


class _Recorder:
    """The recorder's function, named ``features`` (the spec's record name)."""

    __slots__ = ("__name__", "run")

    def __init__(self, run: _Run) -> None:
        self.run, self.__name__ = run, FEATURES

    def __call__(self, module: nn.Module, args: tuple, value: Any) -> Tensor:
        return self.run.features(module, args, value)


def _edits(edit: Edit | None) -> tuple[Callable[[Tensor], Tensor], ...]:
    if edit is None:
        return ()
    items = list(edit) if isinstance(edit, Sequence) else [edit]
    for fn in items:
        if not callable(fn):
            raise SpecError(f"{_CALLER}: `edit` is a feature edit (`fh.sae.ablate`, `steer`, `scale`, `patch`), a "
                            f"function `features -> features`, or a list of them, got {fn!r}. Pass one of those.")
        try:
            hash(fn)
        except TypeError:
            raise SpecError(f"{_CALLER}: a feature edit is hashable (a spec is a value), got an unhashable "
                            f"{type(fn).__name__}. Pass a function or a frozen value.") from None
    return tuple(items)


def _editor(where: Point | str, run: _Run) -> Spec:
    """The editor's spec (`splice`'s own `edit` is its argument)."""
    return edit(where, run)


def _place(where: object, name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """How `where` shows, and its ``(module path, Record path of the features)``."""
    if isinstance(where, Point):
        if where.op is not None:
            raise SpecError(f"{_CALLER}: an SAE is spliced at a module's output or input, got `{where!r}`, the value "
                            f"of an op inside a module. Splice it at a point such as `pts.resid_post`, "
                            "`pts.resid_pre`, `pts.mlp_out`, `pts.attn_out` or `pts.z`.")
        if len(where.paths) != 1:
            raise SpecError(f"{_CALLER}: an SAE is trained at one place, got `{where!r}` holding "
                            f"{len(where.paths)} layers. Index the point: `pts.{where.name}[3]`.")
        return repr(where), ((where.paths[0][1], f"{where.keys[0]}.{name}"),)
    if isinstance(where, str) and where and "*" not in where:
        return where, ((where, f"{where}.{name}"),)
    raise SpecError(f"{_CALLER}: `where` is a standard point of one layer (`pts.resid_post[3]`) or a module path "
                    f"without wildcards, got {where!r}. Pass one of those.")


def _check_width(where: object, shape: Shape, sae: Any) -> None:
    """Refuse, before any forward, an SAE whose ``d_in`` is not the width of the standard point
    `where` on its model (a head point also takes an SAE as wide as all its heads). A module
    path, a point whose width the model did not show, or an SAE that says no width is checked at
    the point's first call instead (``_Run.encode``)."""
    if not isinstance(where, Point) or not where.width or not shape.d_in:
        return
    flat = where.heads * where.width
    fits = (where.width, flat) if where.heads else (where.width,)
    if shape.d_in in fits:
        return
    wide = f"{where.heads} heads of width {where.width}, {flat} flattened" if where.heads else f"width {where.width}"
    raise SpecError(
        f"{_CALLER}: the SAE reads vectors of its width d_in={shape.d_in}, got `{where!r}` (module "
        f"`{where.paths[0][1]}`), whose values on this model are of {wide}, for the {type(sae).__name__}. Splice "
        f"it at the point it was trained on, or train one of width {' or '.join(map(str, fits))}."
    )


def splice(where: Point | str, sae: Any, *, edit: Edit | None = None, error: bool = True, record: bool = True,
           name: str = "sae") -> tuple[Spec, ...]:
    """The specs that run `sae` at `where`: record its features, and edit them.

    Args:
        where: a standard point of one layer (``pts.resid_post[3]``) or a module path.
        sae: an object with ``encode``/``decode`` (``protocol.Autoencoder``): your
            ``nn.Module``, or an SAELens ``SAE``.
        edit: a feature edit (:func:`~funhooks.sae.ablate`, ``steer``, ``scale``, ``patch``),
            any hashable function ``features -> features``, or a list of them.
        error: keep the SAE's error term (the model unchanged unless a feature is edited);
            False runs the model on the reconstruction ``decode(edit(f))``.
        record: store the features under ``<point>.<name>``, record name ``"features"``.
        name: the SAE's name in the Record path (two SAEs at one point need two names).

    Returns:
        A tuple of specs: pass it as the specs, or unpack it among others
        (``[*fh.sae.splice(...), fh.outputs(pts.logits)]``).

    Raises:
        SpecError: for an object without ``encode``/``decode``, a `where` that is not one
            place, a bad edit, a standard point whose width on its model is not the SAE's
            ``d_in`` (raised here, before any forward); at a module path, when called, for a
            value whose width is not ``d_in`` (raised before the SAE runs, as the cause of the
            run's HookError).

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> from torch import nn
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> class SAE(nn.Module):
        ...     def __init__(self, d, n):
        ...         super().__init__()
        ...         self.enc, self.dec = nn.Linear(d, n), nn.Linear(n, d)
        ...     def encode(self, x):
        ...         return torch.relu(self.enc(x))
        ...     def decode(self, f):
        ...         return self.dec(f)
        >>> sae = SAE(32, 64)
        >>> pts = fh.transformer.points(model)
        >>> ids = torch.arange(6).reshape(1, 6)
        >>> out, rec = fh.capture(model, fh.sae.splice(pts.resid_post[0], sae))(ids)
        >>> rec["blocks.0.resid_post.sae"]["features"].shape
        torch.Size([1, 6, 64])
        >>> torch.equal(out.logits, model(ids).logits)          # the error term keeps the model's output
        True
    """
    shape = shape_of(sae, _CALLER)
    if not isinstance(name, str) or not name or "." in name:
        raise SpecError(f"{_CALLER}: `name` is a non-empty str without dots, got {name!r}. Pass e.g. 'sae'.")
    for flag, value in (("error", error), ("record", record)):
        if not isinstance(value, bool):
            raise SpecError(f"{_CALLER}: `{flag}` is a bool, got {value!r}. Pass True or False.")
    shown, labels = _place(where, name)
    _check_width(where, shape, sae)
    edits = _edits(edit)
    run = _Run(sae, shape, shown, edits, error, record)
    specs: list[Spec] = []
    if edits or not error:
        run.__name__ = repr(edits[0]) if len(edits) == 1 else f"{len(edits)} edits" if edits else "reconstruction"
        made = _editor(where, run)
        specs.append(attrs.evolve(made, label=_CALLER))
    if record:
        made = observe(where, _Recorder(run), name=FEATURES, detach=False)  # no walk of the hook's args: it stores its own detached features
        specs.append(attrs.evolve(made, label=_CALLER, labels=labels))
    if not specs:
        raise SpecError(f"{_CALLER}: with no edit, the error term kept and nothing recorded the SAE does nothing, got "
                        f"`record=False` at `{shown}`. Record the features, edit them, or pass `error=False`.")
    return tuple(specs)
