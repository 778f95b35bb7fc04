"""Hook points inside a forward (issue 14): record and edit the torch ops a selected module
calls, on unmodified models (HF GPT-2 and BERT attention, the residual adds of a block), in
the same Record; every spelling of an op matches; unselected modules pay nothing; an op
selector that matches nothing says which ops were called."""

from __future__ import annotations

import hypothesis
import pytest
import torch
from helpers import RECORDS_IN_COMPILE
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import funhooks as fh

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ATTN = "transformer.h.*.attn"


def _gpt2(device: torch.device | str = "cpu", attn: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config).eval().to(device)


def _bert(attn: str) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                     vocab_size=40, max_position_embeddings=16, attn_implementation=attn)
    return transformers.BertModel(config).eval()


TOKENS = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])


def test_the_attention_pattern_is_the_softmax_inside_gpt2_attention(device: torch.device) -> None:
    """`op_outputs(attn, "softmax")` on an unmodified HF GPT-2 records each layer's attention
    pattern under the attention module's path: what `output_attentions=True` returns."""
    model = _gpt2(device)
    x = TOKENS.to(device)
    with torch.no_grad(), fh.with_hooks(model, fh.op_outputs(ATTN, "softmax")) as run:
        out = model(x, output_attentions=True)
    rec = run.record
    assert list(rec) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    for layer, expected in enumerate(out.attentions):
        assert torch.equal(rec[f"transformer.h.{layer}.attn"]["softmax"], expected)
    fh.testing.assert_no_hooks(model, funhooks_only=True)  # `output_attentions` leaves transformers' own hooks


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_q_k_v_are_the_inputs_of_sdpa_and_the_pattern_comes_back_under_vmap(family: str) -> None:
    """With SDPA attention, `op_inputs` of `scaled_dot_product_attention` gives q, k, v
    (per head); with eager attention the pattern, also per example under `vmap`."""
    model = _gpt2(attn="sdpa") if family == "gpt2" else _bert("sdpa")
    where = ATTN if family == "gpt2" else "encoder.layer.*.attention.self"
    first = where.replace("*", "0")
    inputs = fh.op_inputs(where, "scaled_dot_product_attention")
    with torch.no_grad():
        _, rec = fh.capture(model, [inputs, fh.inputs(first)])(TOKENS)
    q, k, v = rec[first]["scaled_dot_product_attention.input"]
    hidden = rec[first]["input"][0][0] if rec[first]["input"][0] else rec[first]["input"][1]["hidden_states"]
    attn = model.get_submodule(first)
    if family == "gpt2":
        expected = attn.c_attn(hidden).split(16, dim=2)
    else:
        expected = (attn.query(hidden), attn.key(hidden), attn.value(hidden))
    for got, want in zip((q, k, v), expected):
        assert torch.allclose(got, want.view(2, 5, 2, 8).transpose(1, 2), atol=1e-6)
    eager = _gpt2() if family == "gpt2" else _bert("eager")
    f = fh.capture(eager, fh.op_outputs(where, "softmax"))
    with torch.no_grad():
        _, batched = torch.func.vmap(lambda t: f(t[None], use_cache=False) if family == "gpt2" else f(t[None]))(TOKENS)
        _, single = f(TOKENS[1:])
    assert torch.allclose(batched[first]["softmax"][1], single[first]["softmax"], atol=1e-6)


def test_the_residual_stream_after_each_add_of_a_block() -> None:
    """A GPT-2 block's own code makes two adds (attention, then MLP, onto the residual);
    the adds inside its submodules (GELU, masks) are theirs, not the block's."""
    model = _gpt2()
    specs = [fh.op_outputs("transformer.h.*", "add"), fh.inputs("transformer.h.*"), fh.outputs("transformer.h.*"),
             fh.outputs("transformer.h.*.attn")]
    with torch.no_grad(), fh.with_hooks(model, specs) as run:
        model(TOKENS)
    rec = run.record
    after_attn, after_mlp = rec.calls("transformer.h.0", "add")
    residual = rec["transformer.h.0"]["input"][0][0]
    assert torch.equal(after_attn, rec["transformer.h.0.attn"]["output"][0] + residual)
    assert torch.equal(after_mlp, rec["transformer.h.0"]["output"])
    deep = fh.op_outputs("transformer.h.0", fh.op("add", deep=True))
    with torch.no_grad(), fh.with_hooks(model, deep) as run:
        model(TOKENS)
    assert len(run.record.calls("transformer.h.0", "add")) > 2


@hypothesis.given(fh.testing.models_and_inputs())
def test_op_recordings_are_transparent_and_equal_what_the_module_returns(model_and_input: tuple) -> None:
    """Property: on any model, recording the one op a `Linear` / `Conv2d` calls changes no
    output and no gradient, and stores exactly what the module returns, call by call."""
    model, x = model_and_input
    kind, op = (nn.Linear, "linear") if x.ndim == 2 else (nn.Conv2d, "conv2d")
    hypothesis.assume(any(isinstance(m, kind) for m in model.modules()))
    fh.testing.assert_transparent(model, fh.op_outputs(kind, op), x)
    with fh.with_hooks(model, [fh.op_outputs(kind, op, clone=True), fh.outputs(kind, clone=True)]) as run:
        model(x)
    for node in run.record.values():
        assert all(torch.equal(a, b) for a, b in zip(node.calls(op), node.calls("output"), strict=True))


def test_every_spelling_of_an_op_matches_and_call_picks_one() -> None:
    """`torch.add`, `Tensor.add`, `a + b` and `1 + a` are all `add` (`a += b` is `add_`);
    `fh.op(name, call=k)` takes the k-th call in each module call."""

    class Adds(nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            b = torch.add(a, 1)
            c = b.add(1)
            d = c + 1
            e = 1 + d
            e += 1
            return e

    model = Adds()
    specs = [fh.op_outputs("", torch.add, clone=True), fh.op_outputs("", "add_"),  # `e += 1` changes e in place
             fh.op_outputs("", fh.op("add", call=2), name="third")]
    with fh.with_hooks(model, specs) as run:
        model(torch.zeros(2))
    rec = run.record[""]
    assert [t[0].item() for t in rec.calls("add")] == [1.0, 2.0, 3.0, 4.0]
    assert rec["add_"][0].item() == 5.0 and rec["third"][0].item() == 3.0


def test_op_editors_change_what_the_module_computes_and_recordings_see_the_edit() -> None:
    """`op_edit` and interventions with `op=` replace an op's result; the rest of the forward
    computes with it, and an op recording of the same call sees the edited value (the
    documented rule), in `with_hooks`, `capture` and under `vmap`."""
    model = _gpt2()
    uniform = fh.op_edit(ATTN, "softmax", lambda m, args, kwargs, out: torch.tril(torch.ones_like(out)) /
                         torch.tril(torch.ones_like(out)).sum(-1, keepdim=True))
    record = fh.op_outputs(ATTN, "softmax")
    with torch.no_grad():
        with fh.with_hooks(model, [record, uniform]) as run:
            edited = model(TOKENS)
        plain = model(TOKENS)
    pattern = run.record.calls("transformer.h.1.attn", "softmax")[0]
    assert torch.allclose(pattern[0, 0, 2], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0, 0]))
    assert not torch.equal(edited.logits, plain.logits)
    f = fh.capture(model, [record, fh.ablate(ATTN, op="softmax", index=fh.arg("q"), dim=2)])
    with torch.no_grad():
        _, rec = torch.func.vmap(lambda q: f(TOKENS, q=q, use_cache=False))(torch.arange(3))
    assert (rec["transformer.h.0.attn"]["softmax"][1, :, :, 1] == 0).all()
    assert (rec["transformer.h.0.attn"]["softmax"][1, :, :, 2] != 0).any()


def test_unselected_modules_run_outside_any_op_mode() -> None:
    """Only the selected module's own call runs inside the op mode: before, after and in
    other modules no mode is active and nothing is wrapped."""
    depth: dict[str, int] = {}

    class Probe(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            depth[self.name] = len(_get_current_function_mode_stack())
            return torch.relu(x)

    model = nn.Sequential(Probe("before"), nn.Sequential(Probe("inside")), Probe("after"))
    with fh.with_hooks(model, fh.op_outputs("1", fh.op("relu", deep=True))) as run:
        model(torch.randn(2))
    assert depth == {"before": 0, "inside": 1, "after": 0}
    assert "forward" not in model[0].__dict__ and "forward" not in model[2].__dict__
    assert list(run.record) == ["1"]


def test_an_op_selector_that_matches_nothing_lists_the_ops_called() -> None:
    """An op the module never calls, one only its submodules call, and a `call` index past
    the calls: one line each naming the spec, the module and the fix; nothing left attached."""
    model = _gpt2()
    cases = [
        (fh.op_outputs(ATTN, "relu"),
         ("with_hooks: an op spec matches an op called by the module it selects, got no call of `relu` in module "
          "'transformer.h.0.attn' (GPT2Attention) for op_outputs('transformer.h.*.attn', 'relu'). Pick one of the ops "
          "called while it ran, ['add', 'addmm', 'cat', 'contiguous', 'dropout', 'matmul', 'mul', 'reshape', 'size', "
          "'softmax', 'split', 'tensor', 'transpose', 'type', 'view'], or select the module that calls it.")),
        (fh.op_outputs("transformer.h.*", "softmax"),
         ("with_hooks: an op spec matches an op called by the module it selects, got no call of `softmax` in module "
          "'transformer.h.0' (GPT2Block) for op_outputs('transformer.h.*', 'softmax'). 1 call of it ran inside its "
          "submodules: select the submodule, or pass `fh.op('softmax', deep=True)` to count those.")),
        (fh.op_outputs(ATTN, fh.op("matmul", call=2)),
         ("with_hooks: an op spec matches an op called by the module it selects, got 2 calls of `matmul` where the "
          "spec takes call 2 in module 'transformer.h.0.attn' (GPT2Attention) for op_outputs('transformer.h.*.attn', "
          "fh.op('matmul', call=2)). Pick a `call` index below 2.")),
    ]
    for spec, message in cases:
        with pytest.raises(fh.SelectorError) as err, torch.no_grad(), fh.with_hooks(model, spec):
            model(TOKENS)
        assert str(err.value) == message
        fh.testing.assert_no_hooks(model)


@RECORDS_IN_COMPILE
def test_op_specs_compile_when_deep_and_say_why_not_otherwise() -> None:
    """Inside `torch.compile`, frames cannot be walked: `deep=True` op specs trace into one
    graph and record what eager does; others raise a TransformError saying so."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.q(x) @ x.transpose(-1, -2), -1) @ x

    model = nn.Sequential(Attention(), nn.Linear(4, 2))
    x = torch.randn(2, 3, 4)
    f = fh.capture(model, [fh.op_outputs("0", fh.op("softmax", deep=True)), fh.scale("1", fh.arg("k"))])
    out, rec = f(x, k=2.0)
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    c_out, c_rec = compiled(x, k=2.0)
    assert torch.allclose(c_out, out) and c_rec.equal(rec)
    with pytest.raises(fh.TransformError) as err:
        torch.compile(fh.capture(model, fh.op_outputs("0", "softmax")), backend="eager")(x)
    assert str(err.value) == (
        "capture: inside `torch.compile`d code an op spec also takes its module's submodules' ops, as frames cannot "
        "be walked there, got op_outputs('0', 'softmax', clone=True) on module '0'. Pass "
        "`fh.op('softmax', deep=True)`, or run it eagerly."
    )


def test_nested_runs_share_one_op_call_and_the_editor_rule_holds_across_them() -> None:
    """An outer run recording an op and an inner run editing it: the outer recording sees
    the inner edit (one rule however runs are nested); under checkpointing the
    recomputation in backward stores nothing again."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 3, requires_grad=True)
    zero = fh.op_edit("block", "tanh", lambda m, a, k, out: out * 0)
    with fh.with_hooks(model, fh.op_outputs("block", "tanh")) as outer, fh.with_hooks(model, zero):
        model(x).sum().backward()
    assert len(outer.record.calls("block", "tanh")) == 1
    assert torch.equal(outer.record["block"]["tanh"], torch.zeros(2, 3))
    assert torch.equal(model.block.lin.weight.grad, torch.zeros(3, 3))
    fh.testing.assert_no_hooks(model)


class _Sometimes(nn.Module):
    """Calls `softmax` only when the sequence is longer than one (as attention caches do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1) if x.shape[-1] > 1 else x * 2


def test_a_call_that_skips_the_op_records_nothing_and_raises_nothing() -> None:
    """A module that calls `softmax` in some calls only: those calls record nothing for the
    op spec, in any order, in `with_hooks` and in `capture`; the run goes on."""
    model = nn.Sequential(_Sometimes())
    spec = fh.op_outputs("0", "softmax")
    with fh.with_hooks(model, spec) as run:
        model(torch.ones(2, 1))
        model(torch.ones(2, 3))
        model(torch.ones(2, 1))
    assert [t.shape for t in run.record.calls("0", "softmax")] == [(2, 3)]
    f = fh.capture(model, [spec, fh.ablate("0", op="softmax")])
    out, rec = f(torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 3)) and rec["0"]["softmax"].shape == (2, 3)


def test_an_op_never_called_in_the_whole_run_still_raises() -> None:
    """The error is for an op no call of the module made in the run: said when the block
    exits (or the capture call returns), with the ops the first skipping call made; an
    error raised inside the block is not replaced by it."""
    model = nn.Sequential(_Sometimes())
    message = ("{caller}: an op spec matches an op called by the module it selects, got no call of `softmax` in "
               "module '0' (_Sometimes) for op_outputs('0', 'softmax'). Pick one of the ops called while it ran, "
               "['mul'], or select the module that calls it.")
    with pytest.raises(fh.SelectorError) as err, fh.with_hooks(model, fh.op_outputs("0", "softmax")):
        model(torch.ones(2, 1))
        model(torch.ones(3, 1))
    assert str(err.value) == message.format(caller="with_hooks")
    with pytest.raises(fh.SelectorError) as err:
        fh.capture(model, fh.op_outputs("0", "softmax"))(torch.ones(2, 1))
    assert str(err.value) == message.format(caller="capture")
    with pytest.raises(ZeroDivisionError), fh.with_hooks(model, fh.op_outputs("0", "softmax")):
        model(torch.ones(2, 1))
        1 / 0  # noqa: B018
    fh.testing.assert_no_hooks(model)
