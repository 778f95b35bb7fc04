"""The computational graph edge attribution patching scores: a model's writers, readers and edges.

A *writer* adds a term to the residual stream: the writers of
:func:`~funhooks.transformer.decompose_resid`, under its labels: the token embeddings
(``embed``), the learned position embeddings where the family has them (``pos_embed``, the same
on every input of one length, so its edges score 0), each head's result (``blocks.L.heads.H``:
the ``result`` point) and each MLP (``blocks.L.mlp_out``). The output projections' biases are
no writers here: the same on every input, no edge of theirs can change a metric. A *reader*
takes a sum of writers as its input: each head's query, key and value input
(``blocks.L.heads.H.q`` / ``.k`` / ``.v``; for grouped-query attention the keys and values have
one reader per key-value head), each MLP's input (``blocks.L.mlp``) and the logits (``logits``:
the final norm's input).
A reader's input is the residual stream *before* its norm, as the reader sees it alone: the
stream before layer L's attention for its heads, the stream after the attention of layer L for
its MLP (before it, in the parallel blocks of GPT-NeoX and Pythia), the last block's output
for the logits. An *edge* joins a writer to a reader downstream of it; the residual stream is
the sum of the writers upstream of it plus the output projections' biases.

Families: pre-norm transformers whose norms, projections and MLP the architecture table names
(GPT-2, GPT-NeoX / Pythia, Llama, Mistral, Qwen2), under any attention implementation. A
post-norm family (BERT) has no reader input before a norm: :func:`graph` refuses it.

Cost: :func:`graph` walks the model's modules once (through ``fh.transformer.points``).
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from funhooks import _frozen
from funhooks.errors import SpecError
from funhooks.transformer import Point, Points, points

__all__ = ["Graph", "graph"]

_PARTS = ("q", "k", "v")


@_frozen.frozen
@attrs.frozen(eq=False, repr=False)
class Graph:
    """The writers, readers and edges of one model (see the module's docstring for the names).

    Example:
        >>> import transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> g = fh.circuits.graph(model)
        >>> g
        Graph(gpt2: 12 writers, 27 readers, 137 edges)
        >>> g.writers[:3], g.readers[-2:]
        (('embed', 'pos_embed', 'blocks.0.heads.0'), ('blocks.1.mlp', 'logits'))
    """

    points: Points
    writers: tuple[str, ...]
    """``embed`` (and ``pos_embed``), then per layer its heads and its MLP."""
    readers: tuple[str, ...]
    """Per layer its heads' q inputs, k inputs, v inputs and its MLP; then ``logits``."""
    upstream: torch.Tensor
    """``(writers, readers)`` bool: True where the writer is upstream of the reader (an edge)."""
    parallel: bool
    """Attention and MLP read the same stream (GPT-NeoX's parallel blocks)."""
    attn_norms: tuple[str, ...]
    """Per layer, the module path of the norm before attention."""
    mlp_norms: tuple[str, ...]
    """Per layer, the module path of the norm before the MLP."""
    final_norm: str
    """The module path of the final norm."""
    embeds: int
    """The embedding writers: 1, or 2 with ``pos_embed``."""

    def __repr__(self) -> str:
        return (f"Graph({self.points.arch.name}: {len(self.writers)} writers, {len(self.readers)} readers, "
                f"{self.n_edges} edges)")

    @property
    def n_edges(self) -> int:
        """The number of edges (writer upstream of reader)."""
        return int(self.upstream.sum())

    def before(self, layer: int) -> int:
        """The number of writers before layer `layer` (the embeddings and the earlier layers')."""
        return self.embeds + layer * (self.points.n_heads + 1)

    def writer(self, layer: int, head: int | None = None) -> int:
        """The row of layer `layer`'s head `head`, or of its MLP for ``head=None``."""
        return self.before(layer) + (self.points.n_heads if head is None else head)

    def reader(self, layer: int, part: str | None = None, head: int = 0) -> int:
        """The column of a reader: layer `layer`'s head `head`'s `part` (``"q"``, ``"k"``,
        ``"v"``; k and v counted in key-value heads), or its MLP for ``part=None``; the logits
        for ``layer=n_layers``."""
        pts = self.points
        per = pts.n_heads + 2 * pts.n_kv_heads + 1
        if layer >= pts.n_layers:
            return pts.n_layers * per
        offset = {"q": 0, "k": pts.n_heads, "v": pts.n_heads + pts.n_kv_heads, None: per - 1}[part]
        return layer * per + offset + (0 if part is None else head)


def _path(point: Point, layer: int) -> str:
    return dict(point.paths)[layer]


def graph(model: nn.Module) -> Graph:
    """The :class:`Graph` of a supported transformer.

    Raises:
        SelectorError: for a family no architecture is registered for.
        SpecError: for a family without norms before attention, before the MLP and at the end
            (post-norm BERT), or without per-head projections.
    """
    pts = points(model)
    arch = pts.arch
    if arch.post_norm or arch.attn_norm is None or arch.mlp_norm is None or pts.final_norm.kind == "none":
        raise SpecError(
            f"circuits: edges are read at each reader's input before its norm, which pre-norm families have "
            f"(gpt2, gpt_neox, llama kin), got the {arch.name!r} family, whose blocks have no norm before "
            "attention, before the MLP or at the end. Use a pre-norm model.")
    n_layers, heads, kv = pts.n_layers, pts.n_heads, pts.n_kv_heads
    parallel = pts.resid_mid.kind == "none"
    writers = [p.name for p in (pts.embed, pts.pos_embed) if p.kind != "none"]
    readers: list[str] = []
    writer_layer, writer_head = [-1] * len(writers), [False] * len(writers)
    reader_layer, reader_mlp = [], []
    for layer in range(n_layers):
        writers += [f"blocks.{layer}.heads.{h}" for h in range(heads)] + [f"blocks.{layer}.mlp_out"]
        writer_layer += [layer] * (heads + 1)
        writer_head += [True] * heads + [False]
        for part, count in zip(_PARTS, (heads, kv, kv)):
            readers += [f"blocks.{layer}.heads.{h}.{part}" for h in range(count)]
        readers.append(f"blocks.{layer}.mlp")
        reader_layer += [layer] * (heads + 2 * kv + 1)
        reader_mlp += [False] * (heads + 2 * kv) + [True]
    readers.append("logits")
    reader_layer.append(n_layers)
    reader_mlp.append(False)
    w_layer, w_head = torch.tensor(writer_layer)[:, None], torch.tensor(writer_head)[:, None]
    r_layer, r_mlp = torch.tensor(reader_layer)[None], torch.tensor(reader_mlp)[None]
    upstream = (w_layer < r_layer) | ((w_layer == r_layer) & w_head & r_mlp & (not parallel))
    blocks = [_path(pts.resid_post, layer) for layer in range(n_layers)]
    return Graph(pts, tuple(writers), tuple(readers), upstream, parallel,
                 attn_norms=tuple(f"{b}.{arch.attn_norm}" for b in blocks),
                 mlp_norms=tuple(f"{b}.{arch.mlp_norm}" for b in blocks),
                 final_norm=pts.final_norm.paths[0][1], embeds=len(writer_layer) - n_layers * (heads + 1))

