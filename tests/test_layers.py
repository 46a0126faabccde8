"""The import contracts in pyproject.toml hold: layers (a lower layer never imports a higher one) and no cycle
between the modules of one subpackage; each fails when broken."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the lint extra (pip install -e '.[lint]')")

REPO = Path(__file__).resolve().parents[1]


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_its_layers():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def _lint_with(tmp_path, module, added):
    """lint-imports on a copy of the package whose ``module`` (a path under dist_resume/) ends with ``added``."""
    shutil.copytree(REPO / "dist_resume", tmp_path / "dist_resume", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    source = tmp_path / "dist_resume" / module
    source.write_text(source.read_text() + added)
    return _lint(tmp_path)


def test_a_lower_layer_importing_a_higher_one_breaks_the_contract(tmp_path):
    result = _lint_with(tmp_path, "_core/tree.py", "\nfrom .._save import save as _upward  # noqa: E402,F401\n")
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "dist_resume._core.tree -> dist_resume._save.save" in result.stdout


def test_an_import_cycle_inside_a_subpackage_breaks_the_contract(tmp_path):
    # the shape that existed once: a module importing, inside a function, a sibling that imports it
    result = _lint_with(
        tmp_path, "_format/records.py", "\n\ndef _late():\n    from .archive import read_archive  # noqa: F401\n"
    )
    assert result.returncode != 0
    assert "No cycles are allowed in dist_resume._format" in result.stdout and ".records -> .archive" in result.stdout


def test_no_module_imports_another_modules_private_name():
    # a helper used across modules is part of its module's interface: public there, named in __all__
    import ast

    found = []
    for path in sorted((REPO / "dist_resume").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dist_resume")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(REPO)}: {alias.name}")
    assert found == []


# Where a checkpoint is becomes a Location (a Path or a RemotePath) once, at the public entry that received the user's
# path or URL; everything below takes that value as it is and never resolves a raw path again.
_PATH_ENTRIES = {
    ("_checkpoint/resume.py", "resume"),
    ("_source/open.py", "load_checkpoint"),
    ("_source/consensus.py", "resolve_checkpoint"),
    ("_source/listing.py", "latest_checkpoint"),
    ("_source/integrity.py", "inspect_checkpoint"),
    ("_source/integrity.py", "verify_archive"),
    ("_convert/convert.py", "convert_checkpoint"),
    ("_manager/adopt.py", "convert_into_folder"),
    ("_manager/manager.py", "CheckpointManager.__init__"),
    ("_manager/start.py", "start_run"),  # CheckpointManager.resume(init_from=...)
    ("_save/entry.py", "save_checkpoint"),
    ("_save/entry.py", "save_checkpoint_async"),
    ("cli/_parser.py", "_location"),  # every dist-resume command's path arguments (argparse's type=)
}


def _location_calls() -> set[tuple[str, str]]:
    """(module, enclosing function) of every call of ``location(...)`` (``_store/url.py``'s) in the package."""
    import ast

    found: set[tuple[str, str]] = set()
    root = REPO / "dist_resume"
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module == "_store/url.py":
            continue

        def visit(node: ast.AST, scope: list[str], module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, [*scope, child.name])
                    continue
                if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "location":
                    found.add((module, ".".join(scope) or "<module>"))
                visit(child, scope)

        visit(ast.parse(path.read_text(encoding="utf-8")), [])
    return found


def test_a_path_becomes_a_location_once_at_the_public_entry():
    calls = _location_calls()
    assert calls - _PATH_ENTRIES == set(), "a lower function resolves a raw path again: take a Location instead"
    assert _PATH_ENTRIES - calls == set(), "an entry no longer resolves its path: update _PATH_ENTRIES"
