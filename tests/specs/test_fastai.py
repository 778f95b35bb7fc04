"""Every hook example of fastai's documentation (v2 `callback.hook`, v1 `callbacks.hooks`),
ported to funhooks.

The port is mechanical: a fastai hook registers itself, a funhooks spec is a value, so
``with Hook(m, f) as h:`` becomes ``with fh.with_hooks(m, fh.Hook(m, f)) as h:``, and
``h.stored`` is a list, one entry per hooked module (``[0]`` for a single module).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the seeds' spelling
from torch import nn

import funhooks as fh

# PyTorch's own note when a full backward hook fires on a module whose inputs need no grad,
# as in these seeds (fastai used the older `register_backward_hook`)
NO_INPUT_GRAD = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the seed example moves the model to CUDA")


def example_forward_hook(m: nn.Module, i: tuple, o: torch.Tensor) -> None:
    print(m, i, o)


def example_backward_hook(m: nn.Module, gi: tuple, go: tuple) -> None:
    print(m, gi, go)


# -- "What are hooks?" ---------------------------------------------------------------------


def test_intro_forward_hook_prints_module_input_output(device: torch.device, capsys: pytest.CaptureFixture) -> None:
    """Seed: a forward hook takes the layer, its input and its output."""
    tst_model = nn.Linear(5, 3).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.observe("", example_forward_hook)):
        y = tst_model(x)
    assert capsys.readouterr().out == f"{tst_model} ({x},) {y.detach()}\n"


@NO_INPUT_GRAD
def test_intro_backward_hook_prints_grads(device: torch.device, capsys: pytest.CaptureFixture) -> None:
    """Seed: a backward hook takes the layer, grad of the input and grad of the output."""
    tst_model = nn.Linear(5, 3).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.Hook(tst_model, example_backward_hook, is_forward=False)):
        y = tst_model(x)
        loss = y.pow(2).mean()
        loss.backward()
    out = capsys.readouterr().out
    assert out.startswith(f"{tst_model} (None,) ") and str(2 * y.detach() / y.numel())[:20] in out


# -- Hook ------------------------------------------------------------------------------------


def test_hook_stores_the_function_result(device: torch.device) -> None:
    """Seed: `hook = Hook(tst_model, lambda m,i,o: o); y = tst_model(x); test_eq(hook.stored, y)`."""
    tst_model = nn.Linear(5, 3).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.Hook(tst_model, lambda m, i, o: o)) as hook:
        y = tst_model(x)
    assert torch.equal(hook.stored[0], y)


def test_hook_removed_prints_nothing(device: torch.device, capsys: pytest.CaptureFixture) -> None:
    """Seed: the hook prints while registered and nothing once `hook.remove()`d (block exit)."""
    tst_model = nn.Linear(5, 10).to(device)
    x = torch.randn(4, 5, device=device)
    y = tst_model(x)
    with fh.with_hooks(tst_model, fh.Hook(tst_model, example_forward_hook)):
        tst_model(x)
        assert capsys.readouterr().out == f"{tst_model} ({x},) {y.detach()}\n"
    tst_model(x)
    assert capsys.readouterr().out == ""


def test_hook_as_context_manager(device: torch.device, capsys: pytest.CaptureFixture) -> None:
    """Seed: `with Hook(tst_model, example_forward_hook) as h:` prints inside, not after."""
    tst_model = nn.Linear(5, 10).to(device)
    x = torch.randn(4, 5, device=device)
    y = tst_model(x)
    with fh.with_hooks(tst_model, fh.Hook(tst_model, example_forward_hook)) as h:
        tst_model(x)
        assert capsys.readouterr().out == f"{tst_model} ({x},) {y.detach()}\n"
    tst_model(x)
    assert capsys.readouterr().out == ""
    assert h.stored == [None]  # print returns None, as in fastai


# -- hook_output ----------------------------------------------------------------------------------


def test_hook_output_stores_detached_output(device: torch.device) -> None:
    """Seed: `with hook_output(tst_model) as h:` stores y, without grad."""
    tst_model = nn.Linear(5, 10).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.hook_output(tst_model)) as h:
        y = tst_model(x)
        assert torch.equal(y, h.stored[0])
        assert not h.stored[0].requires_grad


def test_hook_output_grad_stores_grad_output(device: torch.device) -> None:
    """Seed: with `grad=True`, `h.stored[0]` is fastai's grad_output tuple: its [0] is 2y/n."""
    tst_model = nn.Linear(5, 10).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.hook_output(tst_model, grad=True)) as h:
        y = tst_model(x)
        loss = y.pow(2).mean()
        loss.backward()
        torch.testing.assert_close(2 * y / y.numel(), h.stored[0][0])
    assert isinstance(h.stored[0], tuple)


@CUDA
def test_hook_output_cpu_from_cuda() -> None:
    """Seed: `hook_output(tst_model, cpu=True)` on a CUDA model stores on the CPU."""
    tst_model = nn.Linear(5, 10)
    x = torch.randn(4, 5)
    with fh.with_hooks(tst_model, fh.hook_output(tst_model, cpu=True)) as h:
        tst_model.cuda()(x.cuda())
        assert h.stored[0].device == torch.device("cpu")


def test_with_hook_output_directly_says_how_to_run_it() -> None:
    """fastai's `with hook_output(m) as h:` gives a TypeError telling how to run the spec."""
    tst_model = nn.Linear(5, 10)
    with pytest.raises(TypeError) as err:
        with fh.hook_output(tst_model):
            pass  # pragma: no cover
    assert str(err.value) == (
        "hook_output: a spec is a value and touches no model, got `with hook_output(<Linear instance>):`. "
        "Run it with `with fh.with_hooks(model, spec) as run:` and read `run.stored` or `run.record`."
    )
    fh.testing.assert_no_hooks(tst_model)


# -- Hooks --------------------------------------------------------------------------------------


def test_hooks_on_a_sequential(device: torch.device) -> None:
    """Seed: `Hooks(tst_model, lambda m,i,o: o)` stores each layer's output."""
    layers = [nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3)]
    tst_model = nn.Sequential(*layers).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.Hooks(tst_model, lambda m, i, o: o)) as hooks:
        y = tst_model(x)
    assert torch.equal(hooks.stored[0], layers[0](x))
    assert torch.equal(hooks.stored[1], F.relu(layers[0](x)))
    assert torch.equal(hooks.stored[2], y)


def test_hooks_as_context_manager(device: torch.device) -> None:
    """Seed: `with Hooks(layers, lambda m,i,o: o) as h:` on a list of the layers."""
    layers = [nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3)]
    tst_model = nn.Sequential(*layers).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.Hooks(layers, lambda m, i, o: o)) as h:
        y = tst_model(x)
        assert torch.equal(h.stored[0], layers[0](x))
        assert torch.equal(h.stored[1], F.relu(layers[0](x)))
        assert torch.equal(h.stored[2], y)


def test_hooks_stored_follows_the_order_of_ms(device: torch.device) -> None:
    """v1: Hooks acts as a collection in the order of `ms`; `stored` follows it."""
    layers = [nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3)]
    tst_model = nn.Sequential(*layers).to(device)
    with fh.with_hooks(tst_model, fh.Hooks(layers[::-1], lambda m, i, o: o.shape)) as h:
        tst_model(torch.randn(4, 5, device=device))
    assert h.stored == [torch.Size([4, 3]), torch.Size([4, 10]), torch.Size([4, 10])]


# -- hook_outputs -------------------------------------------------------------------------------


def test_hook_outputs_stores_every_output(device: torch.device) -> None:
    """Seed: `with hook_outputs(layers) as h:` stores each output, none requiring grad."""
    layers = [nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3)]
    tst_model = nn.Sequential(*layers).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.hook_outputs(layers)) as h:
        y = tst_model(x)
        assert torch.equal(h.stored[0], layers[0](x))
        assert torch.equal(h.stored[1], F.relu(layers[0](x)))
        assert torch.equal(h.stored[2], y)
        for s in h.stored:
            assert not s.requires_grad


def test_hook_outputs_grad_chain(device: torch.device) -> None:
    """Seed: with `grad=True` the stored grad_outputs follow the chain rule back."""
    layers = [nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3)]
    tst_model = nn.Sequential(*layers).to(device)
    x = torch.randn(4, 5, device=device)
    with fh.with_hooks(tst_model, fh.hook_outputs(layers, grad=True)) as h:
        y = tst_model(x)
        loss = y.pow(2).mean()
        loss.backward()
        g = 2 * y / y.numel()
        torch.testing.assert_close(g, h.stored[2][0])
        g = g @ layers[2].weight.data
        torch.testing.assert_close(g, h.stored[1][0])
        g = g * (layers[0](x) > 0).float()
        torch.testing.assert_close(g, h.stored[0][0])


@CUDA
def test_hook_outputs_cpu_from_cuda() -> None:
    """Seed: `hook_outputs(tst_model, cpu=True)` on a CUDA model stores on the CPU."""
    layers = [nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3)]
    tst_model = nn.Sequential(*layers)
    x = torch.randn(4, 5)
    with fh.with_hooks(tst_model, fh.hook_outputs(tst_model, cpu=True)) as h:
        tst_model.cuda()(x.cuda())
        for s in h.stored:
            assert s.device == torch.device("cpu")


def test_model_sizes_through_hook_outputs(device: torch.device) -> None:
    """v1: `model_sizes` is `[o.stored.shape for o in hook_outputs(m)]` after a dummy call."""
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, stride=2, padding=1)).to(device)
    with fh.with_hooks(m, fh.hook_outputs(m)) as hooks:
        m(torch.zeros(1, 3, 64, 64, device=device))
    assert [s.shape for s in hooks.stored] == [torch.Size([1, 16, 64, 64]), torch.Size([1, 32, 32, 32])]


# -- HookCallback's examples, as a plain loop (fh.HookCallback is the fold) --------------------


def synth_batches(device: torch.device, n: int = 5, bs: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(n, 1, device=device)
    y = 2 * x + 3 + 0.1 * torch.randn(n, 1, device=device)
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, n, bs)]


def test_hookcallback_forward_example(device: torch.device) -> None:
    """Seed: a forward `hook(m, i, o) -> o` on the model stores the prediction each batch."""
    model = nn.Linear(1, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fh.with_hooks(model, fh.Hooks([model], lambda m, i, o: o)) as hooks:
        for xb, yb in synth_batches(device):
            pred = model(xb)
            assert torch.equal(hooks.stored[0], pred)
            F.mse_loss(pred, yb).backward()
            opt.step()
            opt.zero_grad()
    fh.testing.assert_no_hooks(model)


@NO_INPUT_GRAD
def test_hookcallback_backward_example(device: torch.device) -> None:
    """Seed: a backward hook's `o` is grad_output: for MSE, `2 * (pred - y) / bs`."""
    model = nn.Linear(1, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fh.with_hooks(model, fh.Hooks([model], lambda m, i, o: o, is_forward=False)) as hooks:
        for xb, yb in synth_batches(device):
            pred = model(xb)
            F.mse_loss(pred, yb).backward()
            torch.testing.assert_close(hooks.stored[0][0], 2 * (pred.detach() - yb) / pred.shape[0])
            opt.step()
            opt.zero_grad()
    fh.testing.assert_no_hooks(model)


# -- ActivationStats' example ----------------------------------------------------------------------


class RegModel(nn.Module):
    """fastai's synth_learner model: `x * a + b`, a leaf module with two parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(1)), nn.Parameter(torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


def test_activation_stats_example_equals_the_hook_values_exactly(device: torch.device) -> None:
    """Seed: `synth_learner(n_trn=5, cbs=ActivationStats(every=4))` records iterations 0 and 4, one
    dict per module; fastai's tests compare its numbers with `pred.mean()` / `pred.std()` by ==."""
    torch.manual_seed(0)
    model = RegModel().to(device)
    x = torch.randn(5 * 16, 1, device=device)
    batches = [(x[i:i + 16], 2 * x[i:i + 16] + 3 + 0.1 * torch.randn(16, 1, device=device)) for i in range(0, 80, 16)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    stats, preds = fh.fit(model, batches, F.mse_loss, opt,
                          [fh.ActivationStats(every=4), fh.HookCallback(lambda m, i, o: o, every=4, cpu=False)])
    assert stats.iterations == (0, 4) and stats.paths == ("",)
    for (s,), (pred,) in zip(stats.stats, preds):
        assert s == {"mean": pred.float().mean().item(), "std": pred.float().std().item(),
                     "near_zero": (pred <= 0.05).long().sum().item() / pred.numel()}
