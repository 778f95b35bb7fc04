"""The full summary (torchinfo's ground): keyword inputs, a depth limit, input and output
shapes of every module, FLOPs and MACs, memory estimates; and agreement with torchinfo."""

from __future__ import annotations

import hypothesis
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import funhooks as fh
from funhooks.summary import Shape

torchinfo = pytest.importorskip("torchinfo")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 8, 2


def tiny_gpt2() -> nn.Module:
    """A 2-layer GPT-2 with tied input and output embeddings, random weights, no download."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def tiny_bert() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    return transformers.BertModel(cfg).eval()


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    return tiny_gpt2()


@pytest.fixture(scope="module")
def bert() -> nn.Module:
    return tiny_bert()


def hf_inputs() -> dict[str, torch.Tensor]:
    ids = torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) % VOCAB
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 4, 3, stride=2, padding=1, bias=False), nn.ReLU()),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 10),
    )


def torchinfo_layers(model: nn.Module, *args: object, **kwargs: object) -> dict[str, object]:
    """torchinfo's LayerInfo per module path (the last call of a module called twice)."""
    data = kwargs if kwargs else list(args)
    stats = torchinfo.summary(model, input_data=data, verbose=0, depth=100)
    paths = {id(m): p for p, m in reversed(list(model.named_modules()))}
    return stats, {paths[id(info.module)]: info for info in stats.summary_list}


def plain(shape: object) -> object:
    return list(shape) if isinstance(shape, tuple) else shape


# -- keyword inputs, layout, depth -----------------------------------------------------------------------


def test_keyword_inputs_of_a_hugging_face_model(bert: nn.Module) -> None:
    """`module_summary(bert, input_ids=..., attention_mask=...)` runs the model on keywords and
    prints the full layout, its header naming each keyword input."""
    s = fh.module_summary(bert, **hf_inputs())
    assert s.layout == "full" and s.input_shapes == ()
    assert s.kwarg_shapes == (("input_ids", (2, 8)), ("attention_mask", (2, 8)))
    text = str(s)
    assert text.splitlines()[0] == "BertModel (Input shape: ['input_ids: 2 x 8', 'attention_mask: 2 x 8'])"
    assert "  embeddings (BertEmbeddings)" in text and "word_embeddings (Embedding)" in text
    row = {r.path: r for r in s.layers}["embeddings.word_embeddings"]
    assert (row.input_shape, row.output_shape, row.params) == (((2, 8),), (2, 8, 16), VOCAB * 16)


def test_positional_call_keeps_fastais_layout() -> None:
    """Called as fastai's `module_summary(model, *xb)`, str() stays fastai's table; `layout=`
    picks either layout on any call."""
    x = torch.randn(2, 3, 8, 8)
    s = fh.module_summary(cnn(), x)
    assert s.layout == "fastai" and str(s).splitlines()[2].split() == ["Layer", "(type)", "Output", "Shape",
                                                                       "Param", "#", "Trainable"]
    full = fh.module_summary(cnn(), x, layout="full")
    assert str(full).splitlines()[2].split() == ["Layer", "(type)", "Input", "Shape", "Output", "Shape", "Param",
                                                 "#", "MACs", "FLOPs"]
    assert full.rows == s.rows


def test_depth_limits_the_layers() -> None:
    """`depth=1` lists the root and its children only; a row at the limit shows its whole
    subtree's parameters and MACs; the fastai rows and totals do not change."""
    x = torch.randn(2, 3, 8, 8)
    s = fh.module_summary(cnn(), x, depth=1)
    assert s.layout == "full"
    assert [(r.path, r.depth) for r in s.layers] == [("", 0), ("0", 1), ("1", 1), ("2", 1), ("3", 1)]
    assert [r.params for r in s.layers] == [1178, 224 + 16, 288, 0, 650]
    assert len(s.rows) == 7 and s.total == 1178
    lines = str(s).splitlines()
    assert lines[4].split() == ["Sequential", "[2,", "3,", "8,", "8]", "[2,", "10]", "--", "--", "--"]
    assert lines[5].split() == ["0", "(Sequential)", "[2,", "3,", "8,", "8]", "[2,", "8,", "8,", "8]", "240",
                                "27,648", "55,296"]
    assert [r.path for r in fh.module_summary(cnn(), x, depth=0).layers] == [""]


def test_full_table_text() -> None:
    """The full layout of a small MLP, every line: tree, shapes, own parameters, MACs and the
    memory estimates (MB = 10^6 bytes, float32)."""
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    m[2].requires_grad_(False)
    s = fh.module_summary(m, torch.randn(16, 4), layout="full")
    assert str(s) == FULL_TABLE
    assert (s.macs, s.flops, s.param_bytes, s.input_bytes, s.activation_bytes) == (
        16 * (4 * 8 + 8 * 2), 2 * 16 * (4 * 8 + 8 * 2), 4 * 58, 4 * 64, 4 * 16 * (8 + 8 + 2))


FULL_TABLE = """\
Sequential (Input shape: ['16 x 4'])
=====================================================================
Layer (type)   Input Shape   Output Shape   Param #   MACs   FLOPs
=====================================================================
Sequential     [16, 4]       [16, 2]        --        --     --
  0 (Linear)   [16, 4]       [16, 8]        40        512    1,024
  1 (ReLU)     [16, 8]       [16, 8]        --        --     --
  2 (Linear)   [16, 8]       [16, 2]        (18)      256    512
=====================================================================
Total params: 58
Total trainable params: 40
Total non-trainable params: 18
Total MACs: 768
Total FLOPs: 1,536
Input size (MB): 0.00
Params size (MB): 0.00
Forward/backward pass size (MB): 0.00
Estimated total size (MB): 0.00"""


def test_summary_data_is_plain(bert: nn.Module) -> None:
    """to_dict() carries the layers, FLOPs, MACs and memory estimates as JSON-ready data."""
    import json

    data = json.loads(json.dumps(fh.module_summary(bert, **hf_inputs(), depth=1).to_dict()))
    assert data["kwarg_shapes"] == {"input_ids": [2, 8], "attention_mask": [2, 8]}
    assert [r["path"] for r in data["layers"]] == ["", "embeddings", "encoder", "pooler"]
    assert data["layers"][1]["input_shape"] == [] and data["layers"][1]["output_shape"] == [2, 8, 16]
    assert data["macs"] * 2 == data["flops"] > 0 and data["param_bytes"] == 4 * data["total"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"depth": -1}, "module_summary: `depth` is None or an int >= 0, got -1. Pass depth=0 for the model alone."),
    ({"depth": 1.5}, "module_summary: `depth` is None or an int >= 0, got 1.5. Pass depth=0 for the model alone."),
    ({"layout": "rich"}, "module_summary: `layout` is 'fastai' or 'full' (or None: 'fastai' for positional inputs "
                         "alone), got 'rich'. Pick one of those."),
])
def test_bad_options_raise(kwargs: dict[str, object], message: str) -> None:
    """A bad `depth` or `layout` is refused before the model runs."""
    with pytest.raises(ValueError) as err:
        fh.module_summary(nn.Linear(2, 2), torch.randn(1, 2), **kwargs)
    assert str(err.value) == message


# -- FLOPs and memory ------------------------------------------------------------------------------------


def cpu_attention_counter() -> FlopCounterMode:
    """torch's counter, told by hand to count the CPU's fused attention kernel (what
    `scaled_dot_product_attention` runs on the CPU) as it counts the CUDA ones: it has no
    formula for it and counts 0."""
    aten = torch.ops.aten
    formula = torch.utils.flop_counter.sdpa_flop_count
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kwargs: formula(q, k, v)})


def test_flops_are_torch_flop_counters(gpt2: nn.Module) -> None:
    """Per-module and total FLOPs are those `torch.utils.flop_counter` counts on a real pass,
    attention included; MACs are half the FLOPs."""
    inputs = hf_inputs()
    s = fh.module_summary(gpt2, **inputs)
    with torch.no_grad(), cpu_attention_counter() as counter:
        gpt2(**inputs)
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    assert s.flops == counter.get_total_flops() > 0 and s.macs * 2 == s.flops
    layers = {r.path: r for r in s.layers}
    for path in ("transformer.h.0.attn.c_attn", "transformer.h.1.mlp", "lm_head", ""):
        name = "GPT2LMHeadModel" + ("." + path if path else "")
        assert layers[path].flops == counts[name], path
    assert layers["transformer.h.0.ln_1"].flops == 0


@pytest.mark.parametrize("mask", ["none", "ones", "padding"])
def test_attention_flops_are_counted_with_an_attention_mask(bert: nn.Module, mask: str) -> None:
    """Issue 36 item 10: BERT under SDPA counted 148,480 FLOPs without `attention_mask` and
    132,096 with an all-ones one (the pass with a mask ran the CPU's fused attention kernel,
    which torch's counter has no formula for). Every path counts attention: the totals equal
    torch's counter told about that kernel, and the attention's FLOPs by hand."""
    assert bert.config._attn_implementation == "sdpa"
    inputs = hf_inputs()
    if mask == "none":
        del inputs["attention_mask"]
    elif mask == "padding":
        inputs["attention_mask"][0, -3:] = 0
    s = fh.module_summary(bert, **inputs)
    with torch.no_grad(), cpu_attention_counter() as counter:
        bert(**inputs)
    assert s.flops == counter.get_total_flops() == 148_480
    heads, head_dim = 2, 8
    by_hand = 2 * (2 * BATCH * heads * SEQ * SEQ * head_dim)  # q @ k^T and p @ v, 2 FLOPs per multiply-add
    layers = {r.path: r for r in s.layers}
    projections = sum(layers[f"encoder.layer.0.attention.self.{n}"].flops for n in ("query", "key", "value"))
    assert layers["encoder.layer.0.attention.self"].flops == projections + by_hand


class _Wide(nn.Linear):
    """A Linear subclass whose forward runs its product twice: counted by its ops, not its class."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + super().forward(x)


class _Mixed(nn.Module):
    """Linears on 3-d, 2-d, 1-d and non-contiguous inputs, with and without bias, a subclass, one
    whose forward is set on the instance, norms, dropouts and activations between."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 5), nn.Linear(5, 6, bias=False), nn.Linear(6, 3)
        self.wide, self.odd = _Wide(6, 4), nn.Linear(6, 6)
        self.odd.forward = lambda x: nn.functional.linear(x @ self.odd.weight, self.odd.weight)  # type: ignore[method-assign]
        self.acts = nn.Sequential(nn.LayerNorm(6), nn.GELU(), nn.Dropout(0.1), nn.Tanh(), nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.acts(self.b(self.a(x)))
        h = h + self.b(self.a(h.transpose(0, 1)).transpose(0, 1))  # a non-contiguous input
        return (self.c(h).sum() + self.c(h[0, 0]).sum() + self.c(h[0]).sum() + self.wide(h).sum()
                + self.odd(h).sum())


def test_flops_per_module_equal_torch_counters_on_every_kind_of_linear_call() -> None:
    """A Linear's FLOPs come from its class where they follow from its input's shape (its call's
    ops not run through the counter one by one); per module they are what torch's counter
    counts op by op (a 1-d input too), a subclass's and an instance's own forward by their ops."""
    torch.manual_seed(0)
    model, x = _Mixed(), torch.randn(3, 4, 6)
    s = fh.module_summary(model, x, layout="full")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.eval()(x)
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    flops = {r.path: r.flops for r in s.layers}
    assert flops == {p: counts.get("_Mixed" + ("." + p if p else ""), 0) for p in flops}
    assert flops["c"] == 2 * (12 + 1 + 4) * 6 * 3 and flops["wide"] == 2 * 2 * 12 * 6 * 4
    assert flops["odd"] == 2 * 2 * 12 * 6 * 6 and flops["acts"] == 0 and s.flops == counter.get_total_flops()


def test_activation_memory_counts_every_call() -> None:
    """A module called twice adds both outputs to the activation estimate."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin(x))

    s = fh.module_summary(Twice(), torch.randn(5, 3), layout="full")
    assert s.activation_bytes == 2 * 5 * 3 * 4 and {r.path: r.calls for r in s.layers} == {"": 1, "lin": 2}
    assert {r.path: r.flops for r in s.layers} == {"": 2 * 2 * 5 * 9, "lin": 2 * 2 * 5 * 9}


# -- torchinfo agrees ------------------------------------------------------------------------------------


def test_agrees_with_torchinfo_on_a_cnn() -> None:
    """Parameters per module, totals and every module's input and output shapes equal torchinfo's."""
    m, x = cnn(), torch.randn(2, 3, 8, 8)
    m[1][0].requires_grad_(False)
    s = fh.module_summary(m, x, layout="full")
    stats, theirs = torchinfo_layers(m, x)
    assert (s.total, s.trainable) == (stats.total_params, stats.trainable_params)
    assert s.param_bytes == stats.total_param_bytes  # (its input size adds Python object overheads)
    for row in s.layers:
        info = theirs[row.path]
        assert (row.params, row.trainable) == (info.num_params, info.trainable_params), row.path
        assert plain(row.output_shape) == info.output_size, row.path
        assert plain(row.input_shape[0]) == info.input_size, row.path


def test_agrees_with_torchinfo_on_bert(bert: nn.Module) -> None:
    """On a Hugging Face BERT called with keywords: the same totals, per-module parameters and
    every tensor-valued output shape as torchinfo."""
    s = fh.module_summary(bert, **hf_inputs())
    stats, theirs = torchinfo_layers(bert, **hf_inputs())
    assert (s.total, s.trainable) == (stats.total_params, stats.trainable_params)
    compared = 0
    for row in s.layers:
        info = theirs.get(row.path)
        if info is None:  # a module torchinfo did not see called
            assert row.calls == 0, row.path
            continue
        assert row.params == info.num_params, row.path
        if isinstance(row.output_shape, Shape):
            assert plain(row.output_shape) == info.output_size, row.path
            compared += 1
    assert compared > 20


def test_tied_weights_counted_once_where_torchinfo_counts_twice(gpt2: nn.Module) -> None:
    """GPT-2 ties `lm_head.weight` to `wte.weight`: the total counts it once (the model's real
    size); torchinfo adds it twice. Each module's own count agrees with torchinfo's."""
    s = fh.module_summary(gpt2, **hf_inputs())
    stats, theirs = torchinfo_layers(gpt2, **hf_inputs())
    assert s.total == sum(p.numel() for p in gpt2.parameters())
    assert stats.total_params == s.total + VOCAB * 16  # torchinfo's double count
    assert s.param_bytes == 4 * s.total
    for row in s.layers:
        if row.path in theirs:
            assert row.params == theirs[row.path].num_params, row.path


@hypothesis.given(pair=fh.testing.models_and_inputs())
@hypothesis.settings(max_examples=15, deadline=None)
def test_layers_agree_with_fastai_rows_and_totals(pair: tuple[nn.Module, torch.Tensor]) -> None:
    """For any drawn model: each leaf's full row has the fastai row's output shape, the
    root row holds every parameter once, and no layer counts more FLOPs than the model."""
    model, x = pair
    s = fh.module_summary(model, x, layout="full")
    layers = {r.path: r for r in s.layers}
    for row in s.rows:
        assert layers[row.path].output_shape == row.shape
    assert layers[""].params == s.total and layers[""].flops == s.flops
    assert all(0 <= r.flops <= s.flops for r in s.layers)
    fh.testing.assert_no_hooks(model)


def test_bench_summary_smoke(tmp_path) -> None:
    """benchmarks/bench_summary.py runs (smoke mode): its checks (funhooks' total and FLOPs)
    pass before anything is timed, and torchinfo's numbers are recorded beside them."""
    from bench_kit import assert_common_keys, run_quick

    proc, result = run_quick("bench_summary.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert result is not None
    assert_common_keys(result, "summary")
    assert result["correct"] is True
    for name in ("BERT", "GPT-2"):
        cases = result["results"][name]["cases"]
        assert {"bare forward", "fh.module_summary", "torchinfo.summary"} <= set(cases)
    numbers = result["results"]["GPT-2"]["numbers"]
    assert numbers["torchinfo"]["total"] > numbers["fh"]["total"] == numbers["parameters"]  # the tied weight
