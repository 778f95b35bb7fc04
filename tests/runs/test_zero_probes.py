"""activation_grads: d loss / d module output via zero probes and torch.func, no backward hooks."""

import pytest
import torch
from hypothesis import given
from torch import nn

import funhooks as fh
from tests.runs.test_pure import mlps


def retained(model: nn.Module, modules: list[nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, list, list]:
    """Outputs and their retain_grad gradients, with plain autograd and per-module hooks."""
    outs: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.retain_grad()
        outs.append(out)

    handles = [m.register_forward_hook(keep) for m in modules]
    try:
        loss = model(x).square().sum()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return loss, outs, [o.grad for o in outs]


def without_inplace(model: nn.Sequential) -> nn.Sequential:
    """The same modules, with in-place ReLUs replaced (retain_grad needs that)."""
    return nn.Sequential(*[nn.ReLU() if isinstance(m, nn.ReLU) else m for m in model])


@given(mlps())
def test_activation_grads_equal_retain_grad(model_x: tuple[nn.Sequential, torch.Tensor]) -> None:
    """"output" and "grad" equal autograd's retain_grad values, in-place ops downstream included."""
    model, x = model_x
    f = fh.activation_grads(model, nn.Linear, lambda out: out.square().sum())
    loss, rec = f(x.clone())
    ref = without_inplace(model)
    ref_loss, outs, grads = retained(ref, list(dict.fromkeys(m for m in ref if isinstance(m, nn.Linear))), x.clone())
    calls = [(p, i) for p in rec for i in range(len(rec.calls(p, "grad")))]
    # per call in call order: map each Linear call of the reference to the record
    got_out = sorted((t for p in rec for t in rec.calls(p, "output")), key=lambda t: t.sum().item())
    got_grad = sorted((t for p in rec for t in rec.calls(p, "grad")), key=lambda t: t.sum().item())
    assert len(calls) == len(outs)
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    for a, b in zip(got_out, sorted((o.detach() for o in outs), key=lambda t: t.sum().item())):
        assert torch.allclose(a, b, atol=1e-5)
    for a, b in zip(got_grad, sorted(grads, key=lambda t: t.sum().item())):
        assert torch.allclose(a, b, atol=1e-4)
    fh.testing.assert_no_hooks(model)


def test_activation_grads_in_call_order_per_module(device: torch.device) -> None:
    """A module called twice gets two calls of "output" and "grad", equal to retain_grad's."""
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.ReLU(inplace=True)).to(device)
    x = torch.randn(2, 3, device=device)
    loss, rec = fh.activation_grads(model, "0", lambda out: out.square().sum())(x)
    _, outs, grads = retained(without_inplace(model), [shared], x)
    assert len(rec.calls("0", "grad")) == 2
    for got, want in zip(rec.calls("0", "grad"), grads):
        assert torch.allclose(got, want, atol=1e-6)


@given(mlps())
def test_vmap_gives_per_example_activation_grads(model_x: tuple[nn.Sequential, torch.Tensor]) -> None:
    """vmap(activation_grads(...)) equals calling it on each example alone (in float64: in
    float32 a LayerNorm over 3 features amplifies the batched kernels' rounding to ~1e-4)."""
    model, x = model_x[0].double(), model_x[1].double()
    f = fh.activation_grads(model, "**", lambda out: out.sum())
    loss, rec = torch.func.vmap(f)(x)
    for i in range(len(x)):
        li, ri = f(x[i].clone())
        assert torch.allclose(loss[i], li, atol=1e-5)
        assert rec.map(lambda t: t[i]).equal(ri, atol=1e-5, rtol=1e-5)
    fh.testing.assert_no_hooks(model)


def test_batch_norm_statistics_update_once() -> None:
    """The shape-finding pass runs on buffer copies: running stats move as in one plain call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    twin = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 3)
    fh.activation_grads(model, "0", lambda out: out.sum())(x)
    twin(x)
    for a, b in zip(model.buffers(), twin.buffers()):
        assert torch.equal(a, b)


def test_tuple_outputs_get_grads_per_floating_leaf() -> None:
    """A module returning a tuple gets a grad tuple; non-floating leaves get None."""
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x.argmax(-1)

    model = nn.Sequential(Split())
    loss, rec = fh.activation_grads(model, "0", lambda out: out[0].sum())(torch.ones(2, 3))
    grad = rec["0"]["grad"]
    assert torch.equal(grad[0], torch.ones(2, 3)) and grad[1] is None


def test_selector_matching_nothing_raises() -> None:
    """A selector matching no module raises SelectorError before anything runs."""
    with pytest.raises(fh.SelectorError):
        fh.activation_grads(nn.Sequential(nn.Linear(2, 2)), nn.Conv2d, lambda out: out.sum())
