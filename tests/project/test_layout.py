"""The package layout docs/architecture.md describes is the one the code has.

The map's table has one row per package (and per top-level module), with what it may import.
These tests hold the code to it: every module belongs to a row, every import (module level,
inside functions and under ``TYPE_CHECKING`` alike) goes only to its own unit or to a unit the
row allows, private modules and names stay inside their package, no import cycle forms (type-only
imports count), private torch APIs stay in ``_torch.py``, and no file outgrows a read.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "funhooks"
MAX_LINES = 600
MAX_TOP_MODULES = 12
TORCH_INTERNALS = {"_modules", "_parameters", "_buffers", "_call_impl", "_compiled_call_impl",
                   "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"}


def _units(root: Path = ROOT) -> dict[str, set[str]]:
    """The map's rows: unit (``records``, ``errors``, ...) -> the units it may import."""
    units = {}
    for line in (root / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and re.fullmatch(r"`[\w/.]+`", cells[0]):
            name = cells[0].strip("`").removesuffix("/").removesuffix(".py")
            units[name] = {n.removesuffix("/").removesuffix(".py") for n in re.findall(r"`([\w/.]+)`", cells[2])}
    return units


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "funhooks").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _from_base(package: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in `package` takes its names from."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*parts, node.module] if node.module else parts)


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every funhooks import of `name`, anywhere in its source: (line, module, names taken)."""
    package = _package(name, path)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _from_base(package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub, ()) if sub in known else (node.lineno, base, (alias.name,)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
    return [(line, m, names) for line, m, names in found if m in known and m != name]


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.endswith("__")


def test_every_unit_is_a_row_of_the_map_and_every_row_exists() -> None:
    units = {_unit(m) for m in _modules()} - {"", "__main__"}
    rows = set(_units())
    assert sorted(units - rows) == [], "add these packages or modules to docs/architecture.md's table"
    assert sorted(rows - units) == [], "docs/architecture.md's table names units that do not exist"


def _import_violations(root: Path = ROOT) -> list[str]:
    units, modules = _units(root), _modules(root)
    wrong = []
    for name, path in modules.items():
        unit = _unit(name)
        if unit in ("", "__main__"):
            continue  # the package's face re-exports everything
        for line, dep, _ in _imports(name, path, set(modules)):
            if _unit(dep) not in {unit, "", *units.get(unit, ())}:
                wrong.append(f"{path.relative_to(root)}:{line} imports {dep} ({unit} may import {sorted(units.get(unit, ()))})")
    return wrong


def test_imports_follow_the_map() -> None:
    """A module imports its own unit and the units its row allows, nothing else: the rows
    read bottom-up, so no import runs back up a layer, inside functions included."""
    wrong = _import_violations()
    assert not wrong, "an import the map does not allow:\n" + "\n".join(wrong)


def _private_violations(root: Path = ROOT) -> list[str]:
    modules = _modules(root)
    wrong = []
    for name, path in modules.items():
        package = _package(name, path)
        imported: set[str] = set()
        for line, dep, names in _imports(name, path, set(modules)):
            parts = dep.split(".")
            owners = [".".join(parts[:i]) for i, part in enumerate(parts) if _is_private(part)]
            if any(package != owner and not package.startswith(owner + ".") for owner in owners):
                wrong.append(f"{path.relative_to(root)}:{line} imports private module {dep}")
            wrong += [f"{path.relative_to(root)}:{line} imports private name {n} from {dep}" for n in names
                      if _is_private(n)]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("funhooks")):
                imported |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("funhooks")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                    and _is_private(node.attr)):
                wrong.append(f"{path.relative_to(root)}:{node.lineno} reads {node.value.id}.{node.attr}")
    return wrong


def test_private_modules_and_names_stay_in_their_package() -> None:
    """A `_x` module is imported only inside the package that holds it, a `_name` is taken only
    from its own module, and no attribute `_name` is read off something imported from another
    module (`Record._trusted`, `run._as_specs`)."""
    wrong = _private_violations()
    assert not wrong, "private code used outside its home:\n" + "\n".join(wrong)


def _import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {dep for _, dep, _ in _imports(name, path, set(modules))}
        graph[name] = {d for d in deps if not name.startswith(d + ".")} - {"funhooks"}
    return graph


def test_no_import_cycle() -> None:
    """The import graph, counting imports inside functions and type-only ones, has no cycle."""
    tuple(graphlib.TopologicalSorter(_import_graph()).static_order())  # raises CycleError on a cycle


def test_the_top_level_holds_few_modules_and_no_alias_tricks() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP_MODULES, f"group these top-level modules into packages: {top}"
    assert "sys.modules" not in (PACKAGE / "__init__.py").read_text()


def test_no_public_name_shadows_a_submodule() -> None:
    """`fh.fold` is a function and there is no module `funhooks.fold`: a package's
    re-exported names and its submodules' names never coincide."""
    import importlib

    clashes = []
    for init in PACKAGE.rglob("__init__.py"):
        package = ".".join(init.relative_to(ROOT).parent.parts)
        subs = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if name in subs and getattr(value, "__name__", None) != f"{package}.{name}":
                clashes.append(f"{package}.{name}")
    assert not clashes, f"these names hide a submodule of the same name: {clashes}"


def _private_torch(tree: ast.AST) -> list[str]:
    """Dotted torch names in `tree` with a private part (`torch._C`, `torch.utils._pytree`,
    `nn.Module._call_impl`) or reaching `torch.utils.hooks`, and reads of a module's own
    tables (`m._modules`, `m._parameters`, `m._buffers`, `m._call_impl`, its hook dicts)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = ast.unparse(node)
            if node.attr in TORCH_INTERNALS:
                found.append(f"line {node.lineno}: {name}")
                continue
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            name = ".".join([node.module or "", *(a.name for a in node.names)])
        elif isinstance(node, ast.Import):
            name = ".".join(a.name for a in node.names)
        else:
            continue
        parts = name.split(".")
        if parts[0] not in {"torch", "nn"}:
            continue
        private = any(p.startswith("_") and not p.endswith("__") for p in parts)
        if private or "torch.utils.hooks" in name:
            found.append(f"line {node.lineno}: {name}")
    return found


def test_private_torch_apis_are_used_only_in_the_torch_module() -> None:
    used = {name: _private_torch(ast.parse(path.read_text())) for name, path in _modules().items()
            if name != "funhooks._torch"}
    assert {name: found for name, found in used.items() if found} == {}, "move these into funhooks/_torch.py"


def test_the_private_api_check_sees_the_usual_spellings() -> None:
    code = ("import torch.utils._pytree as p\nfrom torch._C import _functorch\nx = nn.Module._call_impl\n"
            "y = torch.utils.hooks.RemovableHandle\nz = torch.nn.functional.relu\nv = torch.__version__\n"
            "w = model._modules\n")
    assert sorted(f.split(": ")[1] for f in _private_torch(ast.parse(code))) == sorted([
        "torch.utils._pytree", "torch._C._functorch", "nn.Module._call_impl", "torch.utils.hooks.RemovableHandle",
        "torch.utils.hooks", "model._modules",
    ])


BROKEN = {
    "up": {"funhooks/low/__init__.py": "", "funhooks/low/a.py": "def f():\n    from funhooks.high import b\n",
           "funhooks/high/__init__.py": "", "funhooks/high/b.py": ""},
    "private module": {"funhooks/low/__init__.py": "", "funhooks/low/_x.py": "",
                       "funhooks/high/__init__.py": "", "funhooks/high/b.py": "from funhooks.low import _x\n"},
    "private name": {"funhooks/low/__init__.py": "", "funhooks/low/a.py": "def _f(): ...\n",
                     "funhooks/high/__init__.py": "", "funhooks/high/b.py": "from funhooks.low.a import _f\n"},
    "private attribute": {"funhooks/low/__init__.py": "", "funhooks/low/a.py": "class A:\n    _f = 1\n",
                          "funhooks/high/__init__.py": "", "funhooks/high/b.py": "from funhooks.low.a import A\nA._f\n"},
    "cycle": {"funhooks/low/__init__.py": "", "funhooks/low/a.py": "from . import c\n",
              "funhooks/low/c.py": "if TYPE_CHECKING:\n    from . import a\n"},
}
MAP = "| unit | holds | may import |\n|---|---|---|\n| `low/` | x | |\n| `high/` | y | `low/` |\n"


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_the_layout_checks_catch_what_they_guard(rule: str, tmp_path: Path) -> None:
    """Each rule fails on a small package that breaks it, and only that rule: no check here
    passes vacuously."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(MAP)
    for rel, text in BROKEN[rule].items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert _units(tmp_path) == {"low": set(), "high": {"low"}}
    found = {
        "up": bool(_import_violations(tmp_path)),
        "private": bool(_private_violations(tmp_path)),
        "cycle": not _acyclic(_import_graph(tmp_path)),
    }
    assert found == {"up": rule == "up", "private": rule.startswith("private"), "cycle": rule == "cycle"}


def _acyclic(graph: dict[str, set[str]]) -> bool:
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError:
        return False
    return True


def test_no_file_is_longer_than_a_read() -> None:
    files = [p for d in ("funhooks", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"find the second idea in these files (at most {MAX_LINES} lines each): {long}"


DOC_PATH = re.compile(r"`(funhooks/[\w/]*?(?:\.py|/))`")
DOC_NAME = re.compile(r"\b((?:fh|funhooks)(?:\.\w+)+)")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _resolves(name: str) -> bool:
    """Whether a dotted ``fh.x.y`` / ``funhooks.x.y`` name is a module or an attribute of one
    (a method or attribute of a value, ``fh.Record.load``, is left to its doctest)."""
    import importlib

    import funhooks

    parts = name.split(".")[1:]
    obj: object = funhooks
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:  # a submodule not imported by its package
            obj = importlib.import_module(".".join(["funhooks", *parts[: i + 1]]))
        except ImportError:
            return i > 0 and not isinstance(obj, type(funhooks))
    return True


def test_docs_name_only_paths_and_names_that_exist() -> None:
    """Every `funhooks/...` file or folder the docs name exists, and every dotted
    ``fh.x.y`` / ``funhooks.x.y`` name they use resolves (so no page points at a module that
    moved)."""
    missing = []
    for page in _docs():
        text = page.read_text()
        missing += [f"{page.name}: {p}" for p in DOC_PATH.findall(text) if not (ROOT / p).exists()]
        missing += [f"{page.name}: {name}" for name in sorted(set(DOC_NAME.findall(text))) if not _resolves(name)]
    assert not missing, "the docs name what does not exist:\n" + "\n".join(sorted(missing))


def test_docs_outside_the_map_name_no_private_module() -> None:
    """Pages for users point at public modules only; the map (architecture.md) alone
    describes the private ones."""
    private = []
    for page in _docs():
        if page.name == "architecture.md":
            continue
        text = page.read_text()
        names = DOC_PATH.findall(text) + DOC_NAME.findall(text)
        private += [f"{page.name}: {n}" for n in names
                    if any(_is_private(p) for p in re.split(r"[./]", n.removesuffix(".py")) if p)]
    assert not private, "point these at public names, or describe them in architecture.md:\n" + "\n".join(private)


def test_every_public_name_is_defined_in_a_public_module() -> None:
    """What `fh.*`, `fh.testing.*` and each package's face export is defined in a module
    without an underscore (the underscore never hides public API)."""
    import importlib

    faces = ["funhooks", *(f"funhooks.{p.name}" for p in sorted(PACKAGE.iterdir()) if (p / "__init__.py").exists())]
    hidden = []
    for face in faces:
        module = importlib.import_module(face)
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            home = getattr(value, "__module__", None) or getattr(value, "__name__", "")
            if isinstance(home, str) and any(_is_private(p) for p in home.split(".")):
                hidden.append(f"{face}.{name} lives in {home}")
    assert not hidden, "move these into public modules:\n" + "\n".join(hidden)


MAX_ANY_PER_1000_LINES = 20


def test_any_stays_rare() -> None:
    """`Any` is kept for the user's own data (what a hook returns, a batch), not for types
    the library knows: fewer than 20 per 1,000 lines of the package."""
    count = lines = 0
    for path in _modules().values():
        text = path.read_text()
        lines += len(text.splitlines())
        count += sum(isinstance(n, ast.Name) and n.id == "Any" or isinstance(n, ast.Attribute) and n.attr == "Any"
                     for n in ast.walk(ast.parse(text)))
    assert count * 1000 < MAX_ANY_PER_1000_LINES * lines, f"{count} `Any` in {lines} lines: name the types"


def test_each_row_of_the_map_names_exactly_its_units_modules() -> None:
    """A package's row names every module and subfolder it holds (``writer.py``, ``_core/``)
    and nothing it does not: the map stays true file by file."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    wrong = []
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 3 or not re.fullmatch(r"`\w+/`", cells[0]):
            continue
        folder = PACKAGE / cells[0].strip("`/")
        named = {n for n in re.findall(r"`([\w/]+?(?:\.py|/))`", cells[1])
                 if "/" not in n.rstrip("/") and n not in ("__init__.py", cells[0].strip("`"))}
        held = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        held |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").exists()}
        wrong += [f"{cells[0]} names {n}, which it does not hold" for n in sorted(named - held)]
        wrong += [f"{cells[0]} holds {n}, which its row does not name" for n in sorted(held - named)]
    assert not wrong, "bring docs/architecture.md's rows up to date:\n" + "\n".join(wrong)


# -- the tests mirror the packages -----------------------------------------------------------

OWN_TEST_FOLDERS = {
    "field": "regressions from the field reports, tests/field/test_<package>_<topic>.py",
    "project": "the project's own checks (docs, examples, layout, typing, benchmarks, top-level modules)",
}
WHERE_TESTS_GO = ("tests/<package>/test_<module>[_<topic>].py for a module of funhooks/<package>/ "
                  "(or test_<package>[_<topic>].py for the package as a whole), "
                  + "; ".join(f"tests/{name}/ for {what}" for name, what in OWN_TEST_FOLDERS.items()))


def _test_file_violations(root: Path = ROOT) -> list[str]:
    """Test files outside the folder of the package they test, or under a name it does not hold."""
    packages = {p.name: p for p in sorted((root / "funhooks").iterdir()) if (p / "__init__.py").exists()}
    tests = root / "tests"
    wrong = [f"{p.relative_to(root)}: test files are imported by their own name (a rank script pickles under "
             "it), so tests/ holds no packages: remove it" for p in sorted(tests.rglob("__init__.py"))]
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        rel, parts = path.relative_to(root), path.relative_to(tests).parts
        if len(parts) != 2 or (parts[0] not in packages and parts[0] not in OWN_TEST_FOLDERS):
            wrong.append(f"{rel}: move it (git mv) to {WHERE_TESTS_GO}; the packages: {sorted(packages)}")
            continue
        folder, stem = parts[0], path.stem.removeprefix("test_")
        if folder in packages:
            names = {folder} | {p.stem.lstrip("_") for p in packages[folder].rglob("*.py") if p.stem != "__init__"}
            names |= {p.name.lstrip("_") for p in packages[folder].rglob("*") if (p / "__init__.py").exists()}
        else:
            names = set(packages) if folder == "field" else {stem}
        if not any(stem == n or stem.startswith(n + "_") for n in names):
            wrong.append(f"{rel}: name it test_<module>[_<topic>].py after the module it tests, one of {sorted(names)}")
        if path.name in seen:
            wrong.append(f"{rel}: {seen[path.name].relative_to(root)} has this name; pytest imports both as "
                         f"{path.stem}: give one another topic")
        seen.setdefault(path.name, path)
    return wrong


def test_the_tests_mirror_the_packages() -> None:
    """A test file lives in tests/<package>/ for the funhooks package it tests and is named after
    one of its modules, or in tests/field/ or tests/project/; no flat tests/test_*.py."""
    wrong = _test_file_violations()
    assert not wrong, "put these test files where their package's tests are:\n" + "\n".join(wrong)


def test_the_test_layout_check_catches_what_it_guards(tmp_path: Path) -> None:
    for rel in ("funhooks/records/__init__.py", "funhooks/records/record.py", "funhooks/records/_file.py",
                "tests/helpers.py", "tests/records/test_record.py", "tests/records/test_record_save.py",
                "tests/records/test_file.py", "tests/records/test_records.py", "tests/field/test_records_copies.py",
                "tests/project/test_docs.py", "tests/test_flat.py", "tests/records/test_nothing.py",
                "tests/field/test_copies.py", "tests/runs/test_run.py", "tests/records/deeper/test_record_x.py",
                "tests/project/test_record.py", "tests/store/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    flagged = sorted({w.split(":")[0] for w in _test_file_violations(tmp_path)})
    assert flagged == ["tests/field/test_copies.py", "tests/records/deeper/test_record_x.py", "tests/records/test_nothing.py",
                       "tests/records/test_record.py", "tests/runs/test_run.py", "tests/store/__init__.py",
                       "tests/test_flat.py"]  # test_record.py: its name is project/test_record.py's too


# -- docstrings and comments name what exists ------------------------------------------------

SOURCE_PATH = re.compile(r"(?<![\w/.])(funhooks/[\w/.]*\w/?)")
SOURCE_MODULE = re.compile(r":mod:`~?([\w.]+)`")
TEST_PATH = re.compile(r"(?<![\w/.])(tests/[\w/]+\.py)")


def _prose(path: Path) -> str:
    """The docstrings (of modules, classes, functions and attributes) and comments of a source file."""
    import io
    import tokenize

    tree = ast.parse(path.read_text())
    strings = [n.value.value for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
               and isinstance(n.value.value, str)]
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                if t.type == tokenize.COMMENT]
    return "\n".join(strings + comments)


def _stale_names(name: str, text: str, root: Path = ROOT) -> list[str]:
    """What `text` (the prose of `name`) names that does not exist: dotted ``funhooks.x.y`` names,
    ``:mod:`` targets that are not modules, ``funhooks/...`` source paths (a folder written with
    its slash; a path whose first part is no module is a name of another kind, a logger's tag) and
    ``tests/...py`` files."""
    import importlib

    stale = [f"{name}: {n}" for n in sorted(set(DOC_NAME.findall(text))) if not _resolves(n)]
    for module in sorted(set(SOURCE_MODULE.findall(text))):
        try:
            importlib.import_module(module)
        except ImportError:
            stale.append(f"{name}: :mod:`{module}` (not a module)")
    held = {p.stem for p in (root / "funhooks").iterdir()}
    for p in sorted(set(SOURCE_PATH.findall(text))):
        first = p.split("/")[1].removesuffix(".py")
        if p.endswith((".py", "/")) or first in held or first.startswith("_"):
            if not p.endswith((".py", "/")) or not (root / p).exists():
                stale.append(f"{name}: {p} (write a file as funhooks/x.py, a folder as funhooks/x/, and name what exists)")
    stale += [f"{name}: {p}" for p in sorted(set(TEST_PATH.findall(text))) if not (root / p).exists()]
    return stale


def test_docstrings_and_comments_name_only_modules_and_paths_that_exist() -> None:
    """The prose of funhooks/ (and of benchmarks/) points at modules, names and files that exist,
    as the docs do: no `funhooks.fold` module, no `funhooks/_core` folder, no test file that moved."""
    stale = []
    for path in sorted([*(ROOT / "funhooks").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        stale += _stale_names(str(path.relative_to(ROOT)), _prose(path))
    for page in [*_docs(), *sorted((ROOT / "benchmarks").glob("*.md"))]:
        stale += _stale_names(str(page.relative_to(ROOT)), page.read_text())
    assert not stale, "point these at what exists now:\n" + "\n".join(stale)


def test_the_stale_name_check_catches_what_it_guards() -> None:
    text = ("see :mod:`funhooks.fold` and ``funhooks/_core``, funhooks.no_such_thing, tests/test_moved.py;\n"
            "fine: :mod:`funhooks.training.folds`, fh.fold, fh.Record.load, ``funhooks/runs/_core/``,\n"
            "funhooks/errors.py, the tag ``funhooks/loss/ema``, tests/project/test_layout.py\n")
    assert [s.split(": ", 1)[1].split(" (")[0] for s in _stale_names("x", text)] == [
        "funhooks.no_such_thing", ":mod:`funhooks.fold`", "funhooks/_core", "tests/test_moved.py"]


# -- functions a newcomer can read -------------------------------------------------------------

CORE = PACKAGE / "runs" / "_core"
MAX_CORE_COMPLEXITY = 12  # McCabe, counted as radon counts it
MAX_CORE_BODY = 50  # lines of a function's body in the run core, its docstring left out
MAX_BODY = 60  # lines of a function's body anywhere in the package ...
MAX_LONG_BODIES = 2  # ... but for this many


def _complexity(fn: ast.AST, closures: bool = False) -> int:
    """McCabe complexity as radon counts it; nested functions, lambdas and classes count on their
    own, or (`closures`) as part of the function that makes them: a function returning one of
    several closures holds all their paths."""
    count, stack = 1, list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if not closures and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.If, ast.IfExp, ast.Assert, ast.match_case)):
            count += 1
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            count += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try):
            count += len(node.handlers) + bool(node.orelse)
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        stack.extend(ast.iter_child_nodes(node))
    return count


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1:
        body = body[1:]  # the docstring
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1


def _functions(root: Path) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    return [(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node)
            for path in sorted(root.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_run_core_has_no_function_too_branched_or_too_long_to_read() -> None:
    """Every module call runs through `runs/_core`: each of its functions fits a screen and a
    handful of paths, the closures it makes counted in (issue 37's targets)."""
    branched = [f"{name} (complexity {c}, its closures counted)" for name, fn in _functions(CORE)
                if (c := _complexity(fn, closures=True)) > MAX_CORE_COMPLEXITY]
    long = [f"{name} ({n} lines)" for name, fn in _functions(CORE) if (n := _body_lines(fn)) > MAX_CORE_BODY]
    assert not branched + long, (
        f"split these run-core functions into their steps (complexity <= {MAX_CORE_COMPLEXITY}, "
        f"<= {MAX_CORE_BODY} lines): {branched + long}")


def test_at_most_two_functions_of_the_package_are_long() -> None:
    long = [f"{name} ({n} lines)" for name, fn in _functions(PACKAGE) if (n := _body_lines(fn)) > MAX_BODY]
    assert len(long) <= MAX_LONG_BODIES, f"more than {MAX_LONG_BODIES} functions over {MAX_BODY} lines: {long}"


def test_the_complexity_count_agrees_with_mccabe_on_known_shapes() -> None:
    src = ("def f(x, y):\n"
           "    if x and y:\n        return [i for i in x if i]\n"
           "    for i in x:\n        pass\n    else:\n        pass\n"
           "    try:\n        pass\n    except ValueError:\n        pass\n"
           "    def inner():\n        if x:\n            pass\n"
           "    return 1 if y else 2\n")
    fn = ast.parse(src).body[0]
    # if +1, and +1, comprehension +2, for/else +2, except +1, ternary +1; `inner` counts on its own
    assert _complexity(fn) == 9
    assert _complexity(fn, closures=True) == 10  # with `inner`'s if
