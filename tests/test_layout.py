"""The house: no module of engine/ or server/ imports in a circle, no floor imports one above it
(the engine never imports the server), no file grows past about 350 lines, and the tree stays
readable: a short engine root, the product's benchmarks apart from the studies."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "server")
MAX_LINES = 360


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The project modules ``path`` imports, anywhere in it but under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def graph() -> dict[str, set[str]]:
    files = [path for package in PACKAGES for path in (REPO / package).rglob("*.py")]
    modules = {module_name(path): path for path in files}
    return {name: {dep for dep in imports(path) if dep in modules and dep != name} for name, path in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    assert cycle(graph()) is None


def test_the_circle_check_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


# The floors, lowest first: a module may import its own floor and those below, never one above.
# engine's root (the speculative step, the request and its sampling, the drafters, the engine thread)
# is floor 3; errors and config are the foundation every floor reads.
FLOORS = {"engine.errors": 0, "engine.config": 0, "engine.cpu": 1, "engine.model": 2, "engine.training": 4, "server": 5}


def floor(module: str) -> int:
    found = [level for prefix, level in FLOORS.items() if module == prefix or module.startswith(prefix + ".")]
    return max(found) if found else 3


def test_no_import_runs_back_up():
    upward = sorted((name, dep) for name, deps in graph().items() for dep in deps if floor(dep) > floor(name))
    assert not upward


def test_the_floor_check_finds_an_upward_import():
    assert floor("engine.cpu.blocks") < floor("engine.model.model") < floor("engine.engine")
    assert floor("engine.drafters.eagle3_head") == floor("engine.spec") < floor("engine.training.eagle3")
    assert floor("engine.config") < floor("engine.cpu.matmul") and floor("server.app") > floor("engine.factory")


def test_the_tree_stays_readable():
    engine_root = [path.name for path in (REPO / "engine").glob("*.py")]
    bench_top = [path.name for path in (REPO / "bench").iterdir() if path.suffix in {".py", ".sh"}]
    results = [path.name for path in (REPO / "bench" / "results").iterdir() if not path.name.startswith("quick.")]
    assert len(engine_root) <= 16, sorted(engine_root)
    assert len(bench_top) <= 8, sorted(bench_top)
    assert len(results) <= 30, sorted(results)


def test_no_file_does_several_jobs_by_its_size():
    long = {
        str(path.relative_to(REPO)): count
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long
