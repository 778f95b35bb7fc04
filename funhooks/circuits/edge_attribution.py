"""Edge attribution patching (EAP, Syed et al. 2023) and EAP with integrated gradients (EAP-IG,
Hanna et al. 2024): a score for every writer -> reader edge of a model's :class:`Graph`.

An edge's score estimates, to first order, how much the metric changes when that edge alone is
corrupted: the clean run with the reader's input changed by ``corrupt_w - clean_w`` for that
one writer. The estimate is ``(corrupt_w - clean_w) · d metric / d input_r`` summed over the
batch and the positions, the gradient taken on the **clean** run (as in both papers), at the
reader's input before its norm, through that reader's path alone (a head's query, key or value;
an MLP; the logits). It is exact where the metric is linear in the reader's input along that
path. The scores are the changes :func:`~funhooks.circuits.faithfulness` measures for real: a
circuit's run keeps the edges it holds and corrupts the others.

EAP-IG with ``steps=k`` averages the gradient over ``k`` runs whose embeddings are interpolated
from the corrupted run's to the clean run's (``alpha = 1/k, 2/k, ..., 1``; ``k = 1`` is EAP).

Cost: one corrupted forward without gradients, then per step one forward and one backward of
the metric with respect to the readers alone (no weight gradient is computed; nothing is
registered on the model; no ``.grad`` is touched); per layer a vector-Jacobian product of the
attention norm for all its heads at once and one contraction of the writers with the readers' gradients
(``batch x positions x writers x readers x d_model`` multiply-adds in all, a fraction of a
forward for GPT-2-sized models). Memory: every writer's value twice (``batch x positions x
writers x d_model``) and one layer's reader gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from funhooks import _frozen
from funhooks.errors import SpecError

from ._passes import Pass, Probing, Recording, check_pair
from .graphs import Graph, graph

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Edges", "eap"]

_CALLER = "eap"
_SHOWN = 3
"""Edges the repr names."""


@_frozen.frozen
@attrs.frozen(eq=False, repr=False)
class Edges:
    """What :func:`eap` returns: a score per edge of a model's :class:`Graph`.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 9, 3, 4]])
        >>> edges = fh.circuits.eap(model, lambda out: out.logits[:, -1, 7] - out.logits[:, -1, 8])(clean, corrupt)
        >>> edges.table.shape, edges.n_edges
        (torch.Size([12, 27]), 137)
        >>> [type(item).__name__ for item in edges.top(1)[0]]   # the largest edge by magnitude
        ['str', 'str', 'float']
        >>> edges.circuit(5).sum()                              # a circuit: the top 5 edges
        tensor(5)
    """

    table: torch.Tensor
    """``(writers, readers)``: each edge's estimated change of the metric when it alone is
    corrupted; 0 where a writer is not upstream of a reader (no edge)."""
    graph: Graph
    clean: torch.Tensor
    """The metric (summed over the batch) on the clean input."""
    corrupt: torch.Tensor
    """The metric (summed over the batch) on the corrupted input."""
    steps: int
    """1 for EAP, k for EAP-IG."""

    @property
    def writers(self) -> tuple[str, ...]:
        """The table's row labels."""
        return self.graph.writers

    @property
    def readers(self) -> tuple[str, ...]:
        """The table's column labels."""
        return self.graph.readers

    @property
    def n_edges(self) -> int:
        """The number of edges scored."""
        return self.graph.n_edges

    def top(self, k: int, *, absolute: bool = True) -> list[tuple[str, str, float]]:
        """The `k` edges of largest score (by magnitude, or signed with ``absolute=False``),
        as ``(writer, reader, score)``, largest first."""
        order = self._order(absolute)[:k]
        n_readers = len(self.readers)
        # one copy to the host of the k indices and their scores (not one sync per edge on CUDA)
        scores = self.table.flatten()[order].double().tolist()
        return [(self.writers[i // n_readers], self.readers[i % n_readers], score)
                for i, score in zip(order.tolist(), scores)]

    def circuit(self, n: int, *, absolute: bool = True) -> torch.Tensor:
        """The `n` top edges as a ``(writers, readers)`` bool mask: the ``kept`` of
        :func:`~funhooks.circuits.faithfulness`."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.n_edges:
            raise SpecError(f"circuit: `n` is a number of edges in [0, {self.n_edges}], got {n!r}. Pass one.")
        kept = torch.zeros(self.table.numel(), dtype=torch.bool, device=self.table.device)
        kept[self._order(absolute)[:n]] = True
        return kept.reshape(self.table.shape)

    def _order(self, absolute: bool) -> torch.Tensor:
        flat = self.table.flatten().float()
        key = flat.abs() if absolute else flat
        key = key.masked_fill(~self.graph.upstream.flatten().to(flat.device), -float("inf"))
        return key.argsort(descending=True, stable=True)[: self.n_edges]

    def plot(self, *, title: str | None = None) -> Figure:
        """The table as a writers x readers heatmap (the ``plot`` extra)."""
        from .plots import plot_edges

        shown = title or ("EAP" if self.steps == 1 else f"EAP-IG ({self.steps} steps)")
        return plot_edges(self.table, self.writers, self.readers, edges=self.graph.upstream, title=shown)

    def __repr__(self) -> str:
        kind = "EAP" if self.steps == 1 else f"EAP-IG, {self.steps} steps"
        tops = ", ".join(f"{w} -> {r}: {s:+.3g}" for w, r, s in self.top(_SHOWN))
        return (f"Edges({kind}: {self.n_edges} edges, {len(self.writers)} writers x {len(self.readers)} readers; "
                f"metric clean {float(self.clean):.4g}, corrupt {float(self.corrupt):.4g}; top: {tops})")


def eap(model: nn.Module, metric: Callable[[Any], torch.Tensor], *, steps: int = 1,
        batch_steps: int = 1) -> Callable[..., Edges]:
    """Edge attribution patching: a score for every edge of the model's :class:`Graph`.

    Args:
        model: a pre-norm Hugging Face transformer (GPT-2, GPT-NeoX, Llama kin), eager or SDPA
            attention; it is not changed.
        metric: ``metric(model_output) -> tensor``; its sum over the batch is differentiated.
        steps: 1 for EAP (the gradient on the clean run); ``k > 1`` for EAP-IG (the gradient
            averaged over k runs with interpolated embeddings): k + 1 forwards and k backwards.
        batch_steps: how many of EAP-IG's interpolated runs (after the clean one) go through the
            model as one batch (the inputs repeated along the batch axis): fewer, larger passes,
            for the memory of that many runs. The scores are the same.

    Returns:
        ``f(clean, corrupt, **kwargs) -> Edges``, calling ``model(corrupt, **kwargs)`` without
        gradients and ``model(clean, **kwargs)`` (and the interpolated runs) with a backward.
        With `batch_steps`, the tensors in `kwargs` whose first axis is the batch's are repeated
        with the input (an ``attention_mask``).

    Raises:
        SelectorError: for a family no architecture is registered for.
        SpecError: for a post-norm family (BERT), a `steps` or `batch_steps` that is not a
            positive int, or (when called) `clean` and `corrupt` of different shapes.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> def logit_diff(out):
        ...     return out.logits[:, -1, 7] - out.logits[:, -1, 8]
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 9, 3, 4]])
        >>> ig = fh.circuits.eap(model, logit_diff, steps=4)(clean, corrupt)
        >>> ig.steps, ig.table.shape
        (4, torch.Size([12, 27]))
    """
    for name, value in (("steps", steps), ("batch_steps", batch_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = "1: EAP, k > 1: EAP-IG with k steps" if name == "steps" else "interpolated runs per batch"
            raise SpecError(f"{_CALLER}: `{name}` is a positive int ({what}), got "
                            f"{value!r}. Pass one.")
    g = graph(model)
    pass_ = Pass(g, model, _CALLER)

    def attribute(clean: torch.Tensor, corrupt: torch.Tensor, **kwargs: object) -> Edges:
        check_pair(clean, corrupt, _CALLER)
        pass_.weights()
        reference = Recording()
        with torch.no_grad():
            corrupt_metric = metric(pass_(reference, (corrupt,), kwargs)).sum()
        corrupted = reference.written()
        embeds = reference.chunks[0][:, :, 0]  # the token embeddings
        probing = Probing()  # alpha = 1 first: the clean run, whose writers the scores need
        clean_metric, heads, streams = _differentiate(pass_, probing, metric, clean, kwargs)
        diff = corrupted - probing.written().detach()
        table = _scores(pass_, probing, heads, streams, diff)
        clean_embed = probing.chunks[0][:, :, 0].detach()
        alphas = [step / steps for step in range(steps - 1, 0, -1)]
        for first in range(0, len(alphas), batch_steps):
            group = alphas[first:first + batch_steps]
            probing = Probing(torch.cat([embeds + alpha * (clean_embed - embeds) for alpha in group]))
            _, heads, streams = _differentiate(pass_, probing, metric, _repeat(clean, len(group), clean.shape[0]),
                                               {k: _repeat(v, len(group), clean.shape[0]) for k, v in kwargs.items()})
            table += _scores(pass_, probing, heads, streams, diff.repeat(len(group), 1, 1, 1))
        return Edges(table * g.upstream.to(table.device) / steps, g, clean_metric, corrupt_metric.detach(), steps)

    return attribute


def _repeat(value: object, times: int, batch: int) -> Any:
    """A tensor whose first axis is the batch's, repeated `times` along it; anything else as it is."""
    if times == 1 or not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[0] != batch:
        return value
    return value.repeat(times, *[1] * (value.ndim - 1))


def _differentiate(pass_: Pass, probing: Probing, metric: Callable[[Any], torch.Tensor], inputs: torch.Tensor,
                   kwargs: dict) -> tuple[torch.Tensor, dict[tuple[int, str], torch.Tensor], dict[int, torch.Tensor]]:
    """One probed forward and the backward of the metric's sum to the readers' probes alone:
    ``(metric, head reader gradients, MLP and logits reader gradients)``."""
    with torch.enable_grad():
        value = metric(pass_(probing, (inputs,), kwargs)).sum()
        probes = [*probing.heads.values(), *probing.streams_in.values()]
        found = torch.autograd.grad(value, probes, allow_unused=True)
    grads = [torch.zeros_like(p) if d is None else d.detach() for p, d in zip(probes, found)]
    return value.detach(), dict(zip(probing.heads, grads)), dict(zip(probing.streams_in, grads[len(probing.heads):]))


def _scores(pass_: Pass, probing: Probing, heads: dict[tuple[int, str], torch.Tensor],
            streams: dict[int, torch.Tensor], diff: torch.Tensor) -> torch.Tensor:
    """``(writers, readers)``: each writer's change dotted with each reader's gradient, one
    matmul per layer (and per MLP and the logits) over ``batch x position x d_model``."""
    g = pass_.graph
    table = torch.zeros(g.upstream.shape, dtype=diff.dtype, device=diff.device)
    flat = diff.permute(2, 0, 1, 3).reshape(diff.shape[2], -1)  # (writers, b * p * d)
    with torch.no_grad():
        for layer in range(g.points.n_layers):
            first = g.reader(layer, "q")
            reads = pass_.head_grads(probing, heads, layer).flatten(1)  # (readers, b * p * d)
            n = g.before(layer)  # the writers before this layer
            table[:n, first:first + reads.shape[0]] = flat[:n] @ reads.T.to(flat.dtype)
        for column, grad in streams.items():
            table[:, column] = flat @ grad.flatten().to(flat.dtype)
    return table
