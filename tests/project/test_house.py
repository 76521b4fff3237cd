"""The house rules of the code under app/, worker/ and trainyard/, measured with `ast`: small modules,
short functions, no import cycle among the trainyard.* modules (an import inside a function counts: it
only defers the cycle), and one name per module: app/ and worker/ are trainyard.app and trainyard.worker,
never imported as top-level `app` or `worker`."""
import ast
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.service import ROOT

MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60
# The folders of the package and the dotted name each stands for. trainyard/app and trainyard/worker are
# links to app/ and worker/: walking trainyard/ does not follow them, so each file is read once.
PACKAGES = {"app": "trainyard.app", "worker": "trainyard.worker", "trainyard": "trainyard"}
# Where an import of top-level `app` or `worker` could hide, besides the package itself.
OTHER_CODE = ["tests", "bench", "examples", "docker"]


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int


def python_files(top: Path) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(top):  # followlinks=False: trainyard/app is app/, read from there
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [Path(folder, f) for f in sorted(files) if f.endswith(".py")]
    return found


@functools.cache
def modules() -> dict[str, Module]:
    out = {}
    for top, package in PACKAGES.items():
        for path in python_files(ROOT / top):
            parts = list(path.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            source = path.read_text()
            out[".".join([package, *parts])] = Module(".".join([package, *parts]), path, ast.parse(source),
                                                      len(source.splitlines()))
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def imported(module: Module) -> set[str]:
    """Every dotted name the module imports, at any depth of its code: `from a.b import c` gives a.b
    and a.b.c (c may be a module)."""
    names = set()
    is_package = module.path.name == "__init__.py"
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.name.split(".")[: len(module.name.split(".")) + is_package - node.level]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names |= {source} | {f"{source}.{a.name}" for a in node.names}
    return names


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walk_reads_each_module_once_under_its_trainyard_name():
    names = modules()
    assert {"trainyard", "trainyard.app", "trainyard.app.api", "trainyard.worker"} <= set(names)
    paths = [m.path.resolve() for m in names.values()]
    assert len(paths) == len(set(paths))
    assert not any(rel(m.path).startswith(("trainyard/app/", "trainyard/worker/")) for m in names.values())


def test_no_module_is_over_300_lines():
    big = sorted(f"{rel(m.path)}: {m.lines} lines" for m in modules().values() if m.lines > MAX_MODULE_LINES)
    assert not big, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(big)


def test_no_function_is_over_60_lines():
    long = []
    for m in modules().values():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel(m.path)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(sorted(long))


def test_the_trainyard_modules_import_one_another_without_a_cycle():
    names = modules()
    graph = {name: {d for d in imported(m) if d in names and d != name} for name, m in names.items()}
    found = cycles(graph)
    assert not found, "import cycles (function-level imports count):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_a_cycle_is_found_through_a_function_level_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    m = Module("trainyard.app.x", ROOT / "app" / "x.py",
               ast.parse("def f():\n    from . import y\n    from .z import w\n    import trainyard.worker.v\n"), 4)
    assert {"trainyard.app.y", "trainyard.app.z.w", "trainyard.worker.v"} <= imported(m)


def test_nothing_imports_app_or_worker_by_a_second_name():
    wrong = []
    files = [m.path for m in modules().values()]
    files += [p for top in OTHER_CODE if (ROOT / top).is_dir() for p in python_files(ROOT / top)]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = [(node.module or "").split(".")[0]]
            else:
                continue
            if {"app", "worker"} & set(tops):
                wrong.append(f"{rel(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "import trainyard.app / trainyard.worker instead:\n" + "\n".join(wrong)


# app/ shows its architecture: a few modules beside its rooms (the packages pyproject.toml's layers contract
# names), each room's __init__ saying what it owns.
MAX_APP_MODULES = 12


def test_app_is_rooms_with_a_few_modules_beside_them():
    top = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert len(top) <= MAX_APP_MODULES, f"modules directly in app/: {top}"
    rooms = [p for p in (ROOT / "app").iterdir() if p.is_dir() and p.name not in ("__pycache__", "static")]
    for room in rooms:
        init = room / "__init__.py"
        assert init.is_file(), f"{rel(room)} is no package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{rel(init)} says nothing of what it owns"


def test_no_submodule_shadows_a_name_its_package_binds():
    """A package's __init__ that binds a name (a table, a function) which is also one of its submodules' names
    loses it to the submodule as soon as that is imported: db's `counters` table and db/counters.py did."""
    clashes = []
    for m in modules().values():
        if m.path.name != "__init__.py":
            continue
        subs = {p.stem for p in m.path.parent.glob("*.py")} | {p.name for p in m.path.parent.iterdir()
                                                               if (p / "__init__.py").is_file()}
        for node in m.tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == m.name:
                continue  # `from pkg import submodule` binds the submodule itself
            bound = {a.asname or a.name for a in node.names} if isinstance(node, ast.ImportFrom | ast.Import) \
                else {node.name} if isinstance(node, ast.FunctionDef | ast.ClassDef) \
                else {t.id for t in node.targets if isinstance(t, ast.Name)} if isinstance(node, ast.Assign) \
                else set()
            clashes += [f"{m.name}.{name}" for name in bound & (subs - {"__init__"})]
    assert not clashes, f"names a submodule shadows: {clashes}"
