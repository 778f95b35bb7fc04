"""Faithfulness: the model run with only a circuit's edges, the rest cut off, and the metric it
recovers.

A circuit is a ``(writers, readers)`` bool mask over a model's :class:`~funhooks.circuits.Graph`
(``Edges.circuit(n)``: the top n edges of :func:`~funhooks.circuits.eap`). The clean input is
run with each reader's input replaced by ``input - sum over writers cut off (writer now -
writer's reference)``: the writers it keeps reach it as they are in this run, the others as they
are in the corrupted run (``reference="corrupt"``) or as their mean over the corrupted batch,
per position (``reference="mean"``). Per head, each query, key and value is computed from its
own input. Keeping every edge runs the clean model; keeping none (reference ``"corrupt"``) runs
the corrupted one. Cutting a single edge is the exact edge patch that edge's EAP score estimates.

The metric recovered is ``(circuit - corrupt) / (clean - corrupt)``: 1 when the circuit does what
the model does, 0 when it does what the corrupted run does.

Cost: one corrupted forward without gradients (once for a whole curve), then one forward per
circuit; no gradient, nothing registered on the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch
from torch import nn

from funhooks import _frozen
from funhooks.errors import SpecError

from ._passes import Pass, Patching, Recording, check_pair
from .edge_attribution import Edges
from .graphs import Graph, graph

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Curve", "Faithfulness", "faithfulness", "faithfulness_curve"]

_CALLER = "faithfulness"
_Reference = Literal["corrupt", "mean"]


@_frozen.frozen
@attrs.frozen(eq=False)
class Faithfulness:
    """The metric of one circuit's run, beside the clean and corrupted runs'.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> def logit_diff(out):
        ...     return out.logits[:, -1, 7] - out.logits[:, -1, 8]
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 9, 3, 4]])
        >>> run = fh.circuits.faithfulness(model, logit_diff)
        >>> everything = fh.circuits.graph(model).upstream
        >>> kept_all, kept_none = run(clean, corrupt, everything), run(clean, corrupt, ~everything)
        >>> abs(kept_all.recovered - 1) < 1e-4, abs(kept_none.recovered) < 1e-4
        (True, True)
    """

    metric: torch.Tensor
    """The metric (summed over the batch) with the circuit's edges alone."""
    clean: torch.Tensor
    corrupt: torch.Tensor
    edges: int
    """The number of edges kept."""

    @property
    def recovered(self) -> float:
        """``(metric - corrupt) / (clean - corrupt)``."""
        return float((self.metric - self.corrupt) / (self.clean - self.corrupt))


@_frozen.frozen
@attrs.frozen(eq=False)
class Curve:
    """The metric recovered by the top-n edges, for several n (:func:`faithfulness_curve`)."""

    sizes: tuple[int, ...]
    metrics: torch.Tensor
    """The circuit's metric per size."""
    clean: torch.Tensor
    corrupt: torch.Tensor

    @property
    def recovered(self) -> torch.Tensor:
        """The metric recovered per size, ``(metric - corrupt) / (clean - corrupt)``."""
        return (self.metrics - self.corrupt) / (self.clean - self.corrupt)

    def plot(self, *, title: str = "Faithfulness") -> Figure:
        """The metric recovered against the number of edges (the ``plot`` extra)."""
        from .plots import plot_curve

        return plot_curve(self.sizes, self.recovered, title=title)


class _Runner:
    """The passes of one model: the reference writers, then a run per circuit."""

    def __init__(self, model: nn.Module, metric: Callable[[Any], torch.Tensor], reference: object) -> None:
        if reference not in ("corrupt", "mean"):
            raise SpecError(f"{_CALLER}: `reference` is 'corrupt' (the corrupted run's writers) or 'mean' (their "
                            f"mean over the corrupted batch), got {reference!r}. Pass one.")
        self.graph: Graph = graph(model)
        self.pass_ = Pass(self.graph, model, _CALLER)
        self.metric, self.mean = metric, reference == "mean"

    def reference(self, clean: torch.Tensor, corrupt: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
        """``(reference writers, clean metric, corrupt metric)``."""
        check_pair(clean, corrupt, _CALLER)
        self.pass_.weights()
        with torch.no_grad():
            recording = Recording()
            corrupt_metric = self.metric(self.pass_(recording, (corrupt,), kwargs)).sum()
            clean_metric = self.metric(self.pass_(Recording(), (clean,), kwargs)).sum()
        writers = recording.written()
        if self.mean:
            writers = writers.mean(0, keepdim=True).expand_as(writers)
        return writers, clean_metric, corrupt_metric

    def run(self, clean: torch.Tensor, writers: torch.Tensor, kept: object, kwargs: dict) -> torch.Tensor:
        upstream = self.graph.upstream
        if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool or kept.shape != upstream.shape:
            shown = (f"{kept.dtype} {tuple(kept.shape)}" if isinstance(kept, torch.Tensor) else type(kept).__name__)
            raise SpecError(f"{_CALLER}: `kept` is a bool mask of shape (writers, readers) = {tuple(upstream.shape)} "
                            f"(`edges.circuit(n)`, or built over `fh.circuits.graph(model).upstream`), got "
                            f"{shown}. Pass one.")
        removed = upstream & ~kept.to(upstream.device)
        with torch.no_grad():
            return self.metric(self.pass_(Patching(writers, removed.to(writers.device)), (clean,), kwargs)).sum()


def faithfulness(model: nn.Module, metric: Callable[[Any], torch.Tensor], *,
                 reference: _Reference = "corrupt") -> Callable[..., Faithfulness]:
    """The model run with only a circuit's edges; see the module's docstring.

    Args:
        model: a model :func:`~funhooks.circuits.graph` supports; it is not changed.
        metric: ``metric(model_output) -> tensor``, summed over the batch.
        reference: what a cut edge carries: ``"corrupt"`` (the writer on the corrupted input)
            or ``"mean"`` (its mean over the corrupted batch, per position).

    Returns:
        ``f(clean, corrupt, kept, **kwargs) -> Faithfulness``: three forwards (corrupted,
        clean, circuit), without gradients.

    Raises:
        SpecError: for an unsupported family or `reference`; (when called) for `clean` and
            `corrupt` of different shapes, or a `kept` that is not a ``(writers, readers)`` bool mask.
    """
    runner = _Runner(model, metric, reference)

    def run(clean: torch.Tensor, corrupt: torch.Tensor, kept: torch.Tensor, **kwargs: object) -> Faithfulness:
        writers, clean_metric, corrupt_metric = runner.reference(clean, corrupt, kwargs)
        value = runner.run(clean, writers, kept, kwargs)
        return Faithfulness(value, clean_metric, corrupt_metric, int((kept & runner.graph.upstream).sum()))

    return run


def faithfulness_curve(model: nn.Module, metric: Callable[[Any], torch.Tensor], edges: Edges, sizes: Sequence[int],
                       *, reference: _Reference = "corrupt", absolute: bool = True) -> Callable[..., Curve]:
    """The metric recovered by the top-n edges of `edges` (by magnitude; signed with
    ``absolute=False``) for each n in `sizes`.

    Returns:
        ``f(clean, corrupt, **kwargs) -> Curve``: two reference forwards and one per size.

    Raises:
        SpecError: as :func:`faithfulness`; for sizes outside ``[0, edges.n_edges]``, or
            `edges` of another model's graph.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> def logit_diff(out):
        ...     return out.logits[:, -1, 7] - out.logits[:, -1, 8]
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 9, 3, 4]])
        >>> edges = fh.circuits.eap(model, logit_diff)(clean, corrupt)
        >>> curve = fh.circuits.faithfulness_curve(model, logit_diff, edges, [0, 10, 137])(clean, corrupt)
        >>> curve.sizes, torch.allclose(curve.recovered[[0, -1]], torch.tensor([0.0, 1.0]), atol=1e-4)
        ((0, 10, 137), True)
    """
    runner = _Runner(model, metric, reference)
    if not isinstance(edges, Edges) or edges.readers != runner.graph.readers or edges.writers != runner.graph.writers:
        raise SpecError(f"faithfulness_curve: `edges` is what `fh.circuits.eap` returned for this model, got "
                        f"{type(edges).__name__}{'' if not isinstance(edges, Edges) else ' of another graph'}. "
                        "Pass the model's Edges.")
    masks = [edges.circuit(n, absolute=absolute) for n in sizes]  # checks the sizes now

    def curve(clean: torch.Tensor, corrupt: torch.Tensor, **kwargs: object) -> Curve:
        writers, clean_metric, corrupt_metric = runner.reference(clean, corrupt, kwargs)
        values = torch.stack([runner.run(clean, writers, kept, kwargs) for kept in masks])
        return Curve(tuple(sizes), values, clean_metric, corrupt_metric)

    return curve
