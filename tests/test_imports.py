"""The import graph of the zmpi package (and zmpi.models) has no cycle.

Every module's imports are read with `ast`, function-level (lazy) imports included: a lazy
import hides a circle from Python at import time but not from a reader. `from pkg import name`
counts as an import of `pkg.name` when that is a module, else of `pkg`; the implicit import of
a parent package is not counted (every submodule would form a circle with its __init__).
"""
import ast
import subprocess
import sys

from mpi_util import REPO_ROOT

# zmpi, and the models directory installed as zmpi.models (pyproject.toml)
PACKAGES = {"zmpi": REPO_ROOT / "zmpi", "zmpi.models": REPO_ROOT / "models"}


def module_files(packages) -> dict:
    """{dotted module name: path} of every .py file under each package directory."""
    out = {}
    for package, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def imported(name: str, path, modules) -> set:
    """The modules of `modules` that module `name` (file `path`) imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in
                package = name.split(".")
                package = package[:len(package) - node.level + (path.name == "__init__.py")]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(packages) -> dict:
    modules = module_files(packages)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_cycle_finder_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom . import c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.sub\n")
    graph = import_graph({"pkg": pkg})
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.a", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.sub"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_zmpi_has_no_import_cycle():
    assert cycles(import_graph(PACKAGES)) == []


def test_builtins_are_registered_by_importing_only_the_registry_or_a_stage():
    """The registry imports no strategy: importing any zmpi.zero module imports the package,
    which registers the built-in ones; UnitModel still defaults to cross-entropy."""
    code = ("from zmpi.zero.registry import get_strategy\n"
            "from zmpi.nn.module import UnitModel\n"
            "assert get_strategy('hybrid').__name__ == 'Hybrid'\n"
            "assert type(UnitModel([]).loss_fn).__name__ == 'CrossEntropyLoss'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO_ROOT, check=True).stdout
    assert out.strip() == "ok"
