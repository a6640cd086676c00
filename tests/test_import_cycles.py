"""No import cycles inside the package, counting imports inside functions too (a function-level import is
how a cycle hides until someone moves a call)."""
import ast
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules `path` imports. `from pkg import name` counts pkg.name when that is a module."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_includes_function_level_imports():
    graph = import_graph()
    assert "tokenmill.entrypoints.openai.api_server" in graph["tokenmill.entrypoints.cli"]  # inside cmd_serve


def test_package_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cpu_engine_never_loads_triton():
    """A CPU run loads no Triton: importing it costs startup time, and once loaded, triton's nanobind bindings
    print pages of leak reports at exit (tokenmill generate ended with them). The kernels import it on first use."""
    import subprocess
    import sys

    code = ("import sys\nfrom tokenmill import LLM, SamplingParams\nfrom tokenmill.config import DEFAULT_MODEL\n"
            "llm = LLM(DEFAULT_MODEL, max_model_len=128)\n"
            "print(len(llm.generate(['ROMEO:'], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids))\n"
            "print('triton' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["4", "False"], out.stdout
    assert "nanobind" not in out.stderr
