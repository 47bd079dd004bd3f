"""Dependency direction: a module imports only from the layers below its own (ALLOWED), no two modules
import each other (the module graph has no cycle), and nothing but the command line imports cli.py.
Every import counts, including those inside functions and under TYPE_CHECKING."""
from __future__ import annotations

import ast
from pathlib import Path

import specserve

ROOT = Path(specserve.__file__).parent

# layer (a top-level module or package of specserve) → the layers it may import
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "detokenizer": set(),
    "types": {"detokenizer"},
    "drafters": {"config"},
    "native": set(),
    "quantization": {"loader", "native"},
    "kv_pages": {"config", "native"},
    "loader": {"config"},
    "sampling": {"types", "native"},
    "grammar": {"types"},
    "attention": {"kv_pages", "native"},
    "radix_cache": {"kv_pages"},
    "distributed": {"config"},
    "models": {"config", "kv_pages", "attention", "loader", "native", "quantization", "distributed"},
    "scheduler": {"config", "types", "kv_pages", "radix_cache"},
    "runner": {"types", "kv_pages", "attention", "models"},
    "speculative": {"config", "types", "kv_pages", "attention", "loader", "models", "runner", "sampling",
                    "quantization"},
    "engine": {"config", "detokenizer", "drafters", "types", "kv_pages", "loader", "models", "quantization",
               "radix_cache", "runner", "sampling", "scheduler", "speculative", "grammar"},
    "datasets": {"loader"},
    "server": {"specserve", "config", "types", "loader", "engine", "grammar", "radix_cache", "distributed"},
    "bench": {"config", "types", "loader", "datasets", "engine"},
    "train": {"config", "types", "kv_pages", "attention", "loader", "models", "datasets", "engine", "quantization"},
    "demo": {"types", "engine", "drafters"},
    "specserve": {"types", "engine"},       # the package's own __init__: the public API
}
ALLOWED["cli"] = set(ALLOWED) - {"cli", "specserve", "demo"}


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def imported(module: str) -> set[str]:
    """The specserve modules `module` imports (`from pkg import sub` counts as importing pkg.sub)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or {node.module}
            if len(subs) < len(node.names):
                found.add(node.module)
    return found - {module}


GRAPH = {m: imported(m) for m in MODULES}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "specserve"


def test_every_module_belongs_to_a_known_layer():
    assert {layer(m) for m in MODULES} <= ALLOWED.keys()


def test_modules_import_only_the_layers_below_them():
    wrong = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps
                   if layer(d) != layer(m) and layer(d) not in ALLOWED[layer(m)])
    assert not wrong, wrong


def test_nothing_but_the_command_line_imports_it():
    assert [m for m, deps in GRAPH.items() if "specserve.cli" in deps] == []


def test_no_two_modules_import_each_other_even_through_others():
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if module in done:
            return
        for dep in sorted(GRAPH[module]):
            visit(dep, path + [module])
        done.add(module)

    for module in sorted(GRAPH):
        visit(module, [])


def test_a_cycle_and_an_upward_import_would_be_caught(monkeypatch):
    monkeypatch.setitem(GRAPH, "specserve.config", {"specserve.engine"})
    try:
        test_no_two_modules_import_each_other_even_through_others()
    except AssertionError as exc:
        assert "specserve.config -> specserve.engine" in str(exc)
    else:
        raise AssertionError("the cycle config -> engine -> config went unnoticed")
    try:
        test_modules_import_only_the_layers_below_them()
    except AssertionError as exc:
        assert "specserve.config imports specserve.engine" in str(exc)
    else:
        raise AssertionError("config importing the engine went unnoticed")
