"""Initialisation scale and dead units: unhealthy layers are listed in a table and the
first one is named; healthy models pass; nothing is left attached."""

import pytest
import torch
from torch import nn

import funhooks as fh
from funhooks.testing import assert_no_hooks, check_dead_units, check_init_scale


def deep_relu(width: int = 100, depth: int = 4, *, kaiming: bool) -> nn.Sequential:
    """Linear-ReLU layers; PyTorch's default init shrinks the signal layer after layer."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    if kaiming:
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)
    return model


def test_init_scale_lists_the_layers_whose_signal_vanishes(device):
    """Default init: the std of the later linear layers falls below 0.5; the message names
    the first and tabulates all of them."""
    torch.manual_seed(0)
    model = deep_relu(kaiming=False).to(device)
    with pytest.raises(AssertionError) as info:
        check_init_scale(model, torch.randn(64, 100, device=device))
    lines = str(info.value).splitlines()
    assert lines[0].startswith(
        "check_init_scale: every layer's activation std at init is within [0.5, 2], got 3 layer(s) outside it, "
        "first '2' (Linear) with std 0.2"
    )
    assert lines[0].endswith(". Rescale its initialisation (e.g. `nn.init.kaiming_normal_` before a ReLU).")
    assert lines[1].split() == ["layer", "mean", "std"]
    assert [line.split()[0] for line in lines[2:5]] == ["'2'", "'4'", "'6'"]
    assert lines[5].startswith("input: tensor(")
    assert_no_hooks(model)


def test_init_scale_holds_with_kaiming_init(device):
    """Kaiming-normal weights and zero biases keep every layer's std near 1."""
    torch.manual_seed(0)
    model = deep_relu(kaiming=True).to(device)
    check_init_scale(model, torch.randn(64, 100, device=device))
    assert_no_hooks(model)


def test_init_scale_rejects_a_reversed_range():
    """`std_range` is (low, high) with 0 <= low <= high."""
    with pytest.raises(fh.SpecError) as info:
        check_init_scale(nn.Linear(2, 2), torch.randn(4, 2), std_range=(2, 0.5))
    assert str(info.value) == (
        "check_init_scale: `std_range` is `(low, high)` with 0 <= low <= high, got (2, 0.5). Pass e.g. `(0.5, 2.0)`."
    )


def test_dead_units_finds_a_relu_whose_bias_killed_it(device):
    """A bias of -100 keeps every unit of the ReLU at zero on every drawn input."""
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    with pytest.raises(AssertionError) as info:
        check_dead_units(model, torch.randn(8, 3, device=device))
    assert str(info.value).splitlines() == [
        (
            "check_dead_units: no layer has more than 50% of its units near zero (|a| <= 1e-06) on every drawn "
            "input, got 1 layer(s), first '1' (ReLU) with 16 of 16 units dead. Check its initialisation (a bias "
            "that keeps a ReLU negative) and what feeds it."
        ),
        "layer       dead units  share",
        "'1' (ReLU)  16/16       100%",
        "over 25 drawn inputs; no single input is a counterexample",
    ]
    assert_no_hooks(model)


def test_dead_units_tolerates_a_few_unless_told_not_to(device):
    """Four dead units of sixteen pass the default (at most half) but not `max_dead=0`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    with torch.no_grad():
        model[0].bias[:4] = -100.0
    check_dead_units(model, torch.randn(8, 3, device=device))
    with pytest.raises(AssertionError, match=r"first '1' \(ReLU\) with 4 of 16 units dead"):
        check_dead_units(model, torch.randn(8, 3, device=device), max_dead=0)


def test_dead_units_rejects_a_share_outside_0_1():
    """`max_dead` is a share."""
    with pytest.raises(fh.SpecError) as info:
        check_dead_units(nn.ReLU(), torch.randn(2, 2), max_dead=50)
    assert str(info.value) == "check_dead_units: `max_dead` is a share in [0, 1], got 50. Pass e.g. `0.5`."
