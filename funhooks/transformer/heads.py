"""What each attention head writes: its weights, and its ``result`` point.

:func:`head_weights` reads one layer's per-head matrices out of the model's own projections
(``W_Q``/``W_K``/``W_V`` ``(head, d_model, d_head)``, ``W_O`` ``(head, d_head, d_model)`` and
their biases), whatever the family's layout: a fused ``[q | k | v]`` Conv1D (GPT-2), a fused
per-head Linear (GPT-NeoX) or three Linears (Llama kin, BERT). They are views of the model's
parameters in TransformerLens' shapes; nothing is copied or folded (no value-bias folding, no
centring), and ``W_Q``/``W_K`` act before rotary embeddings where the family has them.

The ``result`` standard point (``pts.result``) is each head's output after the output
projection, ``(batch, position, head, d_model)``: ``z``'s head ``h`` times ``W_O[h]``, computed
by a hook on the output projection from its input and its weight, without changing the model.
The projection's bias is no head's: it is a writer of its own, so the heads' results summed,
plus ``b_O``, are the projection's output (``attn_out`` in evaluation mode). ``fh.outputs``
stores it, ``fh.observe`` sees it and ``fh.edit(pts.result, fn)`` replaces the projection's
output by the sum of `fn`'s results plus ``b_O`` (the path ``fh.attribution_patching`` probes
each head's result through). The interventions (``fh.patch``, ``fh.steer``,
``fh.scale``, ``fh.ablate``) and ``fh.grads`` raise a SpecError naming the equivalent edit of
``z`` or ``attn_out`` (NOTE [result is computed]).

NOTE [result is computed]: no tensor of the model's forward holds a head's result, the model
sums the heads inside one matmul. So there is no value to patch in place nor a gradient to
watch: a patch, scale or zero-ablation of a head's result is that of its ``z`` (the result is
linear in it, ``W_O[h]`` fixed), a steer of one head's result adds to ``attn_out``, and the
gradient of every head's result is the gradient of ``attn_out``.

Cost: reading ``result`` is one ``einsum`` per layer, ``batch * positions * heads * d_model``
floats stored (TransformerLens' ``hook_result``; ``n_heads`` times ``attn_out``'s size);
``head_weights`` makes views, no copy.
"""

from __future__ import annotations

from typing import cast

import attrs
import torch
from torch import nn

from funhooks import _frozen
from funhooks.specs.editing import View

from ._result import projection
from .standard import points

__all__ = ["HeadWeights", "head_weights"]

Tensor = torch.Tensor


@_frozen.frozen
@attrs.frozen(eq=False)
class HeadWeights:
    """One attention layer's per-head weights, in TransformerLens' shapes, as views of the
    model's parameters (biases a family lacks are zeros).

    Example:
        >>> import transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> w = fh.transformer.head_weights(model, 1)
        >>> tuple(w.W_Q.shape), tuple(w.W_O.shape), tuple(w.b_O.shape)
        ((4, 32, 8), (4, 8, 32), (32,))
    """

    W_Q: Tensor
    """``(n_heads, d_model, d_head)``: ``q = x @ W_Q[h] + b_Q[h]`` (before rotary embeddings)."""
    W_K: Tensor
    """``(n_kv_heads, d_model, d_head)``."""
    W_V: Tensor
    """``(n_kv_heads, d_model, d_head)``."""
    W_O: Tensor
    """``(n_heads, d_head, d_model)``: head ``h``'s result is ``z[..., h, :] @ W_O[h]``."""
    b_Q: Tensor
    """``(n_heads, d_head)``."""
    b_K: Tensor
    """``(n_kv_heads, d_head)``."""
    b_V: Tensor
    """``(n_kv_heads, d_head)``."""
    b_O: Tensor
    """``(d_model,)``: the output projection's bias, a writer of its own (no head's)."""
    has_b_O: bool
    """Whether the output projection has a bias (False: `b_O` is zeros)."""


def _per_head(view: View, matrix: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(W (head, d_in, d_head), b (head, d_head))`` of one of q, k, v, read through its point's view
    of the projection's output (the matrix's last dimension is that output)."""
    w = view.get(matrix).movedim(-2, 0)
    b = view.get(torch.zeros(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device) if bias is None else bias)
    return w, b


def head_weights(model: nn.Module, layer: int) -> HeadWeights:
    """The per-head weights of layer `layer`'s attention (see :class:`HeadWeights`).

    Args:
        model: a model of a family :func:`~funhooks.transformer.points` knows.
        layer: the layer, negative from the last.

    Returns:
        A :class:`HeadWeights` of views of the model's parameters.

    Raises:
        SpecError: for a layer the model has not, or projections that are neither ``nn.Linear``
            nor ``Conv1D``.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        ...     vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        ...     intermediate_size=64))
        >>> w = fh.transformer.head_weights(model, -1)
        >>> tuple(w.W_K.shape), w.has_b_O, bool((w.b_O == 0).all())
        ((2, 32, 8), False, True)
    """
    pts = points(model)
    q, k, v, z = (pts.q[layer], pts.k[layer], pts.v[layer], pts.z[layer])
    made: list[tuple[Tensor, Tensor]] = []
    for point in (q, k, v):
        matrix, bias = projection(model.get_submodule(point.paths[0][1]), f"{point.name} projection")
        made.append(_per_head(cast(View, point.view), matrix, bias))  # q, k, v: views of their projection
    (W_Q, b_Q), (W_K, b_K), (W_V, b_V) = made
    matrix, bias = projection(model.get_submodule(z.paths[0][1]), "output projection")
    W_O = matrix.unflatten(0, (pts.n_heads, -1))
    b_O = torch.zeros(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device) if bias is None else bias
    return HeadWeights(W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, bias is not None)
