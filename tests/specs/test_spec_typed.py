"""Typed specs (issue 37): a Spec's event, role and hook are ``Literal`` types, not plain
``str``; its function and its action are separate fields; the library builds every Spec by
keyword; what users see (reprs, equality, errors) is what it was."""

from __future__ import annotations

import ast
import pathlib
import typing

import pytest
import torch
from torch import nn

import funhooks as fh
from funhooks.errors import SpecError
from funhooks.specs import editing, ops, spec

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _literal(hint: object) -> tuple[object, ...]:
    assert typing.get_origin(hint) is typing.Literal, hint
    return typing.get_args(hint)


def test_event_role_and_hook_are_literals_of_their_values() -> None:
    hints = typing.get_type_hints(fh.Spec)
    assert _literal(hints["event"]) == spec.EVENTS == ("forward_pre", "forward", "backward_pre", "backward", "param_grad")
    assert _literal(hints["role"]) == spec._ROLES
    assert _literal(hints["hook"]) == spec._HOOKS
    assert hints["labels"] == tuple[tuple[str, str], ...]
    assert hints["shown"] == typing.Optional[str]


def _sum(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.sum()


def test_a_function_and_an_action_are_separate_fields() -> None:
    observed = fh.observe("0", _sum)
    assert (observed.fn, observed.action) == (_sum, None)
    patched = fh.patch("0", torch.zeros(2))
    assert patched.fn is None and isinstance(patched.action, editing.Intervention) and patched.intervenes
    op_edit = fh.op_edit("0", "relu", _sum)
    assert op_edit.fn is _sum and isinstance(op_edit.action, ops.OpAction) and not op_edit.intervenes
    assert op_edit.action.kind == "edit" and op_edit.action.intervention is None
    op_patch = fh.patch("0", torch.zeros(2), op="relu")
    assert op_patch.fn is None and op_patch.intervenes
    stored = fh.outputs("0")
    assert (stored.fn, stored.action, stored.intervenes) == (None, None, False)


def test_reprs_and_equality_are_unchanged() -> None:
    assert repr(fh.op_edit("0", "relu", _sum, name="zero")) == "op_edit('0', 'relu', _sum, name='zero')"
    assert repr(fh.op_outputs("0", "relu")) == "op_outputs('0', 'relu')"
    assert repr(fh.observe("0", _sum, event="forward_pre")) == "observe('0', _sum, event='forward_pre')"
    assert repr(fh.scale("0", 2.0, op="relu")) == "scale('0', 2.0, op='relu')"
    assert fh.op_edit("0", "relu", _sum) == fh.op_edit("0", "relu", _sum)
    assert fh.observe("0", _sum).event == "forward" and fh.grads("0").hook == "output_grad"


def test_a_role_outside_the_literal_is_refused() -> None:
    with pytest.raises(SpecError, match=r"observe: a spec's `role` is one of \['output'"):
        fh.Spec(where="0", event="forward", role="outputs", name="x")  # type: ignore[arg-type]


def _positional_spec_calls(path: pathlib.Path) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Spec" and node.args]


def test_the_library_builds_every_spec_by_keyword() -> None:
    positional = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "funhooks").rglob("*.py"))
                  if (lines := _positional_spec_calls(p))}
    assert positional == {}
