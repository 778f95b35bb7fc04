"""Attribution patching (AtP): every point and position of a patching sweep, estimated at once.

Activation patching runs the corrupted input once per (point, position), with the clean
activation put in place, and reads a metric. Attribution patching estimates all of those
changes at once, to first order: for each point, ``(clean - corrupt) · d metric / d
activation`` (the gradient taken on the corrupted run), summed over everything but the
position axis (and, with ``heads=``, the head axis). The table has the sweep's shape: one row
per point (a selected module's output, or its positional input with ``inputs=True``, or a
standard point of ``fh.transformer.points``; one row per call), one column per position. Only
the point is differentiated: the other items of a tuple (the ``None`` an attention module
returns under SDPA, a cache among a block's arguments) are left alone.

Cost: one forward on the clean input (without gradients: ``activation_grads``' first pass),
one forward and one backward on the corrupted input, whatever the number of points and
positions; memory: the clean and corrupted values of every point, and their gradients.
Built on :class:`~funhooks.runs.zero_probes.Probes`: zero probes added to the points and
differentiated with respect to them alone (by plain autograd, with the parameters detached for
the pass, so no graph is kept for the weights; inside a ``torch.func`` transform by
``torch.func.grad``), so nothing is registered on the model, no ``.grad`` of a parameter is
touched, and in-place ops after a point are fine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from funhooks import _frozen, _html
from funhooks.errors import InterventionError, SpecError
from funhooks.specs.selector import Where
from funhooks.specs.spec import Located

from .zero_probes import Probes

__all__ = ["Attribution", "attribution_patching"]

_CALLER = "attribution_patching"


@_frozen.frozen
@attrs.frozen(eq=False)
class Attribution:
    """What :func:`attribution_patching` returns for one (clean, corrupt) pair.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> atp = fh.attribution_patching(model, ["0", "1"], lambda out: out.sum())
        >>> result = atp(torch.randn(1, 5, 3), torch.randn(1, 5, 3))
        >>> result.points, tuple(result.table.shape)
        (('0', '1'), (2, 5))
    """

    table: torch.Tensor
    """``(points, positions)``, or ``(points, positions, heads)`` with ``heads=``: the estimated
    change of the metric when that point's value at that position (and head) is patched from
    the clean run into the corrupted one: the sweep's table minus ``corrupt``."""
    points: tuple[str, ...]
    """The module path of each row, in module order (a module called k times gives k rows); for
    a standard point, its Record path (``blocks.L.<name>``)."""
    clean: torch.Tensor
    """The metric on the clean input."""
    corrupt: torch.Tensor
    """The metric on the corrupted input."""

    def __repr__(self) -> str:
        return (f"Attribution(points={_html.short(self.points)}, table=Tensor{tuple(self.table.shape)}, "
                f"clean={_metric(self.clean)}, corrupt={_metric(self.corrupt)})")

    def html(self, tokens: Sequence[object] | None = None, *, digits: int = 3) -> _html.Html:
        """The table as an HTML heatmap: one row per point (per point and head with ``heads=``),
        one column per position labelled by `tokens` (the text of each position; None: its
        index), each value rounded to `digits` decimals on a red (above 0) / blue (below 0)
        background. A notebook shows the result; ``str()`` of it is the markup. Only the shown
        rows are read to the host.

        Raises:
            ValueError: for `tokens` of another length than the table's positions.
        """
        names, values, total = self._shown()
        scale = _html.largest(values)
        rows = [[_html.Cell(name), *(_html.Cell(_html.number(v, digits), _html.shade(v, scale), repr(v)) for v in row)]
                for name, row in zip(names, values)]
        header = ["point", *_html.labels("Attribution.html", tokens, self.table.shape[1])]
        return _html.table(header, rows, total=total, row_header=True, caption=self._caption())

    def svg(self, tokens: Sequence[object] | None = None) -> _html.Svg:
        """The table as a picture: an SVG heatmap, one row of cells per point (per point and
        head with ``heads=``), one column per position labelled underneath by `tokens` (None:
        its index), coloured as :meth:`html` colours its cells, the exact value on hover. For a
        table too wide to read as numbers (a long prompt, every head). A notebook shows it as
        an image (``_repr_svg_``); ``str()`` of it is the markup, a standalone ``.svg`` file.
        Only the shown rows are read to the host; self-contained (no script, nothing fetched).

        Raises:
            ValueError: for `tokens` of another length than the table's positions.

        Example:
            >>> import torch, funhooks as fh
            >>> result = fh.Attribution(torch.tensor([[0.5, -1.0]]), ("h.0",), torch.tensor(1.0), torch.tensor(0.0))
            >>> picture = result.svg(tokens=["The", " cat"])
            >>> picture.startswith("<svg"), "rgba(31,119,180,1.00)" in picture, ">The</text>" in picture
            (True, True, True)
        """
        names, values, total = self._shown()
        columns = _html.labels("Attribution.svg", tokens, self.table.shape[1])
        return _html.heatmap(values, names, columns, caption=self._caption(), total=total)

    def _shown(self) -> tuple[list[str], list[list[float]], int]:
        """The names and values of the rows a display shows (the first ``MAX_ROWS``, read to the
        host in one copy) and how many rows there are in all."""
        table = self.table if self.table.ndim == 3 else self.table.unsqueeze(-1)
        heads = self.table.ndim == 3
        names = [f"{p} · head {h}" if heads else p for p in self.points for h in range(table.shape[2])]
        shown = table.detach().movedim(2, 1).reshape(-1, table.shape[1])[: _html.MAX_ROWS].float().cpu()
        return names[: _html.MAX_ROWS], shown.tolist(), len(names)

    def _caption(self) -> str:
        return f"Attribution patching: clean {_metric(self.clean)}, corrupt {_metric(self.corrupt)}"

    def _repr_html_(self) -> str:
        return self.html()


def _metric(value: torch.Tensor) -> str:
    """A metric as a display writes it: its value when it is one number, else its shape."""
    return _html.number(value.item()) if value.numel() == 1 else f"Tensor{tuple(value.shape)}"


def attribution_patching(
    model: nn.Module, where: Where | Located, metric: Callable[[Any], torch.Tensor], *, inputs: bool = False,
    element: int | str = 0, dim: int = 1, heads: int | None = None,
) -> Callable[..., Attribution]:
    """Attribution patching: the linear estimate of every patch of a sweep, in about 3 passes.

    Args:
        model: the model (wrappers are looked through for paths).
        where: a selector for the points: the modules whose outputs (or inputs) are patched;
            or a standard point (``fh.transformer.points(model).resid_pre``, ``.z[3]``, ...),
            whose rows are named by its Record paths (``blocks.L.<name>``).
        metric: ``metric(model_output) -> tensor``; its sum is differentiated (a per-example
            metric gives the estimate for the batch's total, which is what a sweep patching
            every example at once changes).
        inputs: the points are the selected modules' positional inputs instead of their
            outputs (e.g. GPT-2's ``attn.c_proj`` input: the heads' outputs before the
            projection, TransformerLens' ``z``). Not with a standard point, which says
            itself where its value is.
        element: the item of a tuple, list or dict value that is the point (for ``inputs``,
            the positional argument); a plain tensor is taken whole. Only that item is
            differentiated: the others (``None``, attention weights, a cache) are left alone.
        dim: the position axis of the point's value (``(batch, position, ...)``: 1).
        heads: split the last axis into ``heads`` equal parts and keep one column per head;
            for a standard point with a head axis (``q``, ``k``, ``v``, ``z``: ``(..., head,
            d_head)``), the number of heads on that axis, kept as the column.

    Returns:
        ``f(clean, corrupt, **kwargs) -> Attribution`` calling ``model(clean, **kwargs)``
        without gradients and ``model(corrupt, **kwargs)`` with a backward pass; `clean` and
        `corrupt` must have the same shape.

    Raises:
        SelectorError: when `where` matches no module.
        SpecError: for ``inputs=True`` with a standard point.
        InterventionError: (when called) for `clean` and `corrupt` of different shapes, or an
            `element`, `dim` or `heads` that does not fit a point's value.
        TransformError: (when called) when a point's value has another shape, or its module
            runs another number of times, on the corrupted input than on the clean one.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> atp = fh.attribution_patching(model, "1", lambda out: out.sum())
        >>> clean, corrupt = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
        >>> result = atp(clean, corrupt)
        >>> with torch.no_grad():       # the estimate is exact where the metric is linear in the point
        ...     patched = model[2](model[1](model[0](clean))).sum() - result.corrupt
        >>> torch.allclose(result.table.sum(), patched, atol=1e-5)
        True
    """
    point = isinstance(where, Located)
    if point and inputs:
        raise SpecError(f"{_CALLER}: a standard point says itself where its value is (an output, an input or an op's "
                        f"result), got `inputs=True` with {where!r}. Leave `inputs` out.")
    headed = point and getattr(where, "view", None) is not None  # a per-head view: (..., head, d_head)
    probes = Probes(model, where, lambda out: metric(out).sum(), _CALLER,
                    event="forward_pre" if inputs else "forward", element=None if point else element,
                    detached=True)

    def attribute(clean: object, corrupt: object, **kwargs: object) -> Attribution:
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (clean, corrupt)]
        if shapes[0] != shapes[1]:
            raise InterventionError(
                f"{_CALLER}: `clean` and `corrupt` have the same shape, got {shapes[0]} and {shapes[1]}. Pad or "
                "truncate the prompts to one length."
            )
        state = probes.state()
        out, found = probes.discover((clean,), kwargs, state)
        with torch.no_grad():  # the corrupted forward's gradient is taken inside; nothing else builds a graph
            corrupt_metric, rec = probes.differentiate(found, (corrupt,), kwargs, state)
            rows: list[torch.Tensor] = []
            points: list[str] = []
            for path in rec:
                for before, after, grad in zip(found.outputs[path], rec.calls(path, probes.name),
                                               rec.calls(path, "grad")):
                    value = _point(before, element, path)
                    rows.append(_estimate(value, _point(after, element, path), _point(grad, element, path),
                                          dim=dim, heads=heads, headed=headed, path=path))
                    points.append(path)
            _same_positions(rows, points, dim)
            return Attribution(torch.stack(rows), tuple(points), metric(out).sum(), corrupt_metric.detach())

    return attribute


def _point(value: object, element: int | str, path: str) -> torch.Tensor:
    """The point's tensor in a module's value: the value itself, or its item `element`."""
    item = value
    if not isinstance(value, torch.Tensor):
        try:
            item = value[element]  # type: ignore[index]
        except (TypeError, KeyError, IndexError):
            item = None
    if not isinstance(item, torch.Tensor) or not item.is_floating_point():
        raise InterventionError(
            f"{_CALLER}: a point is a floating tensor, or the item `element` of a tuple, list or dict, got "
            f"{type(value).__name__} with element={element!r} at module {path!r}. Pass the `element` of the "
            "value to attribute."
        )
    return item


def _estimate(clean: torch.Tensor, corrupt: torch.Tensor, grad: torch.Tensor, *, dim: int, heads: int | None,
              headed: bool, path: str) -> torch.Tensor:
    """``(clean - corrupt) * grad`` summed over every axis but `dim` (and the heads: the last
    axis split, or where the value is `headed`, its axis -2)."""
    head_axis = clean.ndim - (2 if headed else 1)
    if not -clean.ndim <= dim < clean.ndim or (heads is not None and dim % clean.ndim == head_axis):
        raise InterventionError(
            f"{_CALLER}: `dim` is an axis of the point's value other than the one split into heads, got "
            f"dim={dim} for a value of shape {tuple(clean.shape)} at module {path!r}. Pass the position axis."
        )
    terms = (clean - corrupt) * grad
    position = dim % clean.ndim
    if heads is None:
        return terms.sum(tuple(d for d in range(terms.ndim) if d != position))
    if headed:
        if heads != clean.shape[-2]:
            raise InterventionError(
                f"{_CALLER}: `heads` is the number of heads of the point's value (axis -2 of (..., head, d_head)), "
                f"got heads={heads} for a value of shape {tuple(clean.shape)} at {path!r}. Pass "
                f"heads={clean.shape[-2]}.")
        return terms.sum(tuple(d for d in range(terms.ndim) if d not in (position, head_axis)))
    if heads < 1 or clean.shape[-1] % heads:
        raise InterventionError(
            f"{_CALLER}: `heads` divides the last axis of the point's value, got heads={heads} for a value of "
            f"shape {tuple(clean.shape)} at module {path!r}. Pass the number of heads concatenated there."
        )
    terms = terms.unflatten(-1, (heads, clean.shape[-1] // heads))
    return terms.sum(tuple(d for d in range(terms.ndim) if d not in (position, terms.ndim - 2)))


def _same_positions(rows: list[torch.Tensor], points: list[str], dim: int) -> None:
    sizes = {tuple(r.shape) for r in rows}
    if len(sizes) > 1:
        raise InterventionError(
            f"{_CALLER}: every point has the same size along `dim` (and the same heads), got "
            f"{dict(zip(points, (tuple(r.shape) for r in rows)))} for dim={dim}. Select points of one kind "
            "per call."
        )
