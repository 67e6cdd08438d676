"""scripts/floors.py: the floors scripts/test-floor.sh runs the suite on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("floors", ROOT / "scripts" / "floors.py")
floors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floors)


def _dist(overlay: Path, name: str, version: str, *requires: str) -> None:
    info = overlay / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_every_floored_package_has_one_floor_in_pyproject():
    pins = floors.floors()
    assert set(pins) == set(floors.FLOORED)
    assert pins["transformers"] == "5.17"  # the floor the GPU machine's image has


def test_unmet_names_what_the_overlay_needs_and_nothing_the_venv_has(tmp_path):
    import packaging

    _dist(
        tmp_path,
        "floored-a",
        "1.0",
        "no-such-package-xyz==2.1",
        f"packaging>={packaging.__version__}",
        "another-missing>=3; extra == 'dev'",
        "old-python-only<1; python_version < '3'",
    )
    _dist(tmp_path, "floored-b", "1.0", "floored-a==1.0", "floored-a>=2")
    assert floors.unmet(*floors.installed(tmp_path)) == ["floored-a>=2", "no-such-package-xyz==2.1"]


def test_unmet_follows_the_extras_asked_of_a_package_and_pins_it_once_for_all_askers(tmp_path):
    # torch 2.11's shape: the libraries come with cuda-toolkit's extras, and a second package asks
    # for one of them without a version
    _dist(tmp_path, "floored-torch", "1.0", "floored-toolkit[blas]==1.0")
    _dist(
        tmp_path,
        "floored-toolkit",
        "1.0",
        "floored-blas==13.1.*; extra == 'blas'",
        "floored-fft==12.0; extra == 'fft'",
    )
    _dist(tmp_path, "floored-dnn", "1.0", "floored-blas")
    assert floors.unmet(*floors.installed(tmp_path)) == ["floored-blas==13.1.*"]
    _dist(tmp_path, "floored-blas", "13.1.0")
    assert floors.unmet(*floors.installed(tmp_path)) == []


def test_check_refuses_an_overlay_off_the_floors(tmp_path, capsys):
    _dist(tmp_path, "transformers", "0.1")  # first on the path, so the one Python would import
    _dist(
        tmp_path, "torch", floors.floors()["torch"] + ".0+cu128"
    )  # at the floor: a local label is no matter
    assert floors.main(["check", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "transformers 0.1 (floor 5.17)" in err
    assert "'torch " not in err
    assert floors.main(["nonsense"]) == 2
