"""Helpers shared by the run tests: small models, spec functions, and the checks that nothing
of funhooks is left on a model or in the process."""

from __future__ import annotations

import hypothesis
import pytest
import torch
import torch.nn.modules.module as module_hooks
from torch import nn

import funhooks as fh

FIXTURE_OK = hypothesis.settings(suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])

RECORDS_IN_COMPILE = pytest.mark.skipif(
    torch.__version__ < (2, 13),
    reason="recording traced into one compiled graph needs torch >= 2.13: older releases record with graph breaks "
           "or eagerly inside the compiled code (docs/field.md, torch versions)",
)
"""The mark of the tests that record inside a compiled graph (see docs/field.md, torch versions)."""


def make_model(device: torch.device | str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)


def deep_model(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(4, 4), nn.ReLU())]).to(device)


def raise_value_error(module: nn.Module, *args: object) -> None:
    raise ValueError("boom")


def output_mean(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.mean()


def forward_backward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def wrapped_paths(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if "forward" in m.__dict__]


GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_module_registration_hooks")


def assert_no_global_state() -> None:
    """Nothing of funhooks anywhere outside the models: no global module hook of any kind,
    no run entered in this context."""
    for name in GLOBAL_HOOKS:
        assert not getattr(module_hooks, name), name
    assert fh.runs._core.scope.active() == ()


def assert_no_global_hooks() -> None:
    """No global module hook of any kind (what would put every module call in the process on
    PyTorch's slower hooked path)."""
    for name in GLOBAL_HOOKS:
        assert not getattr(module_hooks, name), name


def assert_clean(model: nn.Module) -> None:
    """No hook on the model, no mark on it, nothing global left by these tests."""
    fh.testing.assert_no_hooks(model)
    assert_no_global_state()
    assert all(getattr(m, "_is_full_backward_hook", None) is None for m in model.modules())


PATCH_VOCAB, PATCH_LAYERS, PATCH_WIDTH, PATCH_POSITIONS = 40, 2, 16, 5
"""The small GPT-2 of the intervention tests, and the length of their prompts."""


def patching_gpt2(device: torch.device | str = "cpu", attn: str = "eager") -> nn.Module:
    """A seeded GPT-2 from a config (random weights, no download), for the intervention tests."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=PATCH_LAYERS, n_embd=PATCH_WIDTH, n_head=2, vocab_size=PATCH_VOCAB,
                                     n_positions=16, bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config).eval().to(device)


def patching_prompts(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A clean prompt and its corruption at position 2."""
    clean = torch.tensor([[1, 2, 3, 4, 5]], device=device)
    corrupt = clean.clone()
    corrupt[0, 2] = 9
    return clean, corrupt
