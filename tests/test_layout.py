"""The package layout docs/architecture.md describes is the one the code has: every module
is in its table, imports only modules above it (so the table reads bottom-up, and no import
cycle can form), private torch APIs stay in ``_torch.py``, and no file outgrows a read."""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "funhooks"
MAX_LINES = 400
ROW = re.compile(r"^\| (`[^|]+`) \|", re.M)
NAME = re.compile(r"`([\w/]+?)(?:\.py|/)?`")
CORE_ROW = re.compile(r"\*\*the run core[^|]*?\):(.*?)\|", re.S)


def _rows() -> list[set[str]]:
    """The table's rows in order, each the set of dotted module names its first cell names;
    the `_core/` row names the subpackage and the submodules its description lists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = []
    for match in ROW.finditer(text):
        names = {"funhooks." + n.replace("/", "") for n in NAME.findall(match.group(1))}
        if "funhooks._core" in names:
            core = CORE_ROW.search(text[match.start():])
            assert core, "the `_core/` row lists its submodules after '**the run core ...**):'"
            names |= {"funhooks._core." + n for n in re.findall(r"`(\w+)` \(", core.group(1))}
        rows.append(names)
    return rows


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The funhooks modules `name` imports when it is imported (module level, outside
    ``if TYPE_CHECKING:``); imports inside functions run later and are not counted."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        statements = node.body if isinstance(node, ast.Try) else [node]
        for stmt in statements:
            if isinstance(stmt, ast.ImportFrom):
                base = stmt.module or ""
                if stmt.level:
                    parts = package.split(".")[: len(package.split(".")) - stmt.level + 1]
                    base = ".".join([*parts, stmt.module] if stmt.module else parts)
                # `from x import y`: module x.y if there is one, else a name in module x
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in stmt.names}
            elif isinstance(stmt, ast.Import):
                found |= {alias.name for alias in stmt.names}
    return {m for m in found if m in known and m != name}


def test_every_module_is_in_the_architecture_table_and_every_row_exists() -> None:
    modules = set(_modules()) - {"funhooks"}
    listed = set().union(*_rows())
    assert sorted(modules - listed) == [], "add these modules to docs/architecture.md's table"
    assert sorted(listed - modules) == [], "docs/architecture.md's table names modules that do not exist"


def test_modules_import_only_modules_above_them_in_the_table() -> None:
    """Module-level imports follow the table (a row may import its own row's modules), so
    the table is a reading order and the import graph has no cycle."""
    modules = _modules()
    rank = {name: i for i, row in enumerate(_rows()) for name in row}
    graph = {name: _imports(name, path, set(modules)) - {"funhooks"} for name, path in modules.items()}
    wrong = sorted(f"{name} imports {dep}" for name, deps in graph.items() if name in rank
                   for dep in deps if rank[dep] > rank[name])
    assert not wrong, "move these modules' rows in docs/architecture.md, or the imports:\n" + "\n".join(wrong)
    tuple(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle


def _private_torch(tree: ast.AST) -> list[str]:
    """Dotted torch names in `tree` with a private part (`torch._C`, `torch.utils._pytree`,
    `nn.Module._call_impl`) or reaching `torch.utils.hooks`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = ast.unparse(node)
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
            "y = torch.utils.hooks.RemovableHandle\nz = torch.nn.functional.relu\nv = torch.__version__\n")
    assert [f.split(": ")[1] for f in _private_torch(ast.parse(code))] == [
        "torch.utils._pytree", "torch._C._functorch", "nn.Module._call_impl", "torch.utils.hooks.RemovableHandle",
        "torch.utils.hooks",
    ]


def test_no_file_is_longer_than_a_read() -> None:
    files = [p for d in ("funhooks", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these files (at most {MAX_LINES} lines each, one concept per module): {long}"
