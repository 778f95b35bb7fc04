"""The residual stream as a sum of its writers, and direct logit attribution.

:func:`decompose_resid` stacks, from a Record of :attr:`Points.writers
<funhooks.transformer.Points.writers>`, every term the residual stream before a layer (or the
final norm's input) is the sum of: the embeddings, every head's result, every output
projection's bias and every MLP's output, as a :class:`Decomposition` (a labelled
:class:`~funhooks.transformer.ResidualStack` that also holds the stream they sum to);
:func:`stack_head_results` keeps the heads' rows. :func:`logit_attrs` gives each row's direct
contribution to a logit (or a logit difference) through the final norm with its scale frozen at
the real stream's, the model's norm weight and its unembedding (TransformerLens'
``apply_ln_to_stack`` and ``logit_attrs``), so the rows add up to the real logit less the norm's
and the unembedding's biases.

Pre-norm families only (GPT-2, GPT-NeoX, Llama kin): post-norm BERT renormalises the stream
after every add, so it is no sum of writers. The decomposition is exact in evaluation mode (the
dropouts after the embeddings, the attention and the MLP are identities then).

Cost: the stack holds ``(2 + layers * (heads + 2)) * batch * positions * d_model`` floats (a
12-layer, 12-head GPT-2 on 1 x 10 tokens: 5 MB); ``logit_attrs`` is one product of the stack
at one position with one or two columns of the unembedding.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from funhooks import _frozen, _torch
from funhooks.errors import RecordError, SpecError
from funhooks.records import Record

from .heads import head_weights
from .lens import ResidualStack
from .standard import Points, points

__all__ = ["Decomposition", "decompose_resid", "logit_attrs", "stack_head_results"]

Tensor = torch.Tensor


@_frozen.frozen
@attrs.frozen(eq=False)
class Decomposition(ResidualStack):
    """A :class:`~funhooks.transformer.ResidualStack` of writers of the residual stream
    (:func:`decompose_resid`): rows ``(len(labels), batch, position, d_model)`` and the stream
    they are read from.

    Labels: ``"embed"``, ``"pos_embed"``, ``"blocks.L.heads.H"`` (head ``H`` of layer ``L``),
    ``"blocks.L.attn_bias"`` (the output projection's bias, where it has one),
    ``"blocks.L.attn_out"`` (a layer's heads and bias in one row, ``heads=False``) and
    ``"blocks.L.mlp_out"``.

    Example:
        >>> import torch, funhooks as fh
        >>> d = fh.transformer.Decomposition(torch.ones(2, 1, 3, 8), ("embed", "blocks.0.mlp_out"),
        ...                                  total=torch.full((1, 3, 8), 2.0))
        >>> d["embed"].shape, bool((d.resid.sum(0) == d.total).all())
        (torch.Size([1, 3, 8]), True)
    """

    total: Tensor = attrs.field(kw_only=True)
    """``(batch, position, d_model)``: the residual stream the writers sum to (all of them, also
    when the rows are a part of them, as :func:`stack_head_results` keeps)."""
    layer: int = attrs.field(default=-1, kw_only=True)
    """The layer whose input `total` is; the number of layers for the final norm's input."""


def _recorded(caller: str, record: Record, path: str) -> Tensor:
    if path not in record:
        raise RecordError(f"{caller}: the Record holds the writers of the residual stream, got no `{path}` among "
                          f"{list(record)}. Record them with `[fh.outputs(p) for p in pts.writers]`.")
    value = record[path]["output"]
    if not isinstance(value, Tensor):
        raise TypeError(f"{caller}: `{path}`'s \"output\" is a tensor, got {value!r:.80}.")
    return value


def _layer(caller: str, pts: Points, layer: int | None) -> int:
    n = pts.n_layers
    if layer is None:
        return n
    if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer <= n:
        raise ValueError(f"{caller}: `layer` is the layer whose input is decomposed, in [{-n}, {n}] ({n}: the final "
                         f"norm's input, as None), got {layer!r}.")
    return layer % n if layer < 0 else layer


def _rows(caller: str, model: nn.Module, pts: Points, record: Record, upto: int, heads: bool
          ) -> tuple[list[Tensor], list[str]]:
    embed = _recorded(caller, record, "embed")
    rows, labels = [embed], ["embed"]
    if pts.pos_embed.kind != "none":
        rows.append(_recorded(caller, record, "pos_embed").expand_as(embed))
        labels.append("pos_embed")
    for L in range(upto):
        result, weights = _recorded(caller, record, f"blocks.{L}.result"), head_weights(model, L)
        b_O = weights.b_O.to(result.dtype).expand(result.shape[:-2] + weights.b_O.shape)
        if heads:
            rows += result.unbind(-2)
            labels += [f"blocks.{L}.heads.{h}" for h in range(pts.n_heads)]
            if weights.has_b_O:
                rows.append(b_O)
                labels.append(f"blocks.{L}.attn_bias")
        else:
            rows.append(result.sum(-2) + b_O)
            labels.append(f"blocks.{L}.attn_out")
        rows.append(_recorded(caller, record, f"blocks.{L}.mlp_out"))
        labels.append(f"blocks.{L}.mlp_out")
    return rows, labels


def decompose_resid(model: nn.Module, record: Record, *, layer: int | None = None, heads: bool = True) -> Decomposition:
    """The residual stream before layer `layer` (the final norm's input for None) as the stack
    of its writers, which sum to it.

    Args:
        model: the model `record` was recorded on (a pre-norm family, in evaluation mode).
        record: a Record of ``pts.writers`` (``[fh.outputs(p) for p in pts.writers]``): ``embed``,
            ``pos_embed`` where the family has one, ``blocks.L.result`` and ``blocks.L.mlp_out``
            of every layer before `layer`.
        layer: the layer whose input is decomposed, negative from the last; None (or the number
            of layers) for the final norm's input.
        heads: one row per head and per output projection's bias; False for one
            ``blocks.L.attn_out`` row per layer (TransformerLens' ``decompose_resid``).

    Returns:
        A :class:`Decomposition` labelled as it says, in the order the forward writes them.

    Raises:
        RecordError: naming the first writer the Record lacks.
        SpecError: for a post-norm family (BERT).
        ValueError: for a layer out of range.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> pts = fh.transformer.points(model)
        >>> _, rec = fh.capture(model, [*(fh.outputs(p) for p in pts.writers), fh.outputs(pts.resid_pre[1])])(
        ...     torch.tensor([[1, 2, 3]]))
        >>> d = fh.transformer.decompose_resid(model, rec, layer=1)
        >>> d.labels
        ('embed', 'pos_embed', 'blocks.0.heads.0', 'blocks.0.heads.1', 'blocks.0.heads.2', 'blocks.0.heads.3',
         'blocks.0.attn_bias', 'blocks.0.mlp_out')
        >>> torch.allclose(d.resid.sum(0), rec["blocks.1.resid_pre"]["output"], atol=1e-5)
        True
    """
    model = _torch.unwrap(model)
    pts = points(model)
    if pts.arch.post_norm:
        raise SpecError(f"decompose_resid: the residual stream is a sum of writers in pre-norm blocks, got a "
                        f"{pts.arch.name!r} model, whose blocks normalise the stream after each add. Decompose a "
                        "pre-norm model (GPT-2, GPT-NeoX, Llama kin), or read `pts.result` per head as it is.")
    upto = _layer("decompose_resid", pts, layer)
    rows, labels = _rows("decompose_resid", model, pts, record, upto, heads)
    stack = torch.stack(rows)
    total = stack.sum(0, dtype=torch.promote_types(stack.dtype, torch.float32)).to(stack.dtype)  # half: one rounding
    return Decomposition(stack, tuple(labels), total=total, layer=upto)


def stack_head_results(model: nn.Module, record: Record, *, layer: int | None = None) -> Decomposition:
    """The rows of :func:`decompose_resid` that are heads (``blocks.L.heads.H`` of every layer
    before `layer`), with the stream all the writers sum to (TransformerLens'
    ``stack_head_results``, labelled by path instead of ``L0H0``).

    Args:
        model, record, layer: as :func:`decompose_resid` (every writer is needed for ``total``).

    Returns:
        A :class:`Decomposition` of ``layers * heads`` rows.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> pts = fh.transformer.points(model)
        >>> _, rec = fh.capture(model, [fh.outputs(p) for p in pts.writers])(torch.tensor([[1, 2, 3]]))
        >>> heads = fh.transformer.stack_head_results(model, rec)
        >>> len(heads), heads.labels[-1], tuple(heads.resid.shape)
        (8, 'blocks.1.heads.3', (8, 1, 3, 32))
    """
    whole = decompose_resid(model, record, layer=layer)
    keep = [i for i, label in enumerate(whole.labels) if ".heads." in label]
    return Decomposition(whole.resid[keep], tuple(whole.labels[i] for i in keep), total=whole.total,
                         layer=whole.layer)


def _frozen_norm(caller: str, norm: nn.Module | None, rows: Tensor, total: Tensor) -> Tensor:
    """`rows` through the final norm with its scale frozen at `total`'s: LayerNorm centres each row
    and divides by the real standard deviation, RMSNorm divides by the real root mean square;
    then the norm's weight (its bias, a row of its own, is left out)."""
    if norm is None:
        return rows
    weight, eps = getattr(norm, "weight", None), getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if isinstance(norm, nn.LayerNorm):
        rows = rows - rows.mean(-1, keepdim=True)
        scale = (total.float().var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    elif "RMSNorm" in type(norm).__name__ and isinstance(weight, Tensor):
        eps = torch.finfo(total.dtype).eps if eps is None else eps
        scale = (total.float().pow(2).mean(-1, keepdim=True) + eps).sqrt()
    else:
        raise SpecError(f"{caller}: the final norm is a LayerNorm or an RMSNorm, got a {type(norm).__name__}. "
                        "Attribute through the norm by hand: divide each row by the real stream's scale.")
    rows = rows.float() / scale
    return rows if not isinstance(weight, Tensor) else rows * weight.float()


def _direction(caller: str, unembed: nn.Module, tokens: int | Tensor, batch: int) -> Tensor:
    weight = getattr(unembed, "weight", None)
    if not isinstance(weight, Tensor) or weight.ndim != 2:
        raise SpecError(f"{caller}: the unembedding is a linear map with a `weight` (vocab, d_model), got a "
                        f"{type(unembed).__name__}. Use a model with a linear language-modelling head.")
    index = torch.as_tensor(tokens, device=weight.device)
    if index.dtype.is_floating_point or index.dtype == torch.bool or index.ndim > 1 or \
            (index.ndim == 1 and len(index) != batch):
        raise TypeError(f"{caller}: a token is an id, or one id per example ({batch}), got {tokens!r:.80}. Pass an "
                        "int or a 1-d integer tensor.")
    return weight[index.long()].float().expand(batch, -1)


def _at(stream: Tensor, position: int | Tensor) -> Tensor:
    """`stream` ``(..., batch, position, d_model)`` at one position, or at one per example."""
    if isinstance(position, Tensor) and position.ndim == 1:
        if position.dtype.is_floating_point or len(position) != stream.shape[-3]:
            raise TypeError(f"logit_attrs: `position` is an int, or one per example ({stream.shape[-3]}) as a 1-d "
                            f"integer tensor, got {position!r:.80}.")
        batch = torch.arange(stream.shape[-3], device=stream.device)
        return stream[..., batch, position.to(stream.device).long(), :]
    return stream.select(-2, int(position))


def logit_attrs(model: nn.Module, stack: Decomposition, tokens: int | Tensor,
                incorrect_tokens: int | Tensor | None = None, *, position: int | Tensor = -1) -> Tensor:
    """Each writer's direct contribution to the logit of `tokens` (minus that of
    `incorrect_tokens`) at `position`: its row through the final norm, with the norm's scale
    frozen at the real stream's (``stack.total``), times the norm's weight, dotted with the
    unembedding's column of the token (TransformerLens' ``logit_attrs`` on
    ``apply_ln_to_stack``). The rows add up to the real logit (difference) less the final
    norm's bias and the unembedding's bias terms.

    Args:
        model: the model with its language-modelling head.
        stack: a :class:`Decomposition` of the final norm's input (:func:`decompose_resid` or
            :func:`stack_head_results` with ``layer=None``).
        tokens: a token id, or one per example ``(batch,)``.
        incorrect_tokens: None, or ids shaped like `tokens`: attribute the logit difference.
        position: the position whose logits are attributed, or one per example ``(batch,)`` (the
            last real token of each padded prompt).

    Returns:
        ``(len(stack), batch)``, one attribution per row and example.

    Raises:
        ValueError: for a stack that is not of the final norm's input.
        SpecError: for a final norm or unembedding funhooks cannot freeze or read.
        TypeError: for tokens that are not ids.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> pts = fh.transformer.points(model)
        >>> out, rec = fh.capture(model, [fh.outputs(p) for p in pts.writers])(torch.tensor([[1, 2, 3]]))
        >>> d = fh.transformer.decompose_resid(model, rec)
        >>> attrs = fh.transformer.logit_attrs(model, d, 7, 9)       # logit of 7 minus logit of 9
        >>> attrs.shape
        torch.Size([14, 1])
        >>> bias = model.transformer.ln_f.bias @ (model.lm_head.weight[7] - model.lm_head.weight[9])
        >>> diff = out.logits[0, -1, 7] - out.logits[0, -1, 9]
        >>> torch.allclose(attrs.sum(0) + bias, diff, atol=1e-4)
        True
    """
    model = _torch.unwrap(model)
    if not isinstance(stack, Decomposition):
        raise TypeError(f"logit_attrs: `stack` is a Decomposition (from `fh.transformer.decompose_resid`), which "
                        f"holds the real stream the final norm's scale is frozen at, got {type(stack).__name__}.")
    n = points(model).n_layers  # before the checks of the stack, a SelectorError for an unknown family
    if stack.layer != n:
        raise ValueError(f"logit_attrs: the stack decomposes the final norm's input (`layer=None`), got one of "
                         f"layer {stack.layer}'s input. Decompose with `layer=None`.")
    pts = points(model)
    if pts.logits.kind == "none":
        raise SpecError(f"logit_attrs: {pts.logits.why}, got `{pts.logits!r}` missing. Pass the model with its "
                        "language-modelling head (e.g. `GPT2LMHeadModel`, `LlamaForCausalLM`).")
    unembed = model.get_submodule(pts.logits.paths[0][1])
    norm = None if pts.final_norm.kind == "none" else model.get_submodule(pts.final_norm.paths[0][1])
    rows, total = _at(stack.resid, position), _at(stack.total, position)  # (rows, batch, d_model), (batch, d_model)
    normed = _frozen_norm("logit_attrs", norm, rows, total)
    batch = rows.shape[1]
    direction = _direction("logit_attrs", unembed, tokens, batch)
    if incorrect_tokens is not None:
        direction = direction - _direction("logit_attrs", unembed, incorrect_tokens, batch)
    return (normed * direction).sum(-1).to(stack.resid.dtype)

