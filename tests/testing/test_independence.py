"""Batch independence and causality: broken models fail, shrink and blame the right module;
correct ones (a small Hugging Face GPT-2 included) pass; no hook or state change is left."""

import hypothesis
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import funhooks as fh
from funhooks.testing import assert_no_hooks, check_batch_independence, check_causality

# derandomized, so the exact shrunk input in a message is stable
SHRINK = hypothesis.settings(max_examples=25, deadline=None, database=None, derandomize=True)
BATCH_RULE = "check_batch_independence: the output for one example depends only on that example, got module "
BATCH_FIX = " first breaking it. Look for a reshape or transpose across the batch dimension, or statistics over the batch."
CAUSAL_RULE = "check_causality: the output at position t along dim 1 depends only on inputs at positions <= t, got module "
CAUSAL_FIX = " first breaking it. Mask the future: a causal attention mask, left-only padding."
VOCAB = 50


class MixBatch(nn.Module):
    """A deliberately broken layer: a reshape where a transpose was meant mixes the examples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[1], x.shape[0]).t()


class Attention(nn.Module):
    """A single-head self-attention block over ``(batch, time, features)``."""

    def __init__(self, width: int, causal: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.causal = nn.Linear(width, 3 * width), nn.Linear(width, width), causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal))


def language_model(causal: bool) -> nn.Module:
    return nn.Sequential(nn.Linear(2, 8), nn.Sequential(Attention(8, causal), nn.ReLU()), nn.Linear(8, 2))


def message(info: pytest.ExceptionInfo) -> list[str]:
    return str(info.value).splitlines()


def test_batch_independence_blames_a_reshape_that_mixes_the_batch(device):
    """The shrunk counterexample is an all-zero batch with one element of example 0 set,
    and the blame falls on the reshaping layer, not on its container or the next layer."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Tanh(), MixBatch()), nn.Linear(3, 2)).to(device)
    with pytest.raises(AssertionError) as info:
        check_batch_independence(model, torch.randn(4, 3, device=device), settings=SHRINK)
    lines = message(info)
    assert lines[0] == BATCH_RULE + "'1.1' (MixBatch)" + BATCH_FIX
    drawn = torch.zeros(4, 3, device=device)
    assert lines[1] == f"input: {drawn!r}".splitlines()[0]
    assert lines[-1] == f"example 0 changed to: {torch.tensor([0.0, 0.0, 1.0], device=device)!r}"
    assert_no_hooks(model)


def test_batch_independence_holds_for_a_per_example_model(device):
    """Linear layers and activations treat every example alone."""
    model = nn.Sequential(nn.Linear(3, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2)).to(device)
    check_batch_independence(model, torch.randn(4, 3, device=device))
    assert_no_hooks(model)


def test_batch_independence_blames_batch_norm_in_training_mode_and_restores_its_statistics(device):
    """Batch norm in training mode mixes the examples through its batch statistics; in eval
    mode it does not; the running statistics are as before after the check."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)).to(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AssertionError) as info:
        check_batch_independence(model, torch.randn(4, 3, device=device))
    assert message(info)[0] == BATCH_RULE + "'1' (BatchNorm1d)" + BATCH_FIX
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    check_batch_independence(model.eval(), torch.randn(4, 3, device=device))
    assert_no_hooks(model)


def test_batch_independence_needs_two_examples():
    """A batch of one has no other example to compare: a SpecError says so."""
    with pytest.raises(fh.SpecError) as info:
        check_batch_independence(nn.Linear(2, 2), torch.randn(1, 2))
    assert str(info.value) == (
        "check_batch_independence: the inputs have at least 2 examples along dim 0, got shapes [(1, 2)]. "
        "Draw larger inputs."
    )


def test_checks_take_a_strategy_or_example_tensors():
    """Anything else as `inputs` is a SpecError naming what was given."""
    with pytest.raises(fh.SpecError) as info:
        check_causality(nn.Linear(2, 2), [[1.0, 2.0]])
    assert str(info.value) == (
        "check_causality: `inputs` is a Hypothesis strategy or an example tensor (or a tuple of them), "
        "got list. Pass an example such as `torch.randn(4, 3)`."
    )


def test_causality_blames_an_attention_block_without_its_mask(device):
    """Attention without a causal mask reads ahead; position 0 changes when positions 1..
    do, and the attention block (not the block around it) is blamed."""
    torch.manual_seed(0)
    model = language_model(causal=False).to(device)
    with pytest.raises(AssertionError) as info:
        check_causality(model, torch.randn(2, 3, 2, device=device), settings=SHRINK)
    lines = message(info)
    assert lines[0] == CAUSAL_RULE + "'1.0' (Attention)" + CAUSAL_FIX
    assert lines[-1] == "the output at positions 0..0 changed"
    assert_no_hooks(model)


def test_causality_holds_for_masked_attention(device):
    """The same block with its causal mask passes."""
    torch.manual_seed(0)
    model = language_model(causal=True).to(device)
    check_causality(model, torch.randn(2, 5, 2, device=device))
    assert_no_hooks(model)


def test_causality_along_the_last_dim_of_a_convolution(device):
    """Padding only the past keeps a convolution causal; symmetric padding reads one step ahead."""
    causal = nn.Sequential(nn.ConstantPad1d((2, 0), 0.0), nn.Conv1d(2, 2, kernel_size=3)).to(device)
    check_causality(causal, torch.randn(1, 2, 6, device=device), dim=-1)
    leaky = nn.Sequential(nn.Conv1d(2, 2, kernel_size=3, padding=1), nn.ReLU()).to(device)
    with pytest.raises(AssertionError) as info:
        check_causality(leaky, torch.randn(1, 2, 6, device=device), dim=-1)
    assert message(info)[0] == (
        "check_causality: the output at position t along dim -1 depends only on inputs at positions <= t, "
        "got module '0' (Conv1d)" + CAUSAL_FIX
    )


# -- a Hugging Face model -------------------------------------------------------------------


def gpt2(device: torch.device) -> nn.Module:
    """A 2-layer GPT-2 with random weights (no download), in eval mode."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=VOCAB,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(device).eval()


def token_ids(device: torch.device) -> torch.Tensor:
    """Example ids; drawn ids span the example's range, so it holds 0 and the last id."""
    ids = torch.randint(0, VOCAB, (2, 6))
    ids[0, :2] = torch.tensor([0, VOCAB - 1])
    return ids.to(device)


def test_gpt2_is_causal_and_batch_independent(device):
    """A Hugging Face GPT-2 built from a small config passes both checks on token ids."""
    model = gpt2(device)
    check_causality(model, token_ids(device))
    check_batch_independence(model, token_ids(device))
    assert_no_hooks(model)


def test_gpt2_without_its_causal_mask_fails_causality_in_the_first_attention(device):
    """``config.is_causal = False`` makes transformers build a bidirectional mask (see
    ``masking_utils.create_causal_mask``); the first attention layer is blamed and the
    counterexample shrinks to all-zero ids."""
    model = gpt2(device)
    model.config.is_causal = False
    with pytest.raises(AssertionError) as info:
        check_causality(model, token_ids(device), settings=SHRINK)
    lines = message(info)
    assert lines[0] == CAUSAL_RULE + "'transformer.h.0.attn' (GPT2Attention)" + CAUSAL_FIX
    assert lines[1] == "input: " + repr(torch.zeros(2, 6, dtype=torch.long, device=device)).splitlines()[0]
    assert_no_hooks(model)
