"""The floors of pyproject.toml that scripts/test-floor.sh installs and the suite then runs on.

A floor nobody runs is a guess: each one below was found wrong by running it (accelerate 1.0 has no
FSDP2, gguf 0.10 breaks on numpy 2, 0.13 lacks `ReaderField.contents`, torch 2.6 lacks
`dcp.save(no_dist=...)`). The floored packages are laid over the venv (`pip install --no-deps
--target DIR`, first on PYTHONPATH) without rebuilding anything. torch goes there too: nothing in
the venv is compiled against it, and its wheel brings its own libraries (on Linux, PyPI has only the
CUDA build: the nvidia-* wheels come in as its needs, 6.6 GB unpacked for 2.9; it runs on a CPU).
numpy, safetensors and tokenizers keep the venv's versions (other wheels in the venv are built
against them, and matplotlib needs a newer numpy than numpy's floor); numpy's floor was run by hand
in its own venv (pyproject.toml's comment says so).

    python scripts/floors.py pins          # "torch==2.9 transformers==5.17 ..." (pip's words)
    python scripts/floors.py missing DIR   # what DIR's packages need that neither DIR nor the
                                           # venv has
    python scripts/floors.py check DIR     # every floor at its version, every need met; exit 1
                                           # if not
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

FLOORED = (
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "pydantic",
    "gymnasium",
    "httpx",
    "gguf",
    "math-verify",
)
ROOT = Path(__file__).resolve().parents[1]


def floors() -> dict[str, str]:
    """name -> the `>=` bound pyproject.toml gives it (in `dependencies` or an extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    found: dict[str, str] = {}
    for text in reqs:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in FLOORED:
            lows = [s.version for s in req.specifier if s.operator == ">="]
            if len(lows) != 1:
                raise SystemExit(f"floors: {text!r} in pyproject.toml has no single >= bound")
            if found.setdefault(name, lows[0]) != lows[0]:
                raise SystemExit(
                    f"floors: {name} has two floors in pyproject.toml: {found[name]}, {lows[0]}"
                )
    absent = set(FLOORED) - set(found)
    if absent:
        raise SystemExit(f"floors: pyproject.toml names no floor for {sorted(absent)}")
    return found


def installed(
    overlay: Path,
) -> tuple[dict[str, metadata.Distribution], list[metadata.Distribution]]:
    """Every package as Python will see it with `overlay` first on the path (name -> distribution),
    and the overlay's own distributions."""
    ours = list(metadata.distributions(path=[str(overlay)]))
    seen: dict[str, metadata.Distribution] = {}
    for dist in [*ours, *metadata.distributions(path=[p for p in sys.path if p != str(overlay)])]:
        seen.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return seen, ours


def unmet(seen: dict[str, metadata.Distribution], ours: list[metadata.Distribution]) -> list[str]:
    """Requirements of the overlay's packages that nothing installed satisfies (`seen`, `ours`: what
    `installed(overlay)` returns), with those of the extras they ask of others: torch 2.11 needs
    `cuda-toolkit[cufile,...]`, whose libraries come only with those extras. Their own extras are
    off."""
    needs: dict[str, tuple[str, SpecifierSet]] = {}  # name -> (as written, every bound asked)
    todo = [(dist, "") for dist in ours]  # (distribution, extra) whose requirements must hold
    done: set[tuple[str, str]] = set()
    while todo:
        dist, extra = todo.pop()
        key = (canonicalize_name(dist.metadata["Name"]), extra)
        if key in done:
            continue
        done.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            name = canonicalize_name(req.name)
            have = seen.get(name)
            if have is None or not req.specifier.contains(Version(have.version), prereleases=True):
                # one pin for all who ask: cudnn's bare `nvidia-cublas` would otherwise install a
                # newer one than cuda-toolkit's `==13.1.0.3.*`, every round again
                written, spec = needs.get(name, (req.name, SpecifierSet()))
                needs[name] = (written, spec & req.specifier)
            else:
                todo.extend((have, e) for e in req.extras)
    return sorted(f"{written}{spec}" for written, spec in needs.values())


def main(argv: list[str]) -> int:
    if argv == ["pins"]:
        print(" ".join(f"{name}=={version}" for name, version in floors().items()))
        return 0
    if len(argv) == 2 and argv[0] in ("missing", "check"):
        overlay = Path(argv[1]).resolve()
        seen, ours = installed(overlay)
        needs = unmet(seen, ours)
        if argv[0] == "missing":
            print(" ".join(needs))
            return 0
        # (public: a wheel's local label, torch's +cu128, is not part of the version pinned)
        version = {name: Version(dist.version) for name, dist in seen.items()}
        wrong = [
            f"{name} {version.get(name)} (floor {v})"
            for name, v in floors().items()
            if name not in version or Version(version[name].public) != Version(v)
        ]
        if wrong or needs:
            print(
                f"floors: not at the floor: {wrong}; needed, not installed: {needs}",
                file=sys.stderr,
            )
            return 1
        print("floors:", ", ".join(f"{name} {version[name]}" for name in floors()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
