"""Step: a frozen value and a registered pytree (issue 13)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.utils._pytree as pytree

import funhooks as fh


def _step(**metrics: torch.Tensor) -> fh.Step:
    record = fh.Record({"fc": {"output": (torch.ones(2, 3),)}})
    return fh.Step(epoch=1, iteration=7, loss=torch.tensor(0.25), record=record, training=True, metrics=metrics)


def test_step_is_a_pytree_of_its_tensors() -> None:
    """tree_leaves sees the loss, the record's values and the metrics; tree_map keeps the rest."""
    step = _step(acc=torch.tensor(0.5))
    assert [t.shape for t in pytree.tree_leaves(step)] == [(), (2, 3), ()]
    doubled = pytree.tree_map(lambda t: t * 2, step)
    assert isinstance(doubled, fh.Step) and (doubled.epoch, doubled.iteration, doubled.training) == (1, 7, True)
    assert float(doubled.loss) == 0.5 and float(doubled.metrics["acc"]) == 1.0
    assert torch.equal(doubled.record["fc"]["output"], torch.full((2, 3), 2.0))


def test_step_key_paths_read_like_attribute_access() -> None:
    """Key paths name `.loss`, `.record.calls(...)` and `.metrics[...]`."""
    paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(_step(acc=torch.tensor(1.0)))[0]]
    assert paths == [".loss", ".record.calls('fc', 'output')[0]", ".metrics['acc']"]


def test_torch_func_transforms_return_steps() -> None:
    """A function returning a Step composes with torch.func.vmap: its tensors come back batched."""

    def f(x: torch.Tensor) -> fh.Step:
        record = fh.Record({"": {"output": (x * 2,)}})
        return fh.Step(epoch=0, iteration=0, loss=x.sum(), record=record, training=False)

    out = torch.func.vmap(f)(torch.ones(4, 3))
    assert out.loss.shape == (4,) and out.record[""]["output"].shape == (4, 3)


def test_step_with_metrics_pickles_and_stays_read_only() -> None:
    """Metrics are a read-only mapping; a Step pickles and loads equal."""
    step = _step(acc=torch.tensor(0.5))
    with pytest.raises(TypeError):
        step.metrics["acc"] = torch.tensor(1.0)  # type: ignore[index]
    back = pickle.loads(pickle.dumps(step))
    assert float(back.metrics["acc"]) == 0.5 and back.record.equal(step.record) and back.iteration == 7
    assert dict(fh.Step(epoch=0, iteration=0, loss=None, record=fh.Record(), training=True).metrics) == {}
