"""The house rules of CONTRIBUTING.md that a machine can check: no module of the library over 330 lines, and no folder
holding four or more modules that share a prefix (such a family is a subpackage: ``_format/dcp/``, ``cli/inspect/``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dist_resume"
MAX_LINES = 330
FAMILY = 4

# Modules over the limit that another change is splitting now (issue 46); each entry must still be over it, so the
# list shrinks as they land and never hides a new one.
SPLITTING: frozenset[str] = frozenset()


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def long_modules(package: Path) -> dict[str, int]:
    """Each module of ``package`` over :data:`MAX_LINES` lines, with its count."""
    found = {p.relative_to(package).as_posix(): _lines(p) for p in sorted(package.rglob("*.py"))}
    return {name: n for name, n in found.items() if n > MAX_LINES}


def flat_families(package: Path) -> dict[str, list[str]]:
    """``folder/prefix_*`` -> its modules, for each prefix that :data:`FAMILY` or more modules of one folder share
    (the prefix: a module's name up to its first ``_``, a leading ``_`` set aside: ``_inspect_render`` -> inspect)."""
    families: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if path.stem == "__init__":
            continue
        folder = path.parent.relative_to(package).as_posix()
        families[f"{folder}/{path.stem.lstrip('_').split('_')[0]}_*"].append(path.stem)
    return {name: stems for name, stems in families.items() if len(stems) >= FAMILY}


def test_no_module_is_over_330_lines() -> None:
    long = long_modules(PACKAGE)
    assert {name: n for name, n in long.items() if name not in SPLITTING} == {}, "split them by concept"
    assert sorted(SPLITTING - set(long)) == [], "split already (or gone): remove them from SPLITTING"


def test_no_folder_holds_a_family_of_four_modules_sharing_a_prefix() -> None:
    assert flat_families(PACKAGE) == {}, "make each family a subpackage"


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("_inspect", "_inspect_optim", "_inspect_render", "_inspect_sources", "_list", "__init__"):
        (package / "sub" / f"{name}.py").write_text("x = 1\n")
    (package / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (package / "fits.py").write_text("x = 1\n" * MAX_LINES)
    assert long_modules(package) == {"long.py": MAX_LINES + 1}
    assert flat_families(package) == {
        "sub/inspect_*": ["_inspect", "_inspect_optim", "_inspect_render", "_inspect_sources"]
    }
