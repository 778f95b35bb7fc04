"""`check_gradients_reach` on real architectures: no false positive from a mask drawn like
token ids or from a gradient that is zero on some draws only; seeded draws; a model with
nothing to check is refused (issue 26, items 15 and 16)."""

import pytest
import torch
from torch import nn

from funhooks.errors import SpecError
from funhooks.testing import assert_no_hooks, check_gradients_reach

VOCAB = 50


def token_ids(device: torch.device, length: int = 6) -> torch.Tensor:
    """Example ids; drawn ids span the example's range, so it holds 0 and the last id."""
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(0))
    ids[0, :2] = torch.tensor([0, VOCAB - 1])
    return ids.to(device)


def test_no_false_positive_on_a_bert_with_a_padding_mask(device):
    """A BERT built from a config (train mode, random weights) with a padding mask: the mask
    stays a mask (no row left with a single key, whose q/k gradients are exactly 0)."""
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    bert = transformers.BertModel(config).to(device)
    ids = token_ids(device, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    check_gradients_reach(bert, (ids, mask))
    assert torch.equal(ids, token_ids(device, 3)) and bert.training
    assert_no_hooks(bert)


def test_no_false_positive_on_gpt2(device):
    """A 2-layer GPT-2 language model with random weights, on token ids."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=VOCAB,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    check_gradients_reach(transformers.GPT2LMHeadModel(config).to(device), token_ids(device))


class PaddedEncoder(nn.Module):
    """``nn.TransformerEncoder`` called with a bool padding mask (True: padding)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=padding)


def test_no_false_positive_on_a_transformer_encoder_with_padding(device):
    """A bool padding mask stays the example's: drawn at random, it left every row one key
    in about one run of eight, and the attention's q/k projections a zero gradient."""
    torch.manual_seed(0)
    model = PaddedEncoder().to(device)
    padding = torch.tensor([[False, False, False, False], [False, False, True, True]], device=device)
    check_gradients_reach(model, (torch.randn(2, 4, 8, device=device), padding))


def test_no_false_positive_on_a_cnn(device):
    """Convolutions, batch norm, pooling and a linear head."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).to(device)
    check_gradients_reach(model, torch.randn(4, 3, 10, 10, device=device))


class Gated(nn.Module):
    """``relu(x[:, 0]) * linear(x)``: on a draw whose first feature is negative the linear
    layer's gradient is exactly 0, on the others it is not."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x[:, :1]) * self.linear(x)


def test_a_gradient_zero_on_some_draws_only_is_no_failure(device):
    """A zero gradient is judged across all draws, as `check_dead_units` judges units."""
    torch.manual_seed(0)
    check_gradients_reach(Gated().to(device), torch.randn(1, 3, device=device))


def test_a_gradient_zero_on_every_draw_fails_and_says_so(device):
    """A parameter multiplied by zero gets no gradient on any draw; the first draw explains it."""

    class Zeroed(Gated):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0 * self.linear(x).sum()

    with pytest.raises(AssertionError) as info:
        check_gradients_reach(nn.Sequential(Zeroed()).to(device), torch.randn(1, 3, device=device))
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "check_gradients_reach: every trainable parameter gets a finite, non-zero gradient, got a zero gradient for "
        "2 parameter(s) of '0.linear' (Linear), cut in module '0' (Zeroed). Look there for `.detach()`, "
        "`torch.no_grad()` or an output that is never used."
    )
    assert lines[2:5] == ["a zero gradient: '0.linear.weight'", "a zero gradient: '0.linear.bias'",
                          "the same on all 25 drawn inputs; the first one:"]
    assert lines[5].startswith("input: tensor(")


@pytest.mark.parametrize("model", [nn.Sequential(nn.ReLU(), nn.Flatten()), nn.Linear(3, 2).requires_grad_(False)],
                         ids=["parameterless", "frozen"])
def test_a_model_without_trainable_parameters_is_refused(model):
    """Nothing to check is an error, not a pass."""
    count = sum(p.numel() for p in model.parameters())
    with pytest.raises(SpecError) as info:
        check_gradients_reach(model, torch.randn(2, 3))
    assert str(info.value) == (
        "check_gradients_reach: the model has trainable parameters (`requires_grad=True`) to check, got "
        f"{type(model).__name__} with {len(list(model.parameters()))} parameter tensor(s) ({count} values), none "
        "trainable. Check a model with parameters, or make them trainable with `model.requires_grad_()`."
    )
    assert_no_hooks(model)
