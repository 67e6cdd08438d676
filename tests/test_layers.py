"""The package's layers, by folder, read from the source (docs/design.md, "Layers";
CONTRIBUTING.md).

The import graph of `agentgrpo/`, `envs/` and `tools/` is computed with `ast`: every import at
any depth (inside functions too), relative imports resolved, `importlib.import_module("name")`
with a literal name counted as an import, and only what sits under `if TYPE_CHECKING:` left out.
The tests fail on any cycle in it (naming the modules around it), on any import of `envs` or
`tools` from `agentgrpo`, on an import between folders that `MAY_IMPORT` does not allow (a stage
folder importing the run level among them), on a private name imported from another folder, on
a top-level module that is not listed, and on an import inside a function that is neither of a
heavy or optional dependency nor listed in `LATE` with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agentgrpo", "envs", "tools")

# The folders (and the few single-file modules) of agentgrpo/, each with the ones it may import.
# Stage layers from the bottom up, then the run level (application), which may use every stage.
# A new folder is refused until it is placed here.
STAGES: dict[str, set[str]] = {
    "types": set(),  # the records between stages
    "deadlines": set(),  # the time budgets every await of an episode runs under (below env, verify)
    "env": {"types", "deadlines"},
    "chat": {"types"},
    "algo": {"types"},
    "models": {"types"},
    "verify": {"types", "deadlines", "env"},
    "engine": {"types", "models"},
    "learner": {"types", "algo", "models"},
    "rollout": {"types", "deadlines", "env", "chat", "engine"},
    "agents": {"types", "deadlines", "env", "chat", "engine", "rollout"},
}
APPLICATION: dict[str, set[str]] = {
    "checks": set(STAGES),
    "run": set(STAGES) | {"checks"},
    "cli": set(STAGES) | {"checks", "run"},  # the `agentgrpo` command's entry point
}
MAY_IMPORT = STAGES | APPLICATION
# Top-level single-file modules (every other name under agentgrpo/ is a folder), and why.
SINGLE_FILES = {
    "deadlines": "a leaf below env, verify and rollout: each of them awaits under its budgets",
    "cli": "the entry point of the `agentgrpo` command (pyproject's [project.scripts])",
}
# The package's own `__init__` is the public face: it may re-export from both layers, so no module
# of agentgrpo imports it.
FACADE = {"agentgrpo"}


def folder(module: str) -> str | None:
    """The folder (or single-file module) of agentgrpo that `module` lies in; None outside it or
    for the package face itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "agentgrpo" and len(parts) > 1 else None


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in `tree`, relative ones resolved; the names under
    `from X import a, b` are given as `X.a` and `X.b` (`_owning_module` turns a name that is not a
    module into the module that holds it)."""
    out: list[tuple[str, int]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.append((first.value, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


def _owning_module(name: str, modules: set[str]) -> str | None:
    """The longest module of ours that `name` is or lies in (`agentgrpo.env.base.Env` ->
    agentgrpo.env.base); None for a name outside the three packages."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {module it imports: first line of such an import}, within the three packages."""
    files = module_files()
    modules = set(files)
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: dict[str, int] = {}
        for name, line in _imported_names(tree, module, path.name == "__init__.py"):
            target = _owning_module(name, modules)
            if target is not None and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := walk(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := walk(start)) is not None:
            return cycle
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    files = module_files()
    steps = [
        f"{a} ({files[a].relative_to(ROOT)}:{graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])
    ]
    return "\n  ".join(steps)


def test_the_graph_sees_imports_inside_functions_and_under_type_checking_only_in_else() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from agentgrpo.run.config import RunConfig\n"
        "else:\n    from agentgrpo.run import log\n"
        "def f():\n    from .run.train import train\n    importlib.import_module('envs')\n"
    )
    modules = {
        "agentgrpo",
        "agentgrpo.run.config",
        "agentgrpo.run.log",
        "agentgrpo.run.train",
        "envs",
    }
    names = _imported_names(ast.parse(source), "agentgrpo.x", False)
    owners = {_owning_module(n, modules) for n, _ in names} - {None}  # None: typing, outside
    assert owners == {"agentgrpo.run.log", "agentgrpo.run.train", "envs"}
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_graph_covers_the_packages() -> None:
    graph = import_graph()
    assert {"agentgrpo.env.base", "agentgrpo.run.train", "envs.calculator", "tools.python"} <= set(
        graph
    )
    assert "agentgrpo.types" in graph["agentgrpo.env.base"]
    # every folder the layer table names exists (a renamed folder must be renamed here too)
    assert set(MAY_IMPORT) <= {folder(m) for m in graph}, set(MAY_IMPORT) - {
        folder(m) for m in graph
    }


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n  " + _describe(cycle, graph)


def test_agentgrpo_imports_neither_envs_nor_tools() -> None:
    files = module_files()
    bad = [
        f"{files[m].relative_to(ROOT)}:{line} imports {target}"
        for m, edges in import_graph().items()
        if m.split(".")[0] == "agentgrpo"
        for target, line in edges.items()
        if target.split(".")[0] in ("envs", "tools")
    ]
    assert not bad, "the library imports its own examples:\n  " + "\n  ".join(bad)


def test_agentgrpo_holds_folders_and_the_listed_single_files_only() -> None:
    top = ROOT / "agentgrpo"
    files = {p.stem for p in top.glob("*.py")} - {"__init__"}
    folders = {p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert files == set(SINGLE_FILES), f"top-level modules not listed: {files - set(SINGLE_FILES)}"
    assert folders | files == set(MAY_IMPORT), (folders | files) ^ set(MAY_IMPORT)


def test_folders_import_only_the_layers_below_them() -> None:
    files = module_files()
    bad = []
    for module, edges in import_graph().items():
        source = folder(module)
        if source is None:
            continue
        for target, line in edges.items():
            dest = folder(target)
            if target in FACADE and module not in FACADE:
                bad.append(f"{files[module].relative_to(ROOT)}:{line} imports the package face")
            elif dest is not None and dest != source and dest not in MAY_IMPORT[source]:
                bad.append(f"{files[module].relative_to(ROOT)}:{line} ({source}/) imports {target}")
    assert not bad, "imports against the layers (MAY_IMPORT):\n  " + "\n  ".join(bad)


def _private_imports() -> list[tuple[str, str, int]]:
    """(module, imported name, line) of every `from X import _name` and `import X._mod` whose
    private part lies in another folder of agentgrpo than the importer's."""
    found = []
    for module, path in module_files().items():
        if not module.startswith("agentgrpo"):
            continue
        is_package = path.name == "__init__.py"
        for name, line in _imported_names(ast.parse(path.read_text()), module, is_package):
            if folder(name) in (None, folder(module)):
                continue
            if any(part.startswith("_") and not part.startswith("__") for part in name.split(".")):
                found.append((module, name, line))
    return found


def test_private_names_stay_inside_their_folder() -> None:
    files = module_files()
    bad = [
        f"{files[m].relative_to(ROOT)}:{line} imports {name}"
        for m, name, line in _private_imports()
    ]
    assert not bad, "private names imported from another folder:\n  " + "\n  ".join(bad)


# Imports inside functions, each for a reason: a heavy or optional dependency loaded only by the
# code that needs it, never at `import agentgrpo` (first part of the imported name) ...
HEAVY_OR_OPTIONAL = {
    "accelerate",
    "matplotlib",
    "openai",
    "peft",
    "reasoning_gym",
    "safetensors",
    "sglang",
    "torch",
    "vllm",
    "transformers",
    "wandb",
    "mcp",
    "mcp_types",
    "jsonschema",
    "anyio",
}  # agentgrpo.agents.mcp: the `mcp` extra
# ... or a module of ours that one module loads late, and why.
LATE = {
    (
        "agentgrpo.learner",
        "agentgrpo.learner.learner",
    ): "packing (learner.batch) loads no accelerate",
    ("agentgrpo.cli", "agentgrpo.run.config"): "loads torch: only once a command runs",
    (
        "agentgrpo.run.report",
        "agentgrpo.run.config",
    ): "loads torch: only when a run has a config.yaml",
    ("agentgrpo.cli", "agentgrpo.run.train"): "loads torch: only once a command runs",
    ("agentgrpo.cli", "agentgrpo.run.evaluate"): "loads torch: only once a command runs",
    (
        "agentgrpo.engine",
        "agentgrpo.engine.local.engine",
    ): "the protocol is importable without torch",
    ("agentgrpo.engine", "agentgrpo.engine.sglang.client"): "... and without httpx",
    (
        "agentgrpo.engine.config",
        "agentgrpo.engine.sglang.client",
    ): "loading a run config imports no httpx",
    ("agentgrpo.engine", "agentgrpo.engine.vllm.client"): "the protocol imports no httpx",
    (
        "agentgrpo.engine.config",
        "agentgrpo.engine.vllm.client",
    ): "loading a run config imports no httpx",
    (
        "agentgrpo.agents.serve_policy",
        "agentgrpo.engine.local.engine",
    ): "loads torch: only without --sglang",
    ("agentgrpo.verify._remote_client", "httpx"): "a local sandbox imports no httpx",
    # the part of a sandbox job that runs in the jail (stdlib only, its source run by `python -c`);
    # its late stdlib imports are left to the sandbox's own changes
    ("agentgrpo.verify._runner", "builtins"): "jail child",
    ("agentgrpo.verify._runner", "io"): "",
    ("agentgrpo.verify._runner", "types"): "",
    ("agentgrpo.verify._runner", "atexit"): "",
    ("agentgrpo.verify._runner", "threading"): "",
    ("agentgrpo.verify._runner", "traceback"): "",
}


def imports_inside_functions() -> list[tuple[str, str, int]]:
    """(module, imported name, line) of every import inside a function, TYPE_CHECKING aside."""
    found: list[tuple[str, str, int]] = []
    for module, path in module_files().items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        _late_imports(ast.parse(path.read_text()), module, package, False, found)
    return found


def _late_imports(
    node: ast.AST, module: str, package: str, in_function: bool, found: list[tuple[str, str, int]]
) -> None:
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        node = ast.Module(body=node.orelse, type_ignores=[])
    if in_function and isinstance(node, ast.Import):
        found.extend((module, a.name, node.lineno) for a in node.names)
    elif in_function and isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        found.append((module, base, node.lineno))
    inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    for child in ast.iter_child_nodes(node):
        _late_imports(child, module, package, inside, found)


def test_imports_inside_functions_only_for_heavy_or_optional_dependencies() -> None:
    files = module_files()
    bad = [
        f"{files[m].relative_to(ROOT)}:{line} imports {name} inside a function"
        for m, name, line in imports_inside_functions()
        if name.split(".")[0] not in HEAVY_OR_OPTIONAL and (m, name) not in LATE
    ]
    assert not bad, "move these to the module's top:\n  " + "\n  ".join(bad)
