"""Privacy per package: what a module offers is listed, and nothing else looks public.

The rules (docs/architecture.md, "`__all__` says what a module offers"):

1. Every name a module defines at its top level (a function, class, constant or type alias,
   not an imported name) is in the module's ``__all__`` or starts with ``_``. A name in
   ``__all__`` is re-exported by the package's face (its ``__init__``; for a top-level module,
   ``funhooks/__init__.py``), or used by another module of funhooks (the package's internal
   face: a sibling, or another package through a public module), or named in the docs: no
   name is public-looking that nothing uses.
2. No funhooks module or name is imported under another name (``from . import node as _node``).
3. Another package takes a name only from a package face or a public module of it, and only a
   name listed in that module's ``__all__`` (private modules and ``_names`` are
   tests/project/test_layout.py's check).

TypeVars are type parameters, not names a module offers, and ``Tensor = torch.Tensor`` binds an
imported name under its own name (as ``from torch import Tensor`` would): neither is counted.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layout import ROOT, _docs, _from_base, _modules, _package, _unit

# Packages left out of the checks (none: every package has had its privacy pass).
EXEMPT: tuple[str, ...] = ()
TYPE_PARAMETERS = {"TypeVar", "ParamSpec", "TypeVarTuple"}


def _exempt(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EXEMPT)


def _not_offered(value: ast.expr, name: str) -> bool:
    """`value`, bound to `name`, is `name` read off a module (``Tensor = torch.Tensor``) or a TypeVar."""
    if isinstance(value, ast.Attribute) and value.attr == name:
        return True
    return (isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute))
            and (value.func.id if isinstance(value.func, ast.Name) else value.func.attr) in TYPE_PARAMETERS)


def _defined(tree: ast.Module) -> dict[str, int]:
    """The names a module's top level defines (under `if` and `try` too), with their lines."""
    found: dict[str, int] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[node.name] = node.lineno
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Name) and not _not_offered(node.value, t.id):
                            found[t.id] = node.lineno
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if node.value is None or not _not_offered(node.value, node.target.id):
                    found[node.target.id] = node.lineno
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(part)
    visit(tree.body)
    return {n: line for n, line in found.items() if not (n.startswith("__") and n.endswith("__"))}


def _all(tree: ast.Module) -> set[str] | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
            return set(ast.literal_eval(node.value))
    return None


def _bindings(name: str, path: Path, known: set[str]) -> list[tuple[int, str, str | None, str]]:
    """Each funhooks import of a module: (line, module imported from, name taken or None for a
    module, the name it is bound to)."""
    package = _package(name, path)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _from_base(package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.append((node.lineno, sub, None, alias.asname or alias.name))
                elif base in known:
                    found.append((node.lineno, base, alias.name, alias.asname or alias.name))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None, a.asname or a.name) for a in node.names
                      if a.name in known and a.asname]
    return found


def _uses(root: Path) -> dict[str, set[str]]:
    """module -> the names other modules take from it, by import or as an attribute of it."""
    modules = _modules(root)
    used: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        bound = {}
        for _, module, taken, as_name in _bindings(name, path, set(modules)):
            if module == name:
                continue
            if taken is None:
                bound[as_name] = module
            else:
                used[module].add(taken)
        for node in _with_string_annotations(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                used[bound[node.value.id]].add(node.attr)
    return used


def _with_string_annotations(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree`, and of the expressions its strings hold (``"_shared.Cons[E]"``)."""
    nodes = list(ast.walk(tree))
    for node in list(nodes):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                nodes += ast.walk(ast.parse(node.value, mode="eval"))
            except SyntaxError:
                continue
    return nodes


def _face(module: str) -> str:
    return module.rpartition(".")[0]


def _documented(root: Path) -> set[str]:
    """Full names (``funhooks.a.b.c``) the docs and examples use: dotted ``fh.x.y`` names, and
    names taken by ``from funhooks.x import y`` or read off a module imported under a name."""
    pages = [*_docs(), *sorted((ROOT / "examples").glob("*.py"))] if root == ROOT else []
    found = set()
    for page in pages:
        text = page.read_text()
        found |= {f"funhooks{m}" for m in re.findall(r"\b(?:fh|funhooks)((?:\.\w+)+)", text)}
        for module, names in re.findall(r"from (funhooks[\w.]*) import \(?([\w ,]+)", text):
            for item in names.split(","):
                name, _, alias = item.strip().partition(" as ")
                found.add(f"{module}.{name}")
                found |= {f"{module}.{name}.{a}" for a in re.findall(rf"\b{alias or name}\.(\w+)", text)}
    return found


def _unlisted(root: Path = ROOT) -> list[str]:
    """Rule 1, first half: top-level names neither in `__all__` nor underscored."""
    wrong = []
    for name, path in _modules(root).items():
        if _exempt(name) or name == "funhooks.__main__":
            continue
        tree = ast.parse(path.read_text())
        listed = _all(tree) or set()
        wrong += [f"{path.relative_to(root)}:{line} {n}" for n, line in _defined(tree).items()
                  if not n.startswith("_") and n not in listed]
    return wrong


def _lazy(module: str) -> str:
    """``funhooks.hf`` for ``funhooks.integrations.hf``, a module the root imports when first used."""
    import funhooks

    stem = module.rpartition(".")[2]
    try:
        value = getattr(funhooks, stem)
    except (AttributeError, ImportError):
        return module
    return f"funhooks.{stem}" if getattr(value, "__name__", None) == module else module


def _unused_exports(root: Path = ROOT) -> list[str]:
    """Rule 1, second half: `__all__` names that no face re-exports, no module uses and no doc names."""
    modules, uses, documented = _modules(root), _uses(root), _documented(root)
    faces = {m: _all(ast.parse(p.read_text())) or set() for m, p in modules.items() if p.name == "__init__.py"}
    wrong = []
    for name, path in modules.items():
        if _exempt(name) or path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined = _defined(tree)
        for n in sorted(_all(tree) or ()):
            if n not in defined:
                continue  # an imported name listed again: its own module answers for it
            if (n not in faces.get(_face(name), set()) | uses[name] and f"{name}.{n}" not in documented
                    and f"{_lazy(name)}.{n}" not in documented):
                wrong.append(f"{path.relative_to(root)}: {n} (no face re-exports it, no module uses it)")
    return wrong


def _renamed(root: Path = ROOT) -> list[str]:
    """Rule 2: funhooks modules and names imported under another name."""
    modules = _modules(root)
    return [f"{path.relative_to(root)}:{line} imports {module}{'.' + taken if taken else ''} as {as_name}"
            for name, path in modules.items() if not _exempt(name)
            for line, module, taken, as_name in _bindings(name, path, set(modules))
            if as_name != (taken or module.rpartition(".")[2]) and as_name != module]


def _reached_past_the_face(root: Path = ROOT) -> list[str]:
    """Rule 3: names another package takes that its module's `__all__` does not list."""
    modules = _modules(root)
    listed = {m: _all(ast.parse(p.read_text())) for m, p in modules.items()}
    wrong = []
    for name, path in modules.items():
        if _exempt(name):
            continue
        bound = {}
        for line, module, taken, as_name in _bindings(name, path, set(modules)):
            if _unit(module) == _unit(name) or module == "funhooks":
                continue
            if taken is None:
                bound[as_name] = module
            elif taken not in (listed[module] or ()):
                wrong.append(f"{path.relative_to(root)}:{line} takes {taken} from {module}, not in its __all__")
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr not in (listed[bound[node.value.id]] or ())
                    and f"{bound[node.value.id]}.{node.attr}" not in modules and not node.attr.startswith("__")):
                wrong.append(f"{path.relative_to(root)}:{node.lineno} reads {bound[node.value.id]}.{node.attr}, "
                             "not in its __all__")
    return wrong


def test_every_top_level_name_is_listed_or_underscored() -> None:
    wrong = _unlisted()
    assert not wrong, ("list these in their module's __all__ (another module uses them) or start them with _:\n"
                       + "\n".join(wrong))


def test_every_listed_name_is_used_past_its_module() -> None:
    wrong = _unused_exports()
    assert not wrong, "nothing outside their module uses these: start them with _:\n" + "\n".join(wrong)


def test_no_module_or_name_is_imported_under_another_name() -> None:
    wrong = _renamed()
    assert not wrong, "import these under their own names:\n" + "\n".join(wrong)


def test_another_package_takes_only_what_a_module_lists() -> None:
    wrong = _reached_past_the_face()
    assert not wrong, "take these through the package's face, or list them in the module's __all__:\n" + "\n".join(wrong)


BROKEN = {
    "unlisted": {"funhooks/low/a.py": "__all__ = ['f']\ndef f(): ...\ndef helper(): ...\n"},
    "unused": {"funhooks/low/a.py": "__all__ = ['f', 'g']\ndef f(): ...\ndef g(): ...\n"},
    "renamed": {"funhooks/low/a.py": "__all__ = ['f']\ndef f(): ...\n",
                "funhooks/low/b.py": "__all__ = []\nfrom . import a as _a\n_a.f\n"},
    "past the face": {"funhooks/low/a.py": "__all__ = ['f']\nimport math\ndef f(): ...\n",
                      "funhooks/high/b.py": "__all__ = []\nfrom funhooks.low import a\na.f\na.math\n"},
}
FINE = {"funhooks/__init__.py": "", "funhooks/low/__init__.py": "__all__ = ['f']\nfrom .a import f\n",
        "funhooks/high/__init__.py": "", "funhooks/low/c.py": "import torch\nT = TypeVar('T')\nTensor = torch.Tensor\n"}


def test_the_privacy_checks_catch_what_they_guard(tmp_path: Path) -> None:
    """Each rule fails on a small package that breaks it, and only that rule."""
    for rule, files in BROKEN.items():
        root = tmp_path / rule.replace(" ", "_")
        (root / "docs").mkdir(parents=True)
        for rel, text in {**FINE, **files}.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        found = {"unlisted": bool(_unlisted(root)), "unused": bool(_unused_exports(root)),
                 "renamed": bool(_renamed(root)), "past the face": bool(_reached_past_the_face(root))}
        assert found == {r: r == rule for r in BROKEN}, (rule, found)
