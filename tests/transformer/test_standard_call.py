"""`fh.observe(point, fn)` and `fh.edit(point, fn)`: fn gets `(module, args, value)`, the forward
hook's arguments with the point's value in place of the output; observe stores what fn returns
under the point's Record path, edit replaces the value (through the view for per-head points).
Checked against plain torch hooks on the module paths, with the reshapes done by hand."""

from __future__ import annotations

import pytest
import torch

import funhooks as fh
from tests.transformer_models import BUILDERS, inputs

MODEL = BUILDERS["gpt2"]()
PTS = fh.transformer.points(MODEL)
_heads = lambda t: t.unflatten(-1, (PTS.n_heads, -1))
# point -> (module path, what a plain hook reads: "out" or "in", the point's value from that tensor)
PLACES = {
    "resid_post": ("transformer.h.1", "out", lambda t: t),
    "attn_out": ("transformer.h.1.attn", "out", lambda t: t),  # element 0 of the attention's tuple
    "k": ("transformer.h.1.attn.c_attn", "out", lambda t: _heads(t.chunk(3, -1)[1])),
    "z": ("transformer.h.1.attn.c_proj", "in", _heads),
    "mlp_post": ("transformer.h.1.mlp.c_proj", "in", lambda t: t),
}
SEEN: list = []


def doubled(module, args, value):
    SEEN.append((module, args))
    return value * 2


def _plain(path, where, fn):
    """A plain torch hook on `path` calling `fn(module, args, tensor)` on the output (or first
    input); a tensor it returns replaces that value. Returns the logits."""
    module = MODEL.get_submodule(path)
    if where == "out":
        def hook(m, args, out):
            new = fn(m, args, out[0] if isinstance(out, tuple) else out)
            return None if new is None else (new, *out[1:]) if isinstance(out, tuple) else new
        handle = module.register_forward_hook(hook)
    else:
        def pre(m, args):
            new = fn(m, args, args[0])
            return None if new is None else (new, *args[1:])
        handle = module.register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            return MODEL(**inputs("gpt2")).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("point", sorted(PLACES))
def test_observe_a_point_stores_fn_of_its_value_under_its_record_path(point):
    """observe(pts.X[1], fn) calls fn with the module holding the point, that module's args and
    the point's value (through its view), and stores fn's result under `blocks.1.X`."""
    path, where, view = PLACES[point]
    plain = {}
    _plain(path, where, lambda m, args, t: plain.update(module=m, args=args, value=view(t)))
    SEEN.clear()
    _, rec = fh.capture(MODEL, fh.observe(getattr(PTS, point)[1], doubled))(**inputs("gpt2"))
    assert list(rec) == [f"blocks.1.{point}"]
    torch.testing.assert_close(rec[f"blocks.1.{point}"]["doubled"], plain["value"] * 2)
    ((module, args),) = SEEN
    assert module is plain["module"] and torch.equal(args[0], plain["args"][0])
    fh.testing.assert_no_hooks(MODEL)


def _second_head_zeroed(module, args, value):
    return value.index_fill(2, torch.tensor(1), 0.0)


def _halved(module, args, value):
    return value * 0.5


@pytest.mark.parametrize("point", sorted(PLACES))
def test_edit_a_point_equals_the_same_edit_in_a_plain_hook(point):
    """edit(pts.X[1], fn) replaces the point's value with fn's result, written back through the
    view (one head of a fused k, one head of z), into element 0 of a tuple or as the first
    argument: the logits equal those of a plain torch hook editing the full tensor by hand."""
    path, where, view = PLACES[point]
    fn = _second_head_zeroed if point in ("k", "z") else _halved

    def by_hand(m, args, t):
        if point == "k":
            q, k, v = t.chunk(3, -1)
            return torch.cat([q, fn(m, args, _heads(k)).flatten(-2), v], -1)
        return fn(m, args, view(t)).flatten(-2) if point == "z" else fn(m, args, t)

    expected = _plain(path, where, by_hand)
    with torch.no_grad():
        out, _ = fh.capture(MODEL, fh.edit(getattr(PTS, point)[1], fn))(**inputs("gpt2"))
        bare, _ = fh.capture(MODEL, [])(**inputs("gpt2"))
    assert not torch.allclose(out.logits, bare.logits)
    torch.testing.assert_close(out.logits, expected)
    fh.testing.assert_no_hooks(MODEL)


def _second_head_of_pattern_zeroed(module, args, pattern):
    return pattern.index_fill(1, torch.tensor(1), 0.0)  # (batch, head, query, key)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_edit_the_pattern_equals_an_edit_of_eager_softmax(attn):
    """edit(pts.pattern[0], fn) under eager and SDPA gives what an op editor of eager
    attention's `softmax` with the same fn gives; a recording after it sees the edited pattern."""
    eager, model = BUILDERS["llama"]("eager"), BUILDERS["llama"](attn)
    pts = fh.transformer.points(model)
    x = inputs("llama")
    with torch.no_grad():
        expected, _ = fh.capture(eager, fh.op_edit("model.layers.0.self_attn", "softmax",
                                                   lambda m, a, k, out: _second_head_of_pattern_zeroed(m, a, out)))(**x)
        out, rec = fh.capture(model, [fh.edit(pts.pattern[0], _second_head_of_pattern_zeroed),
                                      fh.outputs(pts.pattern[0])])(**x)
    torch.testing.assert_close(out.logits, expected.logits)
    pattern = rec["blocks.0.pattern"]["output"]
    assert torch.all(pattern[:, 1] == 0) and torch.all(pattern[:, 0].sum(-1) > 0.99)


def test_an_edit_returning_none_leaves_the_point():
    """An editor returning None leaves the value as it was: the output is the model's own."""
    with torch.no_grad():
        out, _ = fh.capture(MODEL, fh.edit(PTS.q, lambda module, args, value: None))(**inputs("gpt2"))
        bare, _ = fh.capture(MODEL, [])(**inputs("gpt2"))
    assert torch.equal(out.logits, bare.logits)


def test_observe_and_edit_of_points_say_what_they_take():
    """observe of an op's value, an event other than forward and an edit of the wrong shape are
    refused with the rule and what to use; the model is left as it was."""
    with pytest.raises(fh.SpecError) as err:
        fh.observe(PTS.pattern, doubled)
    assert str(err.value) == (
        "observe: `pattern` is the value of an op inside a module, which no observer sees, got `pattern`. Store it "
        "with `fh.outputs(pts.pattern)` and apply the function to the Record's values, or edit it with "
        "`fh.edit(pts.pattern, fn)`.")
    with pytest.raises(fh.SpecError) as err:
        fh.edit(PTS.z[0], doubled, event="backward")
    assert str(err.value) == (
        "edit: a standard point is a value of the forward pass, seen with `event=\"forward\"`, got "
        "event='backward' with `z[0]`. Leave `event` out (for its gradient, use `fh.grads(pts.z)`).")
    with pytest.raises(fh.HookError, match=r"an editor of a standard point returns a tensor shaped like the "
                                           r"point's value, \(2, 6, 4, 8\), got torch.Size\(\[3\]\)"):
        fh.capture(MODEL, fh.edit(PTS.q[0], lambda module, args, value: torch.zeros(3)))(**inputs("gpt2"))
    assert repr(fh.observe(PTS.resid_post[1], doubled)) == "observe(resid_post[1], doubled)"
    fh.testing.assert_no_hooks(MODEL)
