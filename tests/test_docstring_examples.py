"""Every `>>>` example in agentgrpo/ runs as written, as a user would copy it.

Each module whose source holds `>>> ` is run through `doctest.testmod` (ELLIPSIS) with globals
that hold nothing but `__name__`: an example imports what it uses, as it must once copied out of
the docstring. A module must attempt at least one example (all-skipped ones pretend to run), and
none may fail. An example that cannot run offline on a CPU in a second or two belongs in a fenced
```python block, which doctest leaves alone.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agentgrpo"


def modules_with_examples(package: Path = PACKAGE) -> list[str]:
    """Dotted names of the modules under `package` whose source holds `>>> `."""
    names = []
    for path in sorted(package.rglob("*.py")):
        if ">>> " in path.read_text(encoding="utf-8"):
            parts = path.relative_to(package.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_examples_are_found() -> None:
    assert len(modules_with_examples()) >= 10  # the search itself works (the package has ~15)


@pytest.mark.parametrize("name", modules_with_examples())
def test_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):  # where the runner writes each failure
        result = doctest.testmod(
            module, globs={"__name__": name}, optionflags=doctest.ELLIPSIS, report=False
        )
    assert result.attempted > 0, f"{name}: no example runs (all skipped?)"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} failed\n" + (
        report.getvalue()
    )
