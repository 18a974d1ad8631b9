"""The package layout the architecture promises (ARCHITECTURE.md): no import cycle between modules of
``impl`` (counting imports inside functions), no import of a private name from another package, and
``serving`` / ``quality`` import no paper package, and the paper packages export lazily."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "impl"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports():
    """(importer module, imported module, names, is package __init__) for every import in impl."""
    out = []
    for f in sorted(PKG.rglob("*.py")):
        mod = _module(f)
        is_pkg = f.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("impl"):
                    out.append((mod, target, [a.name for a in node.names], is_pkg))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("impl"):
                        out.append((mod, a.name, [], is_pkg))
    return out


def _resolve(target: str, names: list[str], modules: set[str]) -> list[str]:
    """``from X import a`` names module X.a when that is a module, else X."""
    hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    return hits or ([target] if target in modules else [])


def test_no_import_cycles():
    modules = {_module(f) for f in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, target, names, is_pkg in _imports():
        if is_pkg:  # a package's __init__ re-exports its modules; it is not part of a cycle between them
            continue
        for t in _resolve(target, names, modules):
            if t != src and not (src.startswith(t + ".") or t == "impl"):
                graph[src].add(t)
    # Tarjan's strongly connected components
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    import sys

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not sccs, f"import cycles: {sccs}"


def test_no_private_names_across_packages():
    bad = []
    for src, target, names, _ in _imports():
        src_pkg, tgt_pkg = src.split(".")[:2], target.split(".")[:2]
        if src_pkg != tgt_pkg:
            bad += [f"{src} imports {target}.{n}" for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, bad


PAPERS = ("impl.dex", "impl.tev", "impl.vskipper")


def test_serving_and_quality_import_no_paper_package():
    bad = [f"{src} imports {target}" for src, target, _, _ in _imports()
           if src.startswith(("impl.serving", "impl.quality")) and target.startswith(PAPERS)]
    assert not bad, bad


def test_paper_packages_import_lazily():
    """A paper package's __init__ imports none of its modules (PEP 562 exports), so its light modules
    (the config schemas the workflow reads at parse time) cost no torch import."""
    import subprocess
    import sys

    code = ("import sys, impl.vskipper.schema, impl.tev.schema, impl.dex.schema, impl.config as c; c.full_schema(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


#: Modules that may import inside functions, and why (ARCHITECTURE.md, "Imports"); everywhere else
#: imports sit at the top of the module.
LAZY_IMPORTS = {
    # command modules: a command imports what it runs (`python -m impl --help` and the DAG's parse
    # read no torch)
    "impl/cli.py", "impl/tev/commands.py", "impl/vskipper/commands.py", "impl/vskipper/serving_commands.py",
    "impl/vskipper/sglang_check.py",
    # each section imports its method, so one that fails on a device's versions is reported, not fatal
    "impl/gpu_check.py",
    # torch-free modules with one function that needs torch / transformers
    "impl/config.py", "impl/runtime.py", "impl/provenance.py", "impl/models/tiny.py", "impl/models/tokenizer.py",
    "impl/quality/did.py", "impl/report/tables.py",
    # optional or heavy dependencies needed by one path: gguf (conversion only), lm-eval, matplotlib
    "impl/models/gguf.py", "impl/quality/scoring.py", "impl/vskipper/serving_report.py",
    # the section schemas reach impl.config, which registers them by name (a top-level import would be
    # circular at import time)
    "impl/dex/schema.py", "impl/tev/schema.py", "impl/vskipper/schema.py",
}


def test_imports_at_the_top_except_where_documented():
    lazy = set()
    for f in sorted(PKG.rglob("*.py")):
        for fn in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(fn)):
                lazy.add(str(f.relative_to(ROOT)))
    assert lazy <= LAZY_IMPORTS, f"imports inside functions outside the documented modules: {sorted(lazy - LAZY_IMPORTS)}"
    stale = {m for m in LAZY_IMPORTS if not (ROOT / m).exists()}
    assert not stale, f"LAZY_IMPORTS names modules that do not exist: {sorted(stale)}"
