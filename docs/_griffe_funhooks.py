"""A Griffe extension for the API site (mkdocs.yml): three habits of funhooks' sources that
Griffe's static analysis does not know.

- Docstrings title their doctests ``Example:``, which Griffe's Google parser reads as an
  admonition (Markdown, where ``rec["fc"]["output"]`` is a link); renamed ``Examples:``, they
  render as code. Sphinx roles (``:class:`Record```) become plain code spans.
- Parameters that share a description are documented together (``rtol, atol: ...``); Google
  style has one name an entry, so each name gets the entry.
- Value classes are ``attrs`` classes, whose ``__init__`` attrs writes at import: rebuilt here
  from the fields (order, ``kw_only``, ``init=False``, defaults, ``alias``, a private field's
  public name) so the site shows their signatures and checks their ``Args:`` against them.
- Many public classes derive from private ones (``_frozen.Frozen``): those bases are left
  out of the "Bases:" line, which would name what a reader cannot look up.

Griffe calls the hooks by name and Griffe is imported inside them, so pytest can collect this
file where Griffe is not installed.
"""

import re
from typing import Any

_EXAMPLE = re.compile(r"^Example:$", re.M)
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")
_SECTION = re.compile(r"^(Args|Arguments|Parameters):$")
_GROUP = re.compile(r"^(\s+)(\**\w+(?:, \**\w+)+):(.*)$")


def _split_groups(text: str) -> str:
    """``a, b: text`` in an ``Args:`` section as one entry per name, each with the text (the
    sources group parameters that share a description; Google style has one name an entry)."""
    lines, out, in_args, i = text.split("\n"), [], False, 0
    while i < len(lines):
        line = lines[i]
        if line and not line[0].isspace():
            in_args = bool(_SECTION.match(line))
        match = _GROUP.match(line) if in_args else None
        if match is None:
            out.append(line)
            i += 1
            continue
        indent, names, first = match.groups()
        block = [first]
        i += 1
        while i < len(lines) and lines[i].startswith(indent + " "):
            block.append("\n" + lines[i])
            i += 1
        out += [f"{indent}{name}:{''.join(block)}" for name in names.split(", ")]
    return "\n".join(out)


def _decorator_call(cls: Any) -> Any:
    """The class's ``@attrs.frozen`` / ``@attrs.define`` (or ``attr.s``) decorator, or None."""
    for decorator in cls.decorators:
        path = getattr(decorator.value, "canonical_path", str(decorator.value))
        if path.split("(")[0] in {"attrs.frozen", "attrs.define", "attrs.mutable", "attr.s", "attr.attrs"}:
            return decorator.value
    return None


def _keywords(expr: Any) -> dict[str, Any]:
    """The keyword arguments of a call expression, by name."""
    import griffe

    if not isinstance(expr, griffe.ExprCall):
        return {}
    return {a.name: a.value for a in expr.arguments if isinstance(a, griffe.ExprKeyword)}


def _fields(cls: Any, class_kw_only: bool) -> list[Any]:
    """The ``__init__`` parameters of one attrs class's own fields, in definition order."""
    import griffe

    params = []
    for member in cls.members.values():
        if member.is_alias or not member.is_attribute or member.annotation is None:
            continue
        if "property" in member.labels or ("class-attribute" in member.labels
                                           and "instance-attribute" not in member.labels):
            continue  # a property or a ClassVar
        value = member.value
        field = _keywords(value) if getattr(value, "canonical_path", "") in {"attrs.field", "attr.ib"} else None
        if field is not None and str(field.get("init")) == "False":
            continue
        if field is None:
            default = value
        elif "default" in field:
            default = field["default"]
        elif "factory" in field:
            default = griffe.ExprCall(function=field["factory"], arguments=[])
        else:
            default = None
        kw_only = class_kw_only or (field is not None and str(field.get("kw_only")) == "True")
        name = str(field["alias"]).strip("'\"") if field and "alias" in field else member.name.lstrip("_")
        kind = griffe.ParameterKind.keyword_only if kw_only else griffe.ParameterKind.positional_or_keyword
        params.append(griffe.Parameter(name, annotation=member.annotation, kind=kind, default=default))
    return params


def _set_attrs_init(cls: Any) -> None:
    """Give an attrs class without an ``__init__`` of its own the one attrs writes."""
    import griffe

    if "__init__" in cls.members or _decorator_call(cls) is None:
        return
    try:
        mro = [c for c in reversed(cls.mro()) if _decorator_call(c) is not None]
    except ValueError:
        mro = []
    params: dict[str, Any] = {}
    for c in [*mro, cls]:
        kw_only = str(_keywords(_decorator_call(c)).get("kw_only")) == "True"
        params.update({p.name: p for p in _fields(c, kw_only)})
    ordered = sorted(params.values(), key=lambda p: p.kind is griffe.ParameterKind.keyword_only)
    self_param = griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)
    init = griffe.Function("__init__", lineno=0, endlineno=0, parent=cls,
                           parameters=griffe.Parameters(self_param, *ordered), returns="None")
    cls.set_member("__init__", init)


def _walk(obj: Any, seen: set[str]) -> None:
    if obj.is_alias or obj.path in seen:
        return
    seen.add(obj.path)
    if obj.docstring is not None:
        obj.docstring.value = _split_groups(_ROLE.sub(r"`\1`", _EXAMPLE.sub("Examples:", obj.docstring.value)))
    if obj.is_class:
        _set_attrs_init(obj)
    for member in list(obj.members.values()):
        _walk(member, seen)


def _public_bases(obj: Any, seen: set[str]) -> None:
    """Leave out of each class's "Bases:" line the private ones (``funhooks._frozen.Frozen``,
    ``_AttentionOp``): a reader cannot look them up, and the public API does not name them.
    Run after every ``__init__`` is written, which reads the full bases."""
    if obj.is_alias or obj.path in seen:
        return
    seen.add(obj.path)
    if obj.is_class:
        obj.bases = [base for base in obj.bases if not any(
            part.startswith("_") for part in str(getattr(base, "canonical_path", base)).split("."))]
    for member in list(obj.members.values()):
        _public_bases(member, seen)


class FunhooksSources:
    """The hook Griffe runs once the whole package is loaded."""

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        """Rename the example sections, write the attrs classes' ``__init__``, and leave the
        private bases out."""
        _walk(pkg, set())
        _public_bases(pkg, set())
