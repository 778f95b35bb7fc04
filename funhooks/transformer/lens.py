"""The logit lens: residual streams read through the model's own final norm and unembedding.

:func:`unembed` applies a Hugging Face model's final norm and unembedding (``lm_head``, tied
to the token embedding or not; BERT's prediction transform then decoder) to any residual
stream tensor; :func:`logit_lens` does it for every layer of a Record of standard residual
points (``blocks.{L}.resid_post`` ...) or a stacked tensor, in one call, and returns a
:class:`LogitLens`; :func:`accumulated_resid` stacks the residual stream before every layer
and after the last (TransformerLens' ``cache.accumulated_resid``) as a :class:`ResidualStack`.

Cost: the model's own norm and unembedding modules called once on the stacked residuals, so
the logits take ``layers * batch * positions * vocab`` floats (a 12-layer GPT-2 on 1 x 10
tokens: 24 MB). Nothing is installed on the model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs
import torch
from torch import nn

from funhooks import _frozen, _html, _torch
from funhooks.errors import RecordError, SelectorError
from funhooks.records import Record

from .architectures import architecture

__all__ = ["LogitLens", "ResidualStack", "accumulated_resid", "logit_lens", "unembed"]

_RESIDUAL_POINTS = ("resid_pre", "resid_mid", "resid_post")
"""The standard points that are the residual stream, in their order within a block."""
_RESIDUAL_PATH = re.compile(r"blocks\.(\d+)\.(resid_pre|resid_mid|resid_post)")


@attrs.frozen
class _Head:
    """The modules that turn a residual stream into logits (each None where the family has none)."""

    final_norm: nn.Module | None
    transform: nn.Module | None
    unembed: nn.Module


def _find(model: nn.Module, owner: nn.Module, path: str | None, role: str, caller: str) -> nn.Module | None:
    """The module at `path` under `owner` (None for no path), or a SelectorError naming it."""
    if path is None:
        return None
    try:
        return owner.get_submodule(path)
    except AttributeError:
        raise SelectorError(
            f"{caller}: the {architecture(model).name!r} family keeps its {role} at `{path}`, got a "
            f"{type(model).__name__} without it. Pass the model with its language-modelling head (e.g. "
            "`GPT2LMHeadModel`, `LlamaForCausalLM`, `BertForMaskedLM`), or fix the family with "
            "`fh.transformer.register`."
        ) from None


def _base(model: nn.Module) -> nn.Module:
    """The base model (``transformer`` of GPT-2, ``model`` of Llama ...): where blocks and final norm live."""
    base = getattr(model, "base_model", model)
    return base if isinstance(base, nn.Module) else model


def _final_norm(model: nn.Module, caller: str) -> nn.Module | None:
    return _find(model, _base(model), architecture(model).final_norm, "final norm", caller)


def _head(model: nn.Module, caller: str) -> _Head:
    """The final norm, unembedding transform and unembedding of `model`, or a SelectorError
    naming the module that is missing."""
    model = _torch.unwrap(model)
    arch = architecture(model)
    head = _find(model, model, arch.unembed, "unembedding", caller)
    if head is None:
        raise SelectorError(
            f"{caller}: the {arch.name!r} family declares no `unembed`, got None. "
            "Declare it with `fh.transformer.register(attrs.evolve(arch, unembed=...))`."
        )
    transform = _find(model, model, dict(arch.extra).get("unembed_transform"), "unembedding transform", caller)
    return _Head(_final_norm(model, caller), transform, head)


def _width(head: _Head) -> int | None:
    weight = getattr(head.transform or head.unembed, "weight", None)
    return weight.shape[-1] if isinstance(weight, torch.Tensor) else None


def _checked(caller: str, head: _Head, resid: object) -> torch.Tensor:
    if not isinstance(resid, torch.Tensor) or resid.ndim == 0:
        raise TypeError(f"{caller}: `resid` is a tensor `(..., d_model)`, got {resid!r:.80}. "
                        "Pass a residual stream such as `rec['blocks.3.resid_post']['output']`.")
    width = _width(head)
    if width is not None and resid.shape[-1] != width:
        raise ValueError(f"{caller}: `resid` ends in the model's width d_model={width}, "
                         f"got shape {tuple(resid.shape)}. "
                         "Pass a residual stream of this model (hidden size last).")
    return resid


def _apply(head: _Head, resid: torch.Tensor, *, norm: bool = True) -> torch.Tensor:
    if norm and head.final_norm is not None:
        resid = head.final_norm(resid)
    if head.transform is not None:
        resid = head.transform(resid)
    logits: torch.Tensor = head.unembed(resid)
    return logits


def unembed(model: nn.Module, resid: torch.Tensor) -> torch.Tensor:
    """The logits `model` would give for the residual stream `resid`: its final norm, then its
    unembedding.

    The model's own modules run (the norm under ``model.base_model``, the unembedding under
    the model; for BERT the prediction transform, then the decoder with its bias), so tied
    and untied embeddings, RMSNorm and LayerNorm are all the model's. For the last layer's
    ``resid_post`` the result is the model's logits.

    Args:
        model: a Hugging Face model with its language-modelling head (``GPT2LMHeadModel``,
            ``LlamaForCausalLM``, ``GPTNeoXForCausalLM``, ``BertForMaskedLM``, or a family
            registered with :func:`~funhooks.transformer.register`).
        resid: a tensor ``(..., d_model)``.

    Returns:
        The logits, ``(..., vocab)``.

    Raises:
        SelectorError: for a family funhooks does not know, or a model without its head.
        TypeError, ValueError: for `resid` not a tensor, or not ending in ``d_model``.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> pts = fh.transformer.points(model)
        >>> out, rec = fh.capture(model, fh.outputs(pts.resid_post[-1]))(torch.tensor([[1, 2, 3]]))
        >>> resid_post = rec["blocks.1.resid_post"]["output"]    # the last layer's residual stream
        >>> torch.allclose(fh.transformer.unembed(model, resid_post), out.logits, atol=1e-5)
        True
        >>> tuple(fh.transformer.unembed(model, torch.randn(4, 32)).shape)   # any (..., d_model)
        (4, 50)
    """
    head = _head(model, "unembed")
    return _apply(head, _checked("unembed", head, resid))


@_frozen.frozen
@attrs.frozen(eq=False)
class ResidualStack:
    """Residual streams stacked along a first axis, one per label (``"blocks.0.resid_pre"``, ...).

    Passed to :func:`logit_lens`, it is unembedded as it is (a stack made with
    ``apply_ln=True`` already holds the final norm's output, which is not applied twice).

    Example:
        >>> import torch, funhooks as fh
        >>> stack = fh.transformer.ResidualStack(torch.zeros(2, 1, 3, 8), ("blocks.0.resid_pre", "blocks.0.resid_post"))
        >>> len(stack), stack["blocks.0.resid_post"].shape
        (2, torch.Size([1, 3, 8]))
    """

    resid: torch.Tensor
    """``(len(labels), ..., d_model)``."""
    labels: tuple[str, ...]
    """The standard path of each row."""
    normed: bool = False
    """Whether the model's final norm has been applied (``apply_ln=True``)."""

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return f"ResidualStack(labels={_html.short(self.labels)}, resid=Tensor{tuple(self.resid.shape)}, normed={self.normed})"

    def __getitem__(self, label: str) -> torch.Tensor:
        """The row of `label`."""
        return self.resid[_index(self.labels, label, type(self).__name__)]


def _index(labels: tuple[str, ...], label: str, owner: str) -> int:
    if label not in labels:
        raise KeyError(f"{owner}: no row is labelled {label!r}; the labels are {list(labels)}.")
    return labels.index(label)


@_frozen.frozen
@attrs.frozen(eq=False)
class LogitLens:
    """What :func:`logit_lens` read: the logits of every residual point, one row per label.

    Example:
        >>> import torch, funhooks as fh
        >>> lens = fh.transformer.LogitLens(torch.tensor([[[[0.0, 1.0, 2.0]]], [[[3.0, 1.0, 0.0]]]]),
        ...                                 ("blocks.0.resid_post", "blocks.1.resid_post"))
        >>> lens.rank(0)[:, 0, -1].tolist()     # token 0 climbs from last to first
        [2, 0]
        >>> lens.top(1).indices[:, 0, -1, 0].tolist()
        [2, 0]
    """

    logits: torch.Tensor
    """``(layers, batch, position, vocab)`` (or ``(layers, ..., vocab)``: whatever the residuals' shape was)."""
    labels: tuple[str, ...]
    """The standard path of each row (``"blocks.3.resid_post"``), or ``"0"``, ``"1"`` ... for a plain tensor."""

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, label: str) -> torch.Tensor:
        """The logits of the row labelled `label`."""
        return self.logits[_index(self.labels, label, type(self).__name__)]

    def probs(self) -> torch.Tensor:
        """The softmax over the vocabulary, ``(layers, ..., vocab)``."""
        return self.logits.softmax(-1)

    def prob(self, token: int | torch.Tensor) -> torch.Tensor:
        """The probability of `token` at every layer, ``(layers, ...)``.

        `token` is an id or an integer tensor broadcasting to ``logits.shape[1:-1]`` (e.g. the
        answer of each example as ``(batch, 1)``).
        """
        return self.probs().gather(-1, self._index_of(token)).squeeze(-1)

    def _index_of(self, token: int | torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(token, device=self.logits.device)
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise TypeError(f"LogitLens: `token` is a token id (an int or an integer tensor), got {token!r}.")
        return index.long().expand(self.logits.shape[:-1]).unsqueeze(-1)

    def rank(self, token: int | torch.Tensor) -> torch.Tensor:
        """The rank of `token` at every layer (0: the top prediction), ``(layers, ...)``; tokens
        with a logit equal to `token`'s do not count above it."""
        own = self.logits.gather(-1, self._index_of(token))
        return (self.logits > own).sum(-1)

    def top(self, k: int) -> torch.return_types.topk:
        """The `k` most probable tokens at every layer: ``.values`` their probabilities and
        ``.indices`` their ids, each ``(layers, ..., k)``."""
        return torch.topk(self.probs(), k, dim=-1)

    def __repr__(self) -> str:
        return f"LogitLens(labels={_html.short(self.labels)}, logits=Tensor{tuple(self.logits.shape)})"

    def html(self, *, vocab: _html.Vocab = None, tokens: Sequence[object] | None = None, k: int = 3) -> _html.Html:
        """The top token of every layer (rows) at every position (columns) as an HTML table, with
        its probability; hovering a cell lists the top `k`. Shows the first example (index 0 of
        every axis between the layers and the positions) and its last positions. `vocab` writes
        token ids (a list of strings indexed by id, or a function such as ``tokenizer.decode``);
        `tokens` labels the positions (one string each). Only the shown top-`k` numbers reach the host.

        Raises:
            ValueError: for `tokens` of another length than the positions.
        """
        logits = self.logits.detach()
        first = logits.ndim > 3
        while logits.ndim > 3:
            logits = logits[:, 0]
        logits = (logits if logits.ndim == 3 else logits.unsqueeze(1))[:, -_SHOWN_POSITIONS:]
        top = torch.topk(logits.float().softmax(-1), min(k, logits.shape[-1]), dim=-1)
        probs, ids = top.values.cpu().tolist(), top.indices.cpu().tolist()
        positions = self.logits.shape[-2] if self.logits.ndim > 2 else 1
        header = ["layer", *_html.labels("LogitLens.html", tokens, positions)[positions - logits.shape[1]:]]
        rows = [[_html.Cell(name), *(_top_cell(p, i, vocab) for p, i in zip(layer_p, layer_i))]
                for name, layer_p, layer_i in zip(self.labels, probs, ids)]
        caption = "Logit lens: top token per layer and position" + (" (example 0)" if first else "")
        return _html.table(header, rows, caption=caption, row_header=True)

    def _repr_html_(self) -> str:
        return self.html()


_SHOWN_POSITIONS = 32  # a logit lens display shows the last positions


def _top_cell(probs: list[float], ids: list[int], vocab: _html.Vocab) -> _html.Cell:
    """A position's top token with its probability; its top `k` as the hover text."""
    ranked = ", ".join(f"{_html.label(i, vocab)!r} {_html.number(p, 2)}" for p, i in zip(probs, ids))
    return _html.Cell(f"{_html.label(ids[0], vocab)} {_html.number(probs[0], 2)}", _html.shade(probs[0], 1.0), ranked)


def _depth(label: str) -> tuple[int, int]:
    """(layer, place within the block) of a residual point's path, for sorting."""
    layer, point = label.split(".")[1:]
    return int(layer), _RESIDUAL_POINTS.index(point)


def _value(caller: str, source: Record, path: str) -> torch.Tensor:
    if path not in source:
        raise RecordError(f"{caller}: the Record holds no `{path}`, got paths {list(source)}. "
                          "Record every residual point it needs, e.g. `fh.outputs(points.resid_pre)`.")
    value = source[path]["output"]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{caller}: `{path}`'s \"output\" is a tensor `(..., d_model)`, got {value!r:.80}.")
    return value


def _stacked(caller: str, source: Record, labels: Sequence[str]) -> torch.Tensor:
    return torch.stack([_value(caller, source, label) for label in labels])


def logit_lens(model: nn.Module, source: Record | ResidualStack | torch.Tensor) -> LogitLens:
    """The logit lens of every layer at once: the model's final norm and unembedding applied
    to each residual stream of `source`.

    Args:
        model: a Hugging Face model with its language-modelling head (see :func:`unembed`).
        source: a Record of standard residual points (every ``blocks.{L}.resid_pre``,
            ``resid_mid`` and ``resid_post`` it holds, value name ``"output"``, ordered by
            depth; other paths are left out), a :class:`ResidualStack`
            (:func:`accumulated_resid`), or a tensor ``(layers, ..., d_model)``.

    Returns:
        A :class:`LogitLens`: ``logits`` ``(layers, ..., vocab)`` and the ``labels`` of its rows.

    Raises:
        RecordError: for a Record holding no residual point.
        SelectorError, TypeError, ValueError: as :func:`unembed`.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> out, rec = fh.capture(model, fh.outputs(fh.transformer.points(model).resid_post))(ids)
        >>> lens = fh.transformer.logit_lens(model, rec)
        >>> lens.labels, tuple(lens.logits.shape)
        (('blocks.0.resid_post', 'blocks.1.resid_post'), (2, 1, 3, 50))
        >>> torch.allclose(lens["blocks.1.resid_post"], out.logits, atol=1e-5)
        True
    """
    head = _head(model, "logit_lens")
    normed = False
    if isinstance(source, ResidualStack):
        resid, labels, normed = source.resid, source.labels, source.normed
    elif isinstance(source, Record):
        labels = tuple(sorted((p for p in source if _RESIDUAL_PATH.fullmatch(p)), key=_depth))
        if not labels:
            raise RecordError(f"logit_lens: the Record holds residual points `blocks.{{L}}.resid_pre` / `resid_mid` / "
                              f"`resid_post`, got paths {list(source)}. "
                              "Record them with `fh.outputs(points.resid_post)`.")
        resid = _stacked("logit_lens", source, labels)
    elif isinstance(source, torch.Tensor) and source.ndim >= 2:
        resid, labels = source, tuple(str(i) for i in range(len(source)))
    else:
        raise TypeError(f"logit_lens: `source` is a Record of residual points, a ResidualStack or a tensor "
                        f"`(layers, ..., d_model)`, got {source!r:.80}. Stack the residual streams first.")
    return LogitLens(_apply(head, _checked("logit_lens", head, resid), norm=not normed), labels)


def accumulated_resid(model: nn.Module, source: Record, *, apply_ln: bool = False,
                      incl_mid: bool = False) -> ResidualStack:
    """The residual stream as it accumulates: before every layer (``resid_pre``) and after the
    last (``resid_post``), stacked (TransformerLens' ``cache.accumulated_resid``).

    Args:
        model: the Hugging Face model `source` was recorded on (its number of layers, and its
            final norm for `apply_ln`).
        source: a Record holding ``blocks.{L}.resid_pre`` of every layer and the last layer's
            ``blocks.{L}.resid_post`` (value name ``"output"``).
        apply_ln: apply the model's final norm to every row (none for a family without one,
            such as post-norm BERT).
        incl_mid: also each layer's ``resid_mid`` (after attention), between its
            ``resid_pre`` and the next.

    Returns:
        A :class:`ResidualStack` of ``layers + 1`` rows (``2 * layers + 1`` with `incl_mid`),
        labelled by their standard paths.

    Raises:
        RecordError: naming the first residual point the Record lacks.
        SelectorError: for a family funhooks does not know.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> pts = fh.transformer.points(model)
        >>> out, rec = fh.capture(model, [fh.outputs(pts.resid_pre), fh.outputs(pts.resid_post[-1])])(
        ...     torch.tensor([[1, 2, 3]]))
        >>> stack = fh.transformer.accumulated_resid(model, rec)
        >>> stack.labels, tuple(stack.resid.shape)
        (('blocks.0.resid_pre', 'blocks.1.resid_pre', 'blocks.1.resid_post'), (3, 1, 3, 32))
        >>> torch.allclose(fh.transformer.logit_lens(model, stack).logits[-1], out.logits, atol=1e-5)
        True
    """
    model = _torch.unwrap(model)
    arch = architecture(model)
    layers = len(_torch.children(_base(model).get_submodule(arch.blocks)))
    points = ("resid_pre", "resid_mid") if incl_mid else ("resid_pre",)
    labels = (*(f"blocks.{L}.{p}" for L in range(layers) for p in points), f"blocks.{layers - 1}.resid_post")
    resid = _stacked("accumulated_resid", source, labels)
    if apply_ln:
        norm = _final_norm(model, "accumulated_resid")
        resid = resid if norm is None else norm(resid)
    return ResidualStack(resid, labels, normed=apply_ln)
