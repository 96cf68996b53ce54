"""The package's modules, and the parameter-server library's C files, depend on each other in one
direction: no two of them (and no longer chain) import or call each other in a circle. Imports made
inside functions count too: they are circles deferred, not removed."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_imports():
    """recom_rec module -> the recom_rec modules it imports (anywhere in its body)."""
    modules = {_module_name(p): p for p in (ROOT / "recom_rec").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def _c_calls():
    """csrc/ps C file -> the other C files whose (non-static) functions it calls."""
    sources = {p.name: p.read_text() for p in (ROOT / "csrc" / "ps").glob("*.c")}
    defined = {}
    for name, text in sources.items():
        for fn in re.findall(r"^(?!static)[A-Za-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{", text, re.M):
            defined[fn] = name
    graph = {}
    for name, text in sources.items():
        called = set(re.findall(r"\b(\w+)\s*\(", text))
        graph[name] = {defined[f] for f in called if f in defined and defined[f] != name}
    return graph


def _cycles(graph):
    """Every strongly connected component of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_package_modules_import_each_other_in_one_direction():
    graph = _python_imports()
    assert graph["recom_rec.quant.convert"], "the import scan found nothing: it is broken"
    # a package's __init__ re-exporting its modules is the one allowed back edge: drop it
    no_reexports = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    assert _cycles(no_reexports) == []


def test_ps_library_c_files_call_each_other_in_one_direction():
    graph = _c_calls()
    assert "ps_tls.c" in graph["ps_resp.c"], "the call scan found nothing: it is broken"
    assert _cycles(graph) == []
