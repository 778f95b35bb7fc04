"""Selectors: every accepted form, combinators, module order, shared modules and wrappers."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

import funhooks as fh


def is_linear(path: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def compile_lazily(model: nn.Module) -> nn.Module:
    """`torch.compile(model)` without calling it: only the wrapper object is built."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own import-time warnings
        return torch.compile(model)


def paths(where, model: nn.Module) -> list[str]:
    return [p for p, _ in fh.select(where).resolve(model)]


ALL = [
    "",
    "embed",
    "blocks",
    "blocks.0",
    "blocks.0.attn",
    "blocks.0.mlp",
    "blocks.0.mlp.0",
    "blocks.0.mlp.1",
    "blocks.1",
    "blocks.1.attn",
    "blocks.1.mlp",
    "blocks.1.mlp.0",
    "blocks.1.mlp.1",
    "head",
    "head.0",
]


def test_named_modules_order_is_the_reference() -> None:
    """The selector universe is `named_modules()`, in its order."""
    assert [p for p, _ in Net().named_modules()] == ALL


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("", [""]),
        ("embed", ["embed"]),
        ("*", ["embed", "blocks", "head"]),
        ("**", ALL[1:]),
        ("blocks.*", ["blocks.0", "blocks.1"]),
        ("blocks.*.attn", ["blocks.0.attn", "blocks.1.attn"]),
        ("blocks.**", ["blocks", *ALL[3:13]]),
        ("**.0", ["blocks.0", "blocks.0.mlp.0", "blocks.1.mlp.0", "head.0"]),
        ("blocks.**.0", ["blocks.0", "blocks.0.mlp.0", "blocks.1.mlp.0"]),
        ("*.*.mlp.*", ["blocks.0.mlp.0", "blocks.0.mlp.1", "blocks.1.mlp.0", "blocks.1.mlp.1"]),
    ],
)
def test_path_patterns(pattern: str, expected: list[str]) -> None:
    """`*` is one segment, `**` any number (zero included), "" the root; "**" skips the root."""
    assert paths(pattern, Net()) == expected


def test_patterns_match_whole_segments_only() -> None:
    """"blocks.1" does not pick "blocks.10"-like prefixes or "blocks.1.attn"."""
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(12)])
    assert paths("1", model) == ["1"]
    assert paths("*", model) == [str(i) for i in range(12)]


def test_patterns_address_any_module_name() -> None:
    """A ModuleDict key may hold any character but "."; a path pattern reaches it."""
    model = nn.ModuleDict({"conv-1": nn.Linear(1, 1), "head out": nn.Linear(1, 1)})
    assert paths("conv-1", model) == ["conv-1"]
    assert paths("head out", model) == ["head out"]


@pytest.mark.parametrize(("pattern", "bad"), [("a..b", [""]), (".a", [""]), ("a.", [""]), ("a*", ["a*"]), ("a.***", ["***"])])
def test_malformed_patterns_raise_with_exact_message(pattern: str, bad: list[str]) -> None:
    """An empty segment or a `*` inside a name is rejected when the selector is built."""
    with pytest.raises(fh.SelectorError) as err:
        fh.select(pattern)
    assert str(err.value) == (
        f"select: a path pattern is dot-separated names, `*` or `**`, got {pattern!r}. Fix the segment(s) {bad!r}."
    )


def test_type_and_tuple_of_types() -> None:
    """A type matches by isinstance; a tuple of types matches any of them."""
    model = Net()
    assert paths(nn.ReLU, model) == ["blocks.0.mlp.1", "blocks.1.mlp.1"]
    assert paths((nn.ReLU, nn.ModuleList), model) == ["blocks", "blocks.0.mlp.1", "blocks.1.mlp.1"]
    assert paths(Block, model) == ["blocks.0", "blocks.1"]


def test_instance_selects_exactly_that_module() -> None:
    """A module instance selects that module, wherever it sits."""
    model = Net()
    assert paths(model.blocks[1].attn, model) == ["blocks.1.attn"]
    assert paths(model, model) == [""]


def test_foreign_instance_raises_before_registration() -> None:
    """An instance not in the model is a SelectorError naming both types, nothing registered."""
    model = Net()
    stranger = nn.Linear(4, 4)
    spec = fh.outputs(stranger)
    with pytest.raises(fh.SelectorError) as err:
        fh.with_hooks(model, spec)
    assert str(err.value) == (
        "with_hooks: a module instance selector must be a submodule of the model in spec "
        "outputs(<Linear instance>), got a Linear that is not part of Net. "
        "Select it by path or type, or pass the model that contains it."
    )
    fh.testing.assert_no_hooks(model)


def test_predicate_gets_path_and_module() -> None:
    """A predicate `(path, module) -> bool` is called for every module."""
    model = Net()
    seen: list[str] = []
    assert paths(lambda p, m: seen.append(p) or p.endswith("attn"), model) == ["blocks.0.attn", "blocks.1.attn"]
    assert seen == ALL


def test_list_is_a_union_in_module_order() -> None:
    """A list selects what any entry selects, each module once, in module order."""
    model = Net()
    assert paths(["head.0", nn.ReLU, "embed", "head.0"], model) == ["embed", "blocks.0.mlp.1", "blocks.1.mlp.1", "head.0"]


def test_and_or_not_combinators() -> None:
    """`&` both, `|` either, `~` not; plain forms combine on either side."""
    model = Net()
    linear = fh.select(nn.Linear)
    assert paths(linear & ~fh.select("blocks.**"), model) == ["embed", "head.0"]
    assert paths(linear & "blocks.1.**", model) == ["blocks.1.attn", "blocks.1.mlp.0"]
    assert paths("head" | fh.select(nn.ReLU), model) == ["blocks.0.mlp.1", "blocks.1.mlp.1", "head"]
    assert paths(nn.ReLU & fh.select("blocks.0.**"), model) == ["blocks.0.mlp.1"]
    assert paths(nn.ReLU | fh.select("head"), model) == ["blocks.0.mlp.1", "blocks.1.mlp.1", "head"]
    assert paths(~fh.select("**"), model) == [""]


def test_selectors_are_hashable_equal_values_that_pickle() -> None:
    """Equal selector forms give equal, hash-equal Selectors that survive pickling."""
    for build in (lambda: fh.select("a.*"), lambda: fh.select((nn.Linear, nn.ReLU)),
                  lambda: fh.select(["a", nn.ReLU]) & ~fh.select(is_linear)):
        a, b = build(), build()
        assert a == b and hash(a) == hash(b)
        assert pickle.loads(pickle.dumps(a)) == a
    assert fh.select(fh.select("a")) == fh.select("a")


BAD_WHERE = [
    (3.5, "select: `where` is a path pattern, a module type, a module instance, a predicate "
          "`(path, module) -> bool` or a list of these, got 3.5. Pass one of those."),
    ([], 'select: a list selector needs at least one entry, got []. Use "**" for every module.'),
    (int, "select: a type selector names `nn.Module` subclasses, got <class 'int'>. "
          "Pass a module class such as `nn.Linear`."),
    ((nn.Linear, str), "select: a type selector names `nn.Module` subclasses, got <class 'str'>. "
                       "Pass a module class such as `nn.Linear`."),
]


@pytest.mark.parametrize(("where", "message"), BAD_WHERE)
def test_bad_selector_forms_raise_with_exact_message(where, message: str) -> None:
    """Anything that is not a selector form is rejected with the house message."""
    with pytest.raises(fh.SelectorError) as err:
        fh.select(where)
    assert str(err.value) == message


def test_no_match_lists_nearby_paths_and_children() -> None:
    """A pattern matching nothing names the closest paths and the top-level children."""
    with pytest.raises(fh.SelectorError) as err:
        fh.with_hooks(Net(), fh.outputs("haed"))
    assert str(err.value) == (
        "with_hooks: selector 'haed' in spec outputs('haed') matched no module of Net; "
        "nearby paths are ['head', 'head.0']; top-level children are ['embed', 'blocks', 'head']."
    )


def test_no_match_of_a_list_suggests_paths_for_its_patterns() -> None:
    """Patterns inside a list or `&` get nearby-path suggestions too."""
    with pytest.raises(fh.SelectorError) as err:
        fh.with_hooks(Net(), fh.outputs(["haed", nn.Conv2d]))
    assert str(err.value) == (
        "with_hooks: selector ['haed', Conv2d] in spec outputs(['haed', Conv2d]) matched no module of Net; "
        "nearby paths are ['head', 'head.0']; top-level children are ['embed', 'blocks', 'head']."
    )


def test_no_match_of_a_type_lists_children() -> None:
    """A type matching nothing lists the top-level children (no path to compare)."""
    model = Net()
    with pytest.raises(fh.SelectorError) as err:
        fh.with_hooks(model, fh.grads(nn.Conv2d))
    assert str(err.value) == (
        "with_hooks: selector Conv2d in spec grads(Conv2d) matched no module of Net; "
        "top-level children are ['embed', 'blocks', 'head']."
    )
    fh.testing.assert_no_hooks(model)


def test_shared_module_is_selected_once_at_its_first_path() -> None:
    """A module reachable by two paths appears once, at the first path, as named_modules does."""
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert paths("**", model) == ["0", "1"]
    assert paths(nn.Linear, model) == ["0"]
    assert [p for p, _ in model.named_modules()] == ["", "0", "1"]


def test_data_parallel_wrapper_adds_no_prefix() -> None:
    """nn.DataParallel (CPU: a plain wrapper) is looked through: same paths as the model."""
    model = Net()
    wrapped = nn.DataParallel(model)
    assert paths("**", wrapped) == paths("**", model)
    assert paths(model.head[0], wrapped) == ["head.0"]
    with fh.with_hooks(wrapped, fh.outputs("blocks.*.attn")) as run:
        wrapped(torch.randn(3, 4))
    assert list(run.record) == ["blocks.0.attn", "blocks.1.attn"]
    fh.testing.assert_no_hooks(wrapped)


def test_wrapped_submodules_add_no_segment() -> None:
    """A DataParallel around a submodule is skipped: its child keeps the wrapper's path."""
    inner = nn.Linear(2, 2)
    model = nn.Sequential(nn.DataParallel(inner), nn.ReLU())
    assert paths("**", model) == ["0", "1"]
    assert paths(nn.Linear, model) == ["0"]


def test_compiled_model_paths_have_no_orig_mod() -> None:
    """torch.compile's wrapper (created, never called) shows the plain model's paths."""
    model = Net()
    compiled = compile_lazily(model)
    assert paths("**", compiled) == paths("**", model)
    assert all("_orig_mod" not in p for p in paths("**", compiled))
    assert paths(nn.Linear, compiled) == paths(nn.Linear, model)
    assert paths(compiled, compiled) == [""]  # the wrapper instance selects its model
    with fh.with_hooks(compiled, fh.outputs("head.0")):
        pass
    fh.testing.assert_no_hooks(model)


def test_compiled_submodule_instance_selects_the_inner_module() -> None:
    """Selecting a compiled submodule by instance selects the module it wraps."""
    model = Net()
    compiled_head = compile_lazily(model.head)
    assert paths(compiled_head, model) == ["head"]


def test_selector_repr() -> None:
    """A selector's repr reads like the selector that built it."""
    assert repr(fh.select("a.*")) == "'a.*'"
    assert repr(fh.select((nn.Linear, nn.ReLU))) == "(Linear, ReLU)"
    assert repr(fh.select(nn.Linear) & ~fh.select("head.**")) == "(Linear & ~select('head.**'))"
    assert repr(fh.select(["a", is_linear])) == "['a', is_linear]"


def test_a_predicate_taking_one_argument_is_refused_when_built() -> None:
    """Predicates take `(path, module)`: a one-argument `lambda m: ...` is refused by
    `select` (and every spec constructor) instead of failing inside the user's lambda."""

    def is_relu(m: nn.Module) -> bool:
        return isinstance(m, nn.ReLU)

    message = ("select: a predicate takes `(path, module)` and returns a bool, got `{name}` taking ({args}). Pass "
               "e.g. `lambda path, module: isinstance(module, nn.Linear)`.")
    for build in (lambda: fh.select(is_relu), lambda: fh.outputs(is_relu), lambda: fh.select(["a", is_relu])):
        with pytest.raises(fh.SelectorError) as err:
            build()
        assert str(err.value) == message.format(name="is_relu", args="m")
    with pytest.raises(fh.SelectorError) as err:
        fh.outputs(lambda path, module, extra: True)
    assert str(err.value) == message.format(name="<lambda>", args="path, module, extra")
    assert paths(lambda path, module, *rest: path == "0", nn.Sequential(nn.ReLU())) == ["0"]  # more may be optional
