"""Per-row interventions (issue 28): ``per_row=True`` edits row b of a batch at the module
``nth[b]`` and position ``index[b]`` only, so a whole patching sweep is one batched forward
of the prompt repeated N times, the idiom careful users write by hand. Each row equals the
single intervention it names; errors name the spec, the module, both sizes and the fix."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from helpers import PATCH_LAYERS, PATCH_POSITIONS, PATCH_VOCAB, PATCH_WIDTH, patching_gpt2, patching_prompts
from torch import nn

import funhooks as fh

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, LAYERS, WIDTH, POSITIONS = PATCH_VOCAB, PATCH_LAYERS, PATCH_WIDTH, PATCH_POSITIONS
RESID_PRE = ["transformer.drop", "transformer.h.*"]


class Stack(nn.Module):
    """Three residual layers over `(batch, position, 4)`: a plain model with positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def _pairs(layers: int, positions: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.arange(layers, device=device).repeat_interleave(positions),
            torch.arange(positions, device=device).repeat(layers))


# -- each row is the single intervention it names -----------------------------------------------


def test_a_per_row_sweep_on_gpt2_equals_the_loop_of_single_patches(device: torch.device) -> None:
    """One forward of the corrupted prompt repeated N times, row b patched at layer[b] and
    position[b] from a clean Record of batch 1, gives the logits of each single patch."""
    model = patching_gpt2(device)
    clean, corrupt = patching_prompts(device)
    layers, positions = _pairs(LAYERS + 1, POSITIONS, device)
    with torch.no_grad():
        _, rec = fh.capture(model, fh.outputs(RESID_PRE))(clean)
        one = fh.capture(model, fh.patch(RESID_PRE, rec, nth=fh.arg("layer"), index=fh.arg("pos")))
        rows = fh.capture(model, fh.patch(RESID_PRE, rec, nth=fh.arg("layer"), index=fh.arg("pos"), per_row=True))
        out, _ = rows(corrupt.expand(len(layers), -1), layer=layers, pos=positions, use_cache=False)
        loop = torch.cat([one(corrupt, layer=int(l), pos=int(p), use_cache=False)[0].logits
                          for l, p in zip(layers, positions)])
    assert torch.allclose(out.logits, loop, atol=1e-5)
    assert not torch.allclose(loop[0], loop[2], atol=1e-4)  # the rows differ: each is its own patch
    fh.testing.assert_no_hooks(model)


def test_per_row_on_standard_points_takes_lists_and_a_clean_batch_of_n() -> None:
    """On `fh.transformer.points(model).resid_pre`, `nth` and `index` as Python lists, and a
    clean Record of a batch of N rows (each row patched from its own clean row)."""
    model = patching_gpt2()
    pts = fh.transformer.points(model)
    clean, corrupt = patching_prompts()
    layers, positions = [0, 1, 1, 0], [2, 2, 0, 4]
    with torch.no_grad():
        _, rec = fh.capture(model, fh.outputs(pts.resid_pre))(clean.expand(4, -1))
        out, _ = fh.capture(model, fh.patch(pts.resid_pre, rec, nth=layers, index=positions, per_row=True))(
            corrupt.expand(4, -1))
        _, single = fh.capture(model, fh.outputs(pts.resid_pre))(clean)
        for b, (layer, pos) in enumerate(zip(layers, positions)):
            expected, _ = fh.capture(model, fh.patch(pts.resid_pre[layer], single, index=pos))(corrupt)
            assert torch.allclose(out.logits[b], expected.logits[0], atol=1e-5), b


@pytest.mark.parametrize("kind", ["patch", "steer", "scale", "ablate"])
def test_every_intervention_per_row_equals_its_single_rows(kind: str, device: torch.device) -> None:
    """patch, steer (with a scale per row: a dose-response curve in one forward), scale and
    ablate: row b of the per-row forward equals the single intervention of row b."""
    model = Stack().to(device)
    x = torch.randn(1, 3, 4, device=device)
    value = torch.randn(1, 3, 4, device=device)
    layers, positions = torch.tensor([0, 2, 1, 2], device=device), torch.tensor([0, 1, -1, 2], device=device)
    doses = torch.tensor([0.0, 1.0, -2.0, 4.0], device=device)

    def spec(nth: object, index: object, k: object, per_row: bool = False) -> fh.Spec:
        options = {"nth": nth, "index": index, "per_row": per_row}
        return {"patch": lambda: fh.patch("layers.*", value, **options),
                "steer": lambda: fh.steer("layers.*", value[0, 0], scale=k, **options),
                "scale": lambda: fh.scale("layers.*", 3.0, **options),
                "ablate": lambda: fh.ablate("layers.*", mean=value[0], **options)}[kind]()

    with torch.no_grad():
        out, _ = fh.capture(model, spec(layers, positions, doses, per_row=True))(x.expand(4, -1, -1))
        for b in range(4):
            expected, _ = fh.capture(model, spec(int(layers[b]), int(positions[b]), float(doses[b])))(x)
            assert torch.allclose(out[b], expected[0], atol=1e-6), b
    fh.testing.assert_no_hooks(model)


@hypothesis.given(rows=st.lists(st.tuples(st.integers(0, 2), st.integers(-3, 2)), min_size=1, max_size=6))
def test_random_rows_give_exactly_the_single_patch_rows(rows: list[tuple[int, int]]) -> None:
    """Whatever (layer, position) each row names, repeated or not, row b is exactly the
    single patch of its (layer, position) and the unedited rows stay the plain forward."""
    model = Stack()
    x, value = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    layers, positions = [r[0] for r in rows], [r[1] for r in rows]
    f = fh.capture(model, fh.patch("layers.*", value, nth=fh.arg("layer"), index=fh.arg("pos"), per_row=True))
    with torch.no_grad():
        out, _ = f(x.expand(len(rows), -1, -1), layer=layers, pos=positions)
        for b, (layer, pos) in enumerate(rows):
            expected, _ = fh.capture(model, fh.patch("layers.*", value, nth=layer, index=pos))(x)
            # the same up to the last bits a batch of rows may round differently from one row
            torch.testing.assert_close(out[b], expected[0], rtol=1e-6, atol=1e-6, msg=f"row {b}: {(layer, pos)}")


def test_per_row_with_element_and_dim_edits_the_rows_positions_of_that_item() -> None:
    """`element=` picks a tuple output's item; `dim=` says where the positions are (here the
    heads of `(batch, head, position)`): row b edits its own head only."""

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x + 1

    model = nn.Sequential(Pair())
    x = torch.zeros(3, 2, 4)
    spec = fh.patch("0", 7.0, index=[1, 0, 1], dim=1, element=1, per_row=True)
    with fh.with_hooks(model, spec):
        first, second = model(x)
    assert torch.equal(first, x)
    expected = torch.ones(3, 2, 4)
    expected[0, 1] = expected[1, 0] = expected[2, 1] = 7.0
    assert torch.equal(second, expected)


def test_per_row_composes_with_vmap_and_grad() -> None:
    """Under `vmap` (a batch of prompts, each run as N rows) and `grad` (of the steered
    outputs by the per-row scales) it gives what the rows give one at a time."""
    model = Stack()
    xs = torch.randn(2, 1, 3, 4)
    vector = torch.randn(4)
    layers, positions = torch.tensor([0, 1, 2]), torch.tensor([1, 1, 0])
    f = fh.capture(model, fh.steer("layers.*", vector, scale=fh.arg("k"), nth=layers, index=positions, per_row=True))
    k = torch.tensor([0.5, 1.0, 2.0])
    swept, _ = torch.func.vmap(lambda x: f(x.expand(3, -1, -1), k=k))(xs)
    grads = torch.func.grad(lambda k: f(xs[0].expand(3, -1, -1), k=k)[0].sum())(k)
    for b in range(3):
        def single(kb: torch.Tensor, x: torch.Tensor, b: int = b) -> torch.Tensor:
            spec = fh.steer("layers.*", vector, scale=kb, nth=int(layers[b]), index=int(positions[b]))
            return fh.capture(model, spec)(x)[0]

        for i in range(2):
            assert torch.allclose(swept[i, b], single(k[b], xs[i])[0], atol=1e-6)
        assert torch.allclose(grads[b], torch.func.grad(lambda kb: single(kb, xs[0]).sum())(k[b]), atol=1e-5)


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def test_masks_follow_the_per_call_values_changed_in_place_or_replaced() -> None:
    """Masks are kept between calls for the same per-call tensors: a tensor changed in place,
    a new tensor, or a call under `inference_mode` then with gradients each edit what they say."""
    model = nn.Sequential(nn.Identity(), Double())  # a patch of 1 before `Double` reads 2, after it 1
    f = fh.capture(model, fh.patch("*", 1.0, nth=fh.arg("layer"), index=fh.arg("pos"), per_row=True))
    x, layers, pos = torch.zeros(2, 3), torch.tensor([0, 0]), torch.tensor([0, 2])

    def edited() -> list[list[float]]:
        return f(x, layer=layers, pos=pos)[0].tolist()

    assert edited() == [[2, 0, 0], [0, 0, 2]]
    pos[1] = 1
    assert edited() == [[2, 0, 0], [0, 2, 0]]
    pos = torch.tensor([2, 2])
    assert edited() == [[0, 0, 2], [0, 0, 2]]
    layers[0] = 1
    assert edited() == [[0, 0, 1], [0, 0, 2]]
    with torch.inference_mode():
        f(x, layer=layers, pos=pos)
    w = torch.zeros(2, 3, requires_grad=True)
    out, _ = f(w, layer=layers, pos=pos)
    out.sum().backward()
    assert w.grad is not None and w.grad.tolist() == [[2, 2, 0], [2, 2, 0]]


# -- errors ---------------------------------------------------------------------------------------


def _spec_repr(**options: object) -> str:
    return repr(fh.patch("layers.*", 1.0, per_row=True, **options))


@pytest.mark.parametrize(("options", "call", "message"), [
    ({"nth": fh.arg("layer")}, {"layer": [0, 1, 2]},
     "capture: `nth` is one entry per row of the batch (per_row=True: 4 rows along dim 0), got 3 entries, at module "
     "'layers.0' for {spec}. Pass 4 entries, or run the model on a batch of 3 rows (the input repeated 3 times)."),
    ({"index": fh.arg("pos")}, {"pos": torch.tensor([0, 1])},
     "capture: `index` is one entry per row of the batch (per_row=True: 4 rows along dim 0), got 2 entries, at module "
     "'layers.0' for {spec}. Pass 4 entries, or run the model on a batch of 2 rows (the input repeated 2 times)."),
    ({"index": fh.arg("pos")}, {"pos": [0, 1, 3, 0]},
     "capture: `index` is a position along dim 1 (size 3) in each row, got 3 in row 2, at module 'layers.0' for "
     "{spec}. Pass an index in [-3, 3)."),
    ({"nth": fh.arg("layer")}, {"layer": [0, 1, 3, 0]},
     "capture: `nth` is the index of a module the selector matched (3 here: ['layers.0', 'layers.1', 'layers.2']), "
     "got 3 in row 2, for {spec}. Pass an `nth` below 3."),
    ({"index": fh.arg("pos")}, {"pos": [[0], [1], [2], [0]]},
     "capture: `index` is one int position per row (per_row=True), got [[0], [1], [2], [0]], at module 'layers.0' for "
     "{spec}. Pass an int, or a list or 1-d integer tensor of one position per row."),
])
def test_per_row_errors_name_the_spec_the_module_and_both_sizes(options: dict, call: dict, message: str) -> None:
    model = Stack()
    f = fh.capture(model, fh.patch("layers.*", 1.0, per_row=True, **options))
    with pytest.raises(fh.InterventionError) as err:
        f(torch.zeros(4, 3, 4), **call)
    assert str(err.value) == message.format(spec=_spec_repr(**options))
    fh.testing.assert_no_hooks(model)


def test_steer_scales_per_row_have_one_entry_per_row() -> None:
    model = Stack()
    spec = fh.steer("layers.0", torch.ones(4), scale=torch.ones(3), per_row=True)
    with pytest.raises(fh.InterventionError, match=r"`scale` is one entry per row of the batch \(per_row=True: 2 rows "
                                                   r"along dim 0\), got 3 entries, at module 'layers.0'"):
        fh.capture(model, spec)(torch.zeros(2, 3, 4))
    fh.testing.assert_no_hooks(model)


def test_per_row_refuses_dim_0_and_a_static_row_past_the_modules() -> None:
    """The rows are dim 0, so positions cannot be there; a static per-row `nth` past the
    modules matched is refused when the plan is made."""
    with pytest.raises(fh.SpecError, match=r"^patch: `dim` is the position axis, which is not the rows' \(dim 0\) "
                                           r"with `per_row=True`, got 0\. Pass the dimension holding the positions\.$"):
        fh.patch("layers.*", 1.0, index=[0, 1], dim=0, per_row=True)
    model = Stack()
    with pytest.raises(fh.InterventionError, match=r"got 5 in row 1, for patch\("):
        fh.capture(model, fh.patch("layers.*", 1.0, nth=[0, 5], per_row=True))(torch.zeros(2, 3, 4))
    with pytest.raises(fh.SpecError, match=r"^patch: `per_row` is a bool, got 1\."):
        fh.patch("layers.*", 1.0, per_row=1)  # type: ignore[arg-type]
    fh.testing.assert_no_hooks(model)
