"""Model utilities: fastai's documented values, modes and state left alone, meta and real passes."""

from __future__ import annotations

import copy
import json
import pickle

import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh
from funhooks.summary import LayerRow, Shape


def conv_layer(ni: int, nf: int, stride: int = 1) -> nn.Sequential:
    """fastai's ConvLayer default: conv (no bias) + BatchNorm + ReLU."""
    return nn.Sequential(nn.Conv2d(ni, nf, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(nf), nn.ReLU())


def fastai_mlp() -> nn.Sequential:
    """The model of fastai's layer_info / summary docs."""
    return nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.BatchNorm1d(50), nn.Linear(50, 1))


def modes(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


# -- fastai's documented values -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (nn.Linear(10, 32), (32 * 10 + 32, True)),
        (nn.Linear(10, 32, bias=False), (32 * 10, True)),
        (nn.BatchNorm2d(20), (20 * 2, True)),
        (nn.BatchNorm2d(20, affine=False), (0, False)),
        (nn.Conv2d(16, 32, 3), (16 * 32 * 3 * 3 + 32, True)),
        (nn.Conv2d(16, 32, 3, bias=False), (16 * 32 * 3 * 3, True)),
        (nn.LSTM(20, 10, 2), (4 * (20 * 10 + 10) + 3 * 4 * (10 * 10 + 10), True)),
    ],
)
def test_total_params_fastai_table(module: nn.Module, expected: tuple[int, bool]) -> None:
    """total_params gives fastai's documented (count, trainable) for each layer kind."""
    assert fh.total_params(module) == expected


def test_total_params_frozen_and_shared() -> None:
    """A frozen module is not trainable; a shared layer is counted once."""
    frozen = nn.Linear(3, 4).requires_grad_(False)
    assert fh.total_params(frozen) == (16, False)
    shared = nn.Linear(3, 3)
    assert fh.total_params(nn.Sequential(shared, shared)) == (12, True)


def test_has_params_fastai_values() -> None:
    """has_params is True for Linear and LSTM, False for ReLU."""
    assert fh.has_params(nn.Linear(3, 4))
    assert fh.has_params(nn.LSTM(4, 5, 2))
    assert not fh.has_params(nn.ReLU())


def test_model_sizes_three_conv_layers(device: torch.device) -> None:
    """model_sizes of three conv blocks is fastai's [[1,16,64,64],[1,32,32,32],[1,32,32,32]]."""
    m = nn.Sequential(conv_layer(3, 16), conv_layer(16, 32, stride=2), conv_layer(32, 32)).to(device)
    assert fh.model_sizes(m) == [[1, 16, 64, 64], [1, 32, 32, 32], [1, 32, 32, 32]]


def test_num_features_model_fastai_values() -> None:
    """num_features_model gives 3 and 32 on fastai's two documented models."""
    assert fh.num_features_model(nn.Sequential(nn.Conv2d(5, 4, 3), nn.Conv2d(4, 3, 3))) == 3
    m = nn.Sequential(conv_layer(3, 16), conv_layer(16, 32, stride=2), conv_layer(32, 32))
    assert fh.num_features_model(m) == 32


def test_num_features_model_grows_the_input() -> None:
    """A model needing an input bigger than 32x32 still gets its features (fastai's retry loop)."""
    m = nn.Sequential(nn.Conv2d(3, 8, 40), nn.Conv2d(8, 6, 3))
    assert fh.num_features_model(m) == 6


def test_layer_info_fastai_rows(device: torch.device) -> None:
    """layer_info of Linear/ReLU/BatchNorm1d/Linear equals fastai 2.8's documented five-item rows
    `(type, params, trainable, shape, same)`, '' for a module without a weight, and keeps paths."""
    rows = fh.layer_info(fastai_mlp().to(device), torch.randn(16, 1, device=device))
    assert rows == [
        ("Linear", 100, True, [1, 50], False),
        ("ReLU", "", "", [1, 50], True),
        ("BatchNorm1d", 100, True, [1, 50], True),
        ("Linear", 51, True, [1, 1], False),
    ]
    assert [r.path for r in rows] == ["0", "1", "2", "3"]
    kind, params, trainable, shape, same = rows[1]
    assert (kind, params, trainable, shape, same) == (rows[1].type, rows[1].params, rows[1].trainable,
                                                      rows[1].shape, rows[1].same)


class Scale(nn.Module):
    """A leaf with a parameter that is not called `weight`."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Pair(nn.Module):
    """Two inputs, a tuple of two outputs: `same` pairs input k with output k, as fastai's zip."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(1), y[0]


def test_layer_info_follows_fastais_track_rules() -> None:
    """params/trainable are '' exactly when fastai's `hasattr(m, 'weight')` is False (a BatchNorm
    without affine has a None weight: 0 and False); `same` is fastai's `any(i.shape[1:] == o.shape)`
    over `zip(inputs, outputs)`, an output tensor iterating over its batch."""
    model = nn.Sequential(Scale(), nn.BatchNorm1d(3, affine=False), nn.Flatten(0), nn.Unflatten(0, (1, 3)))
    rows = fh.layer_info(model, torch.randn(4, 3))
    assert rows == [("Scale", "", "", [1, 3], True), ("BatchNorm1d", 0, False, [1, 3], True),
                    ("Flatten", "", "", [3], False), ("Unflatten", "", "", [1, 3], False)]
    (row,) = fh.layer_info(Pair(), torch.randn(2, 3, 4), torch.randn(2, 5))
    assert row.shape == ((1, 4), (5,)) and row.same is True  # y.shape[1:] == the second output's shape
    (row,) = fh.layer_info(nn.LSTM(4, 5, batch_first=True), torch.randn(3, 7, 4))
    assert row[1:3] == ("", "") and row.same is False  # no `weight`: fastai shows no parameter count


FASTAI_TABLE = """\
Sequential (Input shape: ['16 x 1'])
================================================================
Layer (type)         Output Shape         Param #    Trainable
================================================================
Linear               16 x 50              100        True
________________________________________________________________
ReLU                 16 x 50
________________________________________________________________
BatchNorm1d          16 x 50              100        True
________________________________________________________________
Linear               16 x 1               51         True
________________________________________________________________

Total params: 251
Total trainable params: 251
Total non-trainable params: 0"""


def test_module_summary_is_fastais_table() -> None:
    """str(module_summary) is fastai's table for the documented model, totals 251/251/0."""
    s = fh.module_summary(fastai_mlp(), torch.randn(16, 1))
    assert (s.total, s.trainable, s.non_trainable) == (251, 251, 0)
    assert str(s) == FASTAI_TABLE


def test_module_summary_plain_data_is_json() -> None:
    """to_dict() is plain data that survives a JSON round trip."""
    s = fh.module_summary(fastai_mlp(), torch.randn(16, 1))
    data = json.loads(json.dumps(s.to_dict()))
    assert data["total"] == 251 and data["non_trainable"] == 0
    assert data["input_shapes"] == [[16, 1]]
    assert data["rows"][2] == {"path": "2", "type": "BatchNorm1d", "params": 100, "trainable": True, "shape": [16, 50],
                               "same": True}
    assert data["rows"][1] == {"path": "1", "type": "ReLU", "params": "", "trainable": "", "shape": [16, 50],
                               "same": True}


def test_module_summary_counts_frozen_and_non_leaf_params() -> None:
    """Frozen layers count as non-trainable; a parameter owned by a non-leaf module counts too."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) * self.scale

    m = nn.Sequential(Scaled(), nn.Linear(4, 2))
    m[1].requires_grad_(False)
    s = fh.module_summary(m, torch.randn(3, 4))
    assert (s.total, s.trainable, s.non_trainable) == (20 + 4 + 10, 24, 10)
    assert "Total non-trainable params: 10" in str(s)


# -- fastai's quirks, fixed -------------------------------------------------------------------------

X = torch.rand(4, 3, 16, 16)
UTILITIES = {
    "dummy_eval": lambda m: fh.dummy_eval(m),
    "model_sizes": lambda m: fh.model_sizes(m),
    "num_features_model": lambda m: fh.num_features_model(m),
    "layer_info": lambda m: fh.layer_info(m, X),
    "module_summary": lambda m: fh.module_summary(m, X),
}


@pytest.mark.parametrize("name", sorted(UTILITIES))
@hypothesis.given(flags=st.lists(st.booleans(), min_size=9, max_size=9))
def test_modes_and_state_are_left_alone(name: str, flags: list[bool]) -> None:
    """Every utility leaves each module's train/eval flag, its state and the global RNG as they were."""
    torch.manual_seed(0)
    m = nn.Sequential(conv_layer(3, 4), nn.Dropout(), conv_layer(4, 6, stride=2), nn.Flatten())
    for module, flag in zip(m.modules(), flags):
        module.training = flag
    before, state = modes(m), copy.deepcopy(m.state_dict())
    rng = torch.get_rng_state()
    UTILITIES[name](m)
    assert modes(m) == before
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    fh.testing.assert_no_hooks(m)


def test_dummy_eval_works_on_linear_only_models() -> None:
    """dummy_eval finds the input size from a first Linear layer (fastai needs a conv)."""
    m = nn.Sequential(nn.Linear(7, 3), nn.ReLU())
    assert fh.dummy_eval(m).shape == (1, 3)
    assert fh.num_features_model(m) == 3


def test_dummy_batch_matches_the_first_layer(device: torch.device) -> None:
    """dummy_batch has the first layer's channels, device and dtype, values in [-1, 1), reproducible."""
    m = nn.Sequential(nn.Conv1d(5, 2, 3)).to(device=device, dtype=torch.float64)
    x = fh.dummy_batch(m, size=(12,))
    assert (x.shape, x.device.type, x.dtype) == ((1, 5, 12), device.type, torch.float64)
    assert -1 <= x.min() and x.max() < 1
    assert torch.equal(x, fh.dummy_batch(m, size=(12,)))


def test_dummy_batch_errors() -> None:
    """A model without conv/linear layers and a size of the wrong rank give clear errors."""
    with pytest.raises(TypeError, match=r"^dummy_batch: the input size is read from the first `Linear` or "
                       r"`Conv1d/2d/3d` layer, got Sequential with none\. Build the input yourself"):
        fh.dummy_batch(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError) as err:
        fh.dummy_batch(nn.Conv1d(3, 4, 3))
    assert str(err.value) == (
        "dummy_batch: `size` has one entry per spatial dimension of the first layer (Conv1d: 1), "
        "got (64, 64). Pass size=(64,)."
    )


def test_num_features_model_error_for_tuple_output() -> None:
    """A model returning no single tensor gets an error naming what is needed."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x), x

    with pytest.raises(TypeError) as err:
        fh.num_features_model(Pair())
    assert str(err.value) == (
        "num_features_model: the model's output is a tensor with a feature dimension 1, got shape "
        "((1, 2), (1, 3)). Pass the part of the model that returns features."
    )


# -- meta and real passes ------------------------------------------------------------------------------


class DataDependent(nn.Module):
    """Python control flow on a tensor value: the meta device cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.small, self.big = nn.Linear(3, 2), nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x) if x.abs().sum() > 0 else self.small(x)


def test_data_dependent_model_falls_back_to_a_real_pass() -> None:
    """A model the meta device cannot run still gets its shapes, from a real pass."""
    rows = fh.layer_info(DataDependent(), torch.ones(4, 3))
    assert rows == [("Linear", 8, True, None, False), ("Linear", 20, True, [1, 5], False)]


def test_summary_of_a_large_batch_costs_no_memory() -> None:
    """Shapes come from the meta device: a 4096-image batch of a conv net is summarised at once."""
    m = nn.Sequential(conv_layer(3, 64), conv_layer(64, 64))
    x = torch.empty(4096, 3, 224, 224, device="meta")  # would be 2.4 GB of activations per layer
    s = fh.module_summary(m, x)
    assert s.rows[-1].shape == (4096, 64, 224, 224)


class Probe(nn.Module):
    """Notes the device of each input it sees: "meta" for the meta pass, "cpu" for a real one."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device.type)
        return x


def test_small_passes_run_for_real_and_big_ones_on_meta() -> None:
    """A small pass runs for real (the meta device's kernels are Python code, slower than a small
    real pass); one whose matrix product would pass the budget is stopped before it runs and
    done on the meta device, with the same rows."""
    probe = Probe()
    m = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), probe)
    small = fh.module_summary(m, torch.randn(2, 4096))
    assert probe.seen == ["cpu"] and small.rows[0].shape == (2, 4096)
    probe.seen.clear()
    big = fh.module_summary(m, torch.randn(2048, 4096))  # 68.7 GFLOPs in the first layer
    assert probe.seen == ["meta"] and big.rows[0].shape == (2048, 4096)
    assert big.flops == 2 * 2048 * 4096 * 4096 and m[0].weight.device.type == "cpu"


def _real_shape(module: nn.Module, args: tuple, output: object) -> object:
    return torch.utils._pytree.tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else None, output)


def _is_leaf(path: str, module: nn.Module) -> bool:
    return not list(module.children())


@hypothesis.given(pair=fh.testing.models_and_inputs() if hasattr(fh.testing, "models_and_inputs") else st.nothing())
def test_meta_shapes_equal_real_shapes(pair: tuple[nn.Module, torch.Tensor]) -> None:
    """For any drawn model, the summary's shapes (meta device) are those of a real eval pass,
    and the model's modes and state are untouched."""
    model, x = pair
    before, state = modes(model), copy.deepcopy(model.state_dict())
    rows = fh.module_summary(model, x).rows
    assert modes(model) == before
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    model.eval()
    with torch.no_grad(), fh.with_hooks(model, fh.observe(_is_leaf, _real_shape, name="shape")) as run:
        model(x)
    rec = run.record
    expected = [rec.calls(r.path, "shape")[-1] if r.path in rec else None for r in rows]
    assert [r.shape for r in rows] == expected


def test_shared_module_keeps_its_real_parameters() -> None:
    """A module registered under two paths gets its own parameters back after the meta pass."""
    shared = nn.Linear(3, 3)
    m = nn.Sequential(shared, nn.Tanh(), shared)
    weight, bias = shared.weight, shared.bias
    rows = fh.layer_info(m, torch.randn(2, 3))
    assert [r.path for r in rows] == ["0", "1"]  # the shared instance is listed once, at its first path
    assert shared.weight is weight and shared.bias is bias and weight.device.type == "cpu"


class Cached(nn.Module):
    """Caches a tensor computed in forward as a plain attribute (as rotary embeddings do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None or self.cache.shape != x.shape[1:]:
            self.cache = torch.ones_like(self.lin.weight[0])
        return self.lin(x) * self.cache


def test_meta_pass_leaves_no_meta_cache_behind() -> None:
    """A tensor that forward caches on the module is not left on the meta device."""
    m = Cached()
    fh.layer_info(m, torch.randn(2, 3))
    assert m.cache is None
    m(torch.randn(2, 3))
    cache = m.cache
    fh.module_summary(m, torch.randn(2, 3))
    assert m.cache is cache and m(torch.randn(2, 3)).device.type == "cpu"


def test_lazy_modules_are_initialised_by_a_real_pass() -> None:
    """A lazy model gets a real pass (which initialises it, as fastai's dummy_eval would)."""
    m = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    rows = fh.layer_info(m, torch.randn(5, 3))
    assert rows == [("Linear", 16, True, [1, 4], False), ("ReLU", "", "", [1, 4], True)]
    assert m[0].weight.shape == (4, 3) and m[0].weight.device.type == "cpu"


def test_model_rejecting_the_input_raises_its_own_error() -> None:
    """When the model rejects the input, the user sees the model's error."""
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        fh.layer_info(nn.Sequential(nn.Linear(3, 2)), torch.randn(2, 4))


def test_compiled_and_wrapped_models_are_looked_through() -> None:
    """A DataParallel-wrapped model has the paths and rows of the plain one."""
    m = fastai_mlp()
    x = torch.randn(16, 1)
    assert [r.path for r in fh.layer_info(nn.DataParallel(m), x)] == [r.path for r in fh.layer_info(m, x)]


@pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")  # dynamo's import
def test_a_compiled_submodule_is_looked_through_by_the_summary() -> None:
    """A submodule wrapped by `torch.compile` counts as the module it wraps: the summary's
    rows, totals and FLOPs are the plain model's (its parameter walk raised KeyError)."""
    plain = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    wrapped = nn.Sequential(plain[0], torch.compile(plain[1]))
    x = torch.randn(4, 8)
    got, want = fh.module_summary(wrapped, x, layout="full"), fh.module_summary(plain, x, layout="full")
    assert got.layers == want.layers and got.rows == want.rows
    assert (got.total, got.flops) == (want.total, want.flops) == (144, 1024)


def test_tuple_outputs_give_a_tree_of_shapes() -> None:
    """An LSTM row holds the shapes of (output, (h, c)); the table prints them nested."""
    (row,) = fh.layer_info(nn.LSTM(4, 5, batch_first=True), torch.randn(3, 7, 4))
    assert row.shape == ((1, 7, 5), ((1, 1, 5), (1, 1, 5)))
    assert "[3 x 7 x 5, [1 x 3 x 5, 1 x 3 x 5]]" in str(fh.module_summary(nn.LSTM(4, 5, batch_first=True),
                                                                           torch.randn(3, 7, 4)))


# -- the row value ----------------------------------------------------------------------------------------


def test_layer_row_is_a_frozen_fastai_tuple() -> None:
    """A row unpacks like fastai's tuple, pickles with its path, and refuses assignment."""
    row = LayerRow("body.0", "Conv2d", 10, True, torch.Size([1, 2, 3, 3]), False)
    kind, params, trainable, shape, same = row
    assert (kind, params, trainable, shape, same) == ("Conv2d", 10, True, [1, 2, 3, 3], False)
    assert isinstance(shape, Shape) and hash(shape) == hash((1, 2, 3, 3))
    again = pickle.loads(pickle.dumps(row))
    assert again == row and again.path == "body.0"
    with pytest.raises(fh.FrozenError, match=r"^LayerRow: a frozen value cannot be assigned to, got `\.path = \.\.\.`"):
        row.path = "x"  # type: ignore[misc]
    assert row != ("Conv2d", 10, True, [1, 2, 3, 4], False)
    assert row != ("Conv2d", 10, True, [1, 2, 3, 3])  # fastai 2.8's rows have five items
