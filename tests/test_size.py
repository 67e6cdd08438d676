"""Size as a habit (CONTRIBUTING.md, "How code reads", 11 and 13), read from the source with `ast`.

A function or method over 80 lines is refused unless `LONG_FUNCTIONS` names it with the reason it
reads better whole; at most three may be named. A module over 500 lines is refused unless
`LONG_MODULES` names it (a ratchet: the list may only shrink, and a listed module that dropped
under the bar must leave it). A module docstring says what and why in at most `DOCSTRING_LINES`
lines; details belong in the topic's docs page.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("agentgrpo", "envs", "tools")
FUNCTION_LINES, MODULE_LINES, DOCSTRING_LINES = 80, 500, 15

# "path:name" -> why it stays whole
LONG_FUNCTIONS: dict[str, str] = {}
# path -> why it is still one module
LONG_MODULES: dict[str, str] = {
    "agentgrpo/run/train.py": "the step loop and its start-up; the scheduler is in pipeline.py",
    "agentgrpo/run/config.py": "the run's config and the rules across its sections, which need "
    "them all",
    "agentgrpo/chat/format.py": "the ChatFormat class; its helpers are split off already",
}


def _modules(root: Path) -> dict[str, str]:
    """Every module's source by its path relative to `root`."""
    paths = sorted(p for d in SOURCES for p in (root / d).rglob("*.py"))
    return {p.relative_to(root).as_posix(): p.read_text() for p in paths}


def long_functions(root: Path = ROOT) -> dict[str, int]:
    out = {}
    for rel, src in _modules(root).items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LINES:
                    out[f"{rel}:{node.name}"] = n
    return out


def long_modules(root: Path = ROOT) -> dict[str, int]:
    sizes = {rel: src.count("\n") for rel, src in _modules(root).items()}
    return {rel: n for rel, n in sizes.items() if n > MODULE_LINES}


def long_docstrings(root: Path = ROOT) -> dict[str, int]:
    out = {}
    for rel, src in _modules(root).items():
        doc = ast.get_docstring(ast.parse(src), clean=False)
        if doc and doc.count("\n") + 1 > DOCSTRING_LINES:
            out[rel] = doc.count("\n") + 1
    return out


def test_functions_over_80_lines_are_few_and_each_has_its_reason():
    assert len(LONG_FUNCTIONS) <= 3, "at most three functions may stay over 80 lines"
    found = long_functions()
    unlisted = {k: n for k, n in found.items() if k not in LONG_FUNCTIONS}
    assert not unlisted, f"over {FUNCTION_LINES} lines: split them into named steps: {unlisted}"
    shorter = set(LONG_FUNCTIONS) - set(found)
    assert not shorter, f"no longer over {FUNCTION_LINES} lines: take them off the list: {shorter}"


def test_modules_over_500_lines_only_shrink():
    found = long_modules()
    unlisted = {k: n for k, n in found.items() if k not in LONG_MODULES}
    assert not unlisted, f"over {MODULE_LINES} lines: split along a seam it has: {unlisted}"
    shorter = set(LONG_MODULES) - set(found)
    assert not shorter, f"no longer over {MODULE_LINES} lines: take them off the list: {shorter}"


def test_module_docstrings_say_what_and_why_briefly():
    long = long_docstrings()
    assert not long, f"docstrings over {DOCSTRING_LINES} lines (move details to docs): {long}"


def test_the_measures_count_at_their_bars(tmp_path):
    """An 81-line method counts and an 80-line one does not; a 501-line module counts, a
    16-line docstring counts, and folders nest."""
    body = "\n".join(f"        x{i} = {i}" for i in range(79))
    src = (
        '"""' + "\n" * 15 + '"""\n'  # a 16-line docstring
        f"class A:\n    def long(self):\n{body}\n        return 0\n\n"
        f"    def short(self):\n{body}\n"
    )
    pkg = tmp_path / "agentgrpo" / "inner"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text(src)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "big.py").write_text("x = 1\n" * 501)
    assert long_functions(tmp_path) == {"agentgrpo/inner/m.py:long": 81}
    assert long_modules(tmp_path) == {"envs/big.py": 501}
    assert long_docstrings(tmp_path) == {"agentgrpo/inner/m.py": 16}
