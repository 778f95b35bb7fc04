"""One forward of a model as the circuits see it: every writer recorded, and each reader's input
either probed (a zero tensor added where its gradient is wanted) or patched (the writers cut
off from it replaced by their reference values).

The specs are standard points and norm inputs of the unmodified model, made once per model
(``fh.capture``): the writers are ``fh.transformer``'s (``pts.writers``: ``embed``,
``pos_embed``, ``result``, ``mlp_out``), the per-head weights ``fh.transformer.head_weights``;
what a call does is the :class:`_Job` it is given. Per head, a reader's input
is not a tensor of the model: the query, key and value projections read one normed stream.
So a head's reader is probed at its projection's output (per head, through the point's view),
and its gradient carried back to the stream before the norm through the head's slice of the
projection weight and the norm's vector-Jacobian product at the recorded stream (one backward
of the norm run on the stream repeated per head): exact, since that input feeds that head's projection alone. Patched, a head's query
(key, value) is recomputed from its own input, ``norm(stream - removed) @ W_head``, as a change
added to the projection's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from funhooks.errors import SpecError
from funhooks.runs import capture
from funhooks.specs import edit
from funhooks.transformer import Point, head_weights

from .graphs import Graph

__all__ = ["Pass", "Patching", "Probing", "Recording", "check_pair"]

Tensor = torch.Tensor
_PARTS = ("q", "k", "v")


def _paths(point: Point) -> list[str]:
    """A per-layer point's module paths, in layer order."""
    return [path for _, path in point.paths]


def check_pair(clean: object, corrupt: object, caller: str) -> None:
    """`clean` and `corrupt` are token tensors of one shape."""
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (clean, corrupt)]
    if not all(isinstance(t, torch.Tensor) for t in (clean, corrupt)) or shapes[0] != shapes[1]:
        raise SpecError(f"{caller}: `clean` and `corrupt` are input tensors of the same shape, got {shapes[0]} and "
                        f"{shapes[1]}. Pad or truncate the prompts to one length.")


class _Job:
    """What one forward records: the stream before each layer, the writers in order."""

    def __init__(self) -> None:
        self.streams: dict[int, Tensor] = {}
        self.chunks: list[Tensor] = []  # (batch, position, writers, d_model), in writer order
        self.count = 0

    def written(self) -> Tensor:
        """The writers so far, ``(batch, position, writers, d_model)``."""
        return torch.cat(self.chunks, 2)

    def embed(self, value: Tensor) -> Tensor | None:
        """The embeddings to use instead of `value` (None: keep it)."""
        return None

    def reader(self, pass_: Pass, layer: int, part: str, value: Tensor, given: Tensor) -> Tensor | None:
        """A head reader group's new projection output (None: keep it)."""
        return None

    def stream(self, pass_: Pass, column: int, value: Tensor) -> Tensor | None:
        """An MLP's or the final norm's new input (None: keep it)."""
        return None


class Recording(_Job):
    """Record the writers; with `embed`, run on those embeddings instead of the input's."""

    def __init__(self, embed: Tensor | None = None) -> None:
        super().__init__()
        self.replacement = embed

    def embed(self, value: Tensor) -> Tensor | None:
        return self.replacement


class Probing(Recording):
    """Record the writers and add a zero probe at every reader (its gradient is the reader's)."""

    def __init__(self, embed: Tensor | None = None) -> None:
        super().__init__(embed)
        self.heads: dict[tuple[int, str], Tensor] = {}
        self.streams_in: dict[int, Tensor] = {}  # reader column -> probe

    def _probe(self, value: Tensor) -> Tensor:
        return torch.zeros_like(value).requires_grad_()

    def reader(self, pass_: Pass, layer: int, part: str, value: Tensor, given: Tensor) -> Tensor | None:
        probe = self.heads[(layer, part)] = self._probe(value)
        return value + probe

    def stream(self, pass_: Pass, column: int, value: Tensor) -> Tensor | None:
        probe = self.streams_in[column] = self._probe(value)
        return value + probe


class Patching(_Job):
    """Each reader's input minus, for every writer cut off from it, ``(writer now - reference)``."""

    def __init__(self, reference: Tensor, removed: Tensor) -> None:
        super().__init__()
        self.reference, self.removed = reference, removed  # (b, p, writers, d), (writers, readers)

    def _delta(self, columns: slice) -> Tensor | None:
        n = sum(c.shape[2] for c in self.chunks)
        cut = self.removed[:n, columns]
        if not bool(cut.any()):
            return None
        now = self.written()
        return torch.einsum("bpwd,wr->bprd", now - self.reference[:, :, :n].to(now.dtype), cut.to(now.dtype))

    def reader(self, pass_: Pass, layer: int, part: str, value: Tensor, given: Tensor) -> Tensor | None:
        columns = pass_.columns(layer, part)
        delta = self._delta(columns)
        if delta is None:
            return None
        norm = pass_.attn_norm[layer]
        changed = self.removed[:, columns].any(0).to(delta.dtype)[:, None]  # heads with an edge cut
        normed = norm(self.streams[layer][:, :, None] - delta)
        weight = pass_.weights_in[part][layer]  # (heads, d_model, d_head)
        change = (normed - given[:, :, None]) * changed
        return value + torch.einsum("bphd,hde->bphe", change, weight.to(change.dtype))

    def stream(self, pass_: Pass, column: int, value: Tensor) -> Tensor | None:
        delta = self._delta(slice(column, column + 1))
        return None if delta is None else value - delta[:, :, 0]


class Pass:
    """The specs of one model's circuit passes, made once; ``pass_(job, args, kwargs)`` runs one
    (after ``weights()`` read the per-head weights, which patching and the heads' gradients use)."""

    def __init__(self, graph: Graph, model: nn.Module, caller: str) -> None:
        self.graph, self.model, self.caller = graph, model, caller
        pts = graph.points
        get = model.get_submodule
        self._resid = {id(get(path)): layer for layer, path in enumerate(_paths(pts.resid_pre))}
        self._qkv = {part: {id(get(path)): layer for layer, path in enumerate(_paths(getattr(pts, part)))}
                     for part in _PARTS}
        self._norm_in = {id(get(path)): graph.reader(layer) for layer, path in enumerate(graph.mlp_norms)}
        self._norm_in[id(get(graph.final_norm))] = graph.reader(pts.n_layers)
        self.attn_norm = [get(path) for path in graph.attn_norms]
        self.weights_in: dict[str, list[Tensor]] = {}
        self._projections = [get(path) for part in _PARTS for path in _paths(getattr(pts, part))]
        self._read: list[tuple[object, int]] = []  # the projections' weights (and data) `weights_in` views
        self.job: _Job = _Job()
        embed, *others = pts.writers  # the embeddings first: a run on other embeddings starts there
        specs = [edit(embed, self._on_embed), *(edit(p, self._on_writer) for p in others),
                 edit(pts.resid_pre, self._on_resid),
                 *(edit(getattr(pts, part), self._on_part(part)) for part in _PARTS),
                 edit([*graph.mlp_norms, graph.final_norm], self._on_norm_in, event="forward_pre")]
        self._run = capture(model, specs)

    def columns(self, layer: int, part: str) -> slice:
        """The reader columns of layer `layer`'s heads' `part`."""
        start = self.graph.reader(layer, part, 0)
        count = self.graph.points.n_heads if part == "q" else self.graph.points.n_kv_heads
        return slice(start, start + count)

    def weights(self) -> None:
        """Read the per-head input weights as they are now, ``(heads, d_model, d_head)`` per part
        and layer: once per call of the function a user holds (views of the parameters, so a
        step of an optimizer in between is seen; read again when a weight was replaced or moved:
        ``.to()`` swaps a parameter's data)."""
        now = [(w, w.data_ptr()) if isinstance(w := getattr(m, "weight", None), Tensor) else (w, 0)
               for m in self._projections]
        if len(now) == len(self._read) and all(a is b and p == q for (a, p), (b, q) in zip(now, self._read)):
            return
        self._read = now
        layers = [head_weights(self.model, layer) for layer in range(self.graph.points.n_layers)]
        self.weights_in = {"q": [w.W_Q for w in layers], "k": [w.W_K for w in layers], "v": [w.W_V for w in layers]}

    def __call__(self, job: _Job, args: tuple, kwargs: dict) -> Any:
        self.job = job
        try:
            out, _ = self._run(*args, **kwargs)
        finally:
            self.job = _Job()
        return out

    def _on_embed(self, module: nn.Module, args: tuple, value: Tensor) -> Tensor | None:
        new = self.job.embed(value)
        self.job.chunks.append((value if new is None else new)[:, :, None])
        return new

    def _on_writer(self, module: nn.Module, args: tuple, value: Tensor) -> None:
        """A writer's value: ``(batch, position, d_model)``, or per head ``(..., head, d_model)``."""
        written = value if value.ndim == 4 else value[:, :, None]
        chunks = self.job.chunks  # a position embedding may have a batch of 1: as many as the embeddings'
        chunks.append(written.expand(chunks[0].shape[0], *written.shape[1:]))

    def _on_resid(self, module: nn.Module, args: tuple, value: Tensor) -> None:
        self.job.streams[self._resid[id(module)]] = value

    def _on_part(self, part: str) -> Callable[[nn.Module, tuple, Tensor], Tensor | None]:
        layers = self._qkv[part]

        def on_part(module: nn.Module, args: tuple, value: Tensor) -> Tensor | None:
            return self.job.reader(self, layers[id(module)], part, value, args[0])

        on_part.__name__ = f"circuit_{part}"
        return on_part

    def _on_norm_in(self, module: nn.Module, args: tuple) -> tuple | None:
        new = self.job.stream(self, self._norm_in[id(module)], args[0])
        return None if new is None else (new, *args[1:])

    def head_grads(self, job: Probing, grads: dict[tuple[int, str], Tensor], layer: int) -> Tensor:
        """The gradients at layer `layer`'s head readers' inputs (before the norm),
        ``(q heads + 2 kv heads, batch, position, d_model)``, from those at the projections'
        outputs: through each head's weight (one batched matmul per part), then the norm's
        vector-Jacobian product at the recorded stream, for all the heads in one backward of the
        norm run on the stream repeated per head (a norm acts on the last axis alone)."""
        normed = torch.cat([torch.matmul(grads[(layer, part)].permute(2, 0, 1, 3),  # (heads, b, p, d_head)
                                         self.weights_in[part][layer].transpose(1, 2)[:, None])
                            for part in _PARTS])
        stream = job.streams[layer].detach()
        with torch.enable_grad():
            repeated = stream.expand(normed.shape).contiguous().requires_grad_()  # faster than a stride-0 view
            (found,) = torch.autograd.grad(self.attn_norm[layer](repeated), repeated, normed)
        return found
