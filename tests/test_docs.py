"""The documentation runs: README.md's and docs/*.md's Python blocks, the README's commands, the docstring examples.

Each page's ```python blocks run in order in one namespace (a page reads like a notebook), in a temporary
folder, in one CPU process without torchrun variables. A block that cannot run there (it needs torchrun, a GPU,
or is a fragment) carries ``<!-- not-run: reason -->`` on the line before its fence; every other block must run.
"""

from __future__ import annotations

import doctest
import importlib.util
import logging
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume
from tests.helpers import DESELECTED, TORCHRUN_VARS

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason, when marked


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` (top-level fences only, as Markdown renders them)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.name}:{i + 1}: unclosed code fence"
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(prev.strip())
        found.append(
            Block(page, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n", marker.group(1) if marker else None)
        )
        i = end + 1
    return found


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python"]


@pytest.fixture
def single_cpu_process(tmp_path, monkeypatch):
    """A temporary working folder, no torchrun variables, no accelerator; the global RNG and the logging set-up the
    pages show (basicConfig, the library logger's level) are restored afterwards, so later tests see neither."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    monkeypatch.chdir(tmp_path)
    state = torch.random.get_rng_state()
    root, library = logging.getLogger(), logging.getLogger("dist_resume")
    saved = (root.level, list(root.handlers), library.level)
    yield tmp_path
    torch.random.set_rng_state(state)
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    library.setLevel(saved[2])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_python_block_runs_or_says_why_not(page, single_cpu_process):
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    ran = 0
    for block in python_blocks(page):
        where = f"{page.relative_to(REPO)}:{block.line}"
        if block.not_run is not None:
            assert block.not_run, f"{where}: a not-run marker needs a reason"
            compile(block.code, where, "exec")  # still valid Python
            continue
        try:
            exec(compile(block.code, where, "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"the Python block at {where} failed: {type(err).__name__}: {err}") from err
        ran += 1
    if page.name == "README.md":
        assert ran >= 1, "the README's quick start must run"
        assert (single_cpu_process / "ckpt" / "ckpt_00000030.pt").is_file()


def test_the_pages_are_all_checked_and_linked():
    readme = (REPO / "README.md").read_text()
    docs = {p.name for p in PAGES[1:]}
    assert {
        "api.md",
        "checkpoint-folders.md",
        "exact-resume.md",
        "cli.md",
        "performance.md",
        "errors.md",
        "launching.md",
        "devices.md",
        "testing.md",
    } <= docs
    for name in docs:
        assert f"(docs/{name})" in readme, f"README.md does not link docs/{name}"
    marked = [b for p in PAGES for b in python_blocks(p) if b.not_run is not None]
    assert all(b.not_run for b in marked)
    assert sum(len(python_blocks(p)) for p in PAGES) - len(marked) >= 8  # most examples really run


def test_readme_quick_start_resumes_where_it_stopped(single_cpu_process):
    """The quick start run twice: the second run finds step 30 and does no more work; a longer run continues."""
    after = next(b for b in python_blocks(REPO / "README.md") if b.not_run is None)
    first: dict[str, Any] = {}
    exec(compile(after.code, "README.md", "exec"), first)
    assert first["step"] == 30
    code = after.code.replace("step < 30", "step < 40").replace("step == 30", "step == 40")
    second: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), second)
    assert second["step"] == 40
    for a, b in zip(first["model"].parameters(), second["model"].parameters()):
        assert not torch.equal(a, b), "the second run did not train on"
    names = sorted(p.name for p in (single_cpu_process / "ckpt").iterdir())
    assert names == [".dist_resume.lock", "ckpt_00000030.pt", "ckpt_00000040.pt"]  # the lock file stays


def _readme_commands() -> list[str]:
    bash = [b.code.strip() for b in blocks(REPO / "README.md") if b.lang == "bash"]
    assert len(bash) >= 2, "README.md must open with its two commands"
    return bash[:2]


def test_readme_commands_match_ci_and_train_py():
    demo, tests = _readme_commands()
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci, ".ci/run must run the README's test command verbatim (keep the two in sync)"
    # README's command runs under the coverage floor with the end-to-end launches added to its session (their
    # launches unmeasured: tests/conftest.py), the slow runs left out
    addopts = [line for line in ci[: ci.index(tests)] if line.startswith("export PYTEST_ADDOPTS=")]
    assert addopts, ".ci/run must set PYTEST_ADDOPTS for README's command"
    assert "--cov=dist_resume" in addopts[-1] and "--cov-fail-under" in addopts[-1], addopts
    assert "-m 'not slow'" in addopts[-1], "the e2e tests run in README's command's session (docs/testing.md)"
    assert not any("pytest" in line and "-m e2e" in line for line in ci), "no second pytest session"
    # the demo command runs launch/demo.sh: its three launches run launch/single_node.sh with flags train.py accepts,
    # the first stopped as if preempted, the second resuming it, the third uninterrupted in another folder; then
    # dist-resume verify compares the two last checkpoints
    assert demo.endswith("bash launch/demo.sh")
    script = (REPO / "launch" / "demo.sh").read_text()
    lines = [
        line.replace('"$here/single_node.sh"', "launch/single_node.sh")
        .replace('"$dir"', "demo-ckpt")
        .replace('"$dir-reference"', "ref")
        for line in script.splitlines()
        if line.startswith("bash ")
    ]
    launches = [shlex.split(line.split(">")[0]) for line in lines]
    assert len(launches) == 3 and all(cmd[1] == "launch/single_node.sh" for cmd in launches)
    spec = importlib.util.spec_from_file_location("_docs_train", REPO / "launch" / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    first, second, reference = (train.parse_args(cmd[2:]) for cmd in launches)
    assert first.stop_after == 60 and first.stop_after < first.steps == second.steps == reference.steps
    assert second.stop_after is None and reference.stop_after is None
    assert first.ckpt_dir == second.ckpt_dir != reference.ckpt_dir and first.resume == second.resume == "auto"
    step = f"ckpt_{first.steps:08d}.pt"
    assert f'dist-resume verify "$dir/{step}" "$dir-reference/{step}"' in script


PUBLIC_MODULES = (dist_resume, dist_resume.tools, dist_resume.errors)


def _docstring_examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(recurse=True)
    tests: dict[str, doctest.DocTest] = {}
    for module in PUBLIC_MODULES[1:]:  # the public modules' own docstrings
        for test in finder.find(module, module.__name__, globs={}):
            if test.examples and test.name == module.__name__:
                tests.setdefault(test.name, test)
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if not callable(obj):
                continue
            for test in finder.find(obj, f"{module.__name__}.{name}", module=False, globs={}):
                if test.examples:
                    tests.setdefault(test.name, test)
    return sorted(tests.values(), key=lambda t: t.name)


DOCTESTS = _docstring_examples()
# Docstring examples in dist_resume/ that do not run as written. Strict: once fixed, the XPASS fails here and
# the entry must go.
DOCSTRING_DEFECTS: dict[str, str] = {}  # name -> why its example cannot run (none today)


def _doctest_params() -> list[Any]:
    return [
        pytest.param(
            t,
            id=t.name,
            marks=[pytest.mark.xfail(strict=True, reason=DOCSTRING_DEFECTS[t.name])]
            if t.name in DOCSTRING_DEFECTS
            else [],
        )
        for t in DOCTESTS
    ]


@pytest.mark.parametrize("test", _doctest_params())
def test_public_docstring_examples(test, single_cpu_process):
    test.globs = {
        "torch": torch,
        "dist_resume": dist_resume,
        **{k: v for m in PUBLIC_MODULES for k, v in vars(m).items()},
    }
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    runner.run(test, out=out.append, clear_globs=True)
    assert runner.failures == 0, "".join(out)


def test_docstring_examples_are_found():
    assert len(DOCTESTS) >= 10


def suite_figures(items: list[pytest.Item], deselected: list[pytest.Item]) -> dict[str, int]:
    """What docs/testing.md says of the suite, counted from the items pytest collected: the default suite's, whether
    or not the run selected the e2e tests too (.ci/run's `-m 'not slow'`)."""
    e2e = [i for i in [*items, *deselected] if i.get_closest_marker("e2e") and not i.get_closest_marker("slow")]
    default = [i for i in items if not i.get_closest_marker("e2e")]

    def under(folder: str) -> int:
        return sum(1 for i in default if Path(i.path).is_relative_to(REPO / "tests" / folder))

    return {
        "tests": len(default),
        "slow": sum(1 for i in deselected if i.get_closest_marker("slow")),
        "e2e": len(e2e),
        "dist": under("dist"),
        "marked dist": sum(1 for i in default if i.get_closest_marker("dist")),
        "interop": under("interop"),
        "accelerator": sum(1 for i in default if "accelerator" in getattr(i, "fixturenames", ())),
        "cuda": sum(1 for i in default if i.get_closest_marker("cuda")),
        "multigpu": sum(1 for i in default if i.get_closest_marker("multigpu")),
    }


_FIGURES = re.compile(
    r"\*\*(?P<tests>[\d,]+) tests\*\* run in the default suite \((?P<slow>\d+) more under `-m slow`, "
    r"(?P<e2e>\d+) under `-m e2e`[^)]*\): "
    r"(?P<dist>\d+) in `tests/dist/` \(multi-process, real gloo collectives; (?P<marked_dist>\d+) in the suite marked `dist`\), "
    r"(?P<interop>\d+) in `tests/interop/`.*?, (?P<accelerator>\d+) on the test accelerator's fixture \(sim and CUDA "
    r"variants\), of which (?P<cuda>\d+) are CUDA variants \(marked `cuda`, (?P<multigpu>\d+) of them also `multigpu`",
    re.S,
)


def test_testing_page_figures_are_what_pytest_collects(request: pytest.FixtureRequest) -> None:
    items, deselected = request.session.items, request.config.stash.get(DESELECTED, [])
    collected = {Path(i.path) for i in [*items, *deselected]}
    if not set((REPO / "tests").rglob("test_*.py")) <= collected or request.config.option.keyword:
        pytest.skip("the page's figures are of the whole suite: python -m pytest")
    found = _FIGURES.search(" ".join((REPO / "docs" / "testing.md").read_text().split()))
    assert found, "docs/testing.md lost its sentence of figures (see _FIGURES)"
    said = {k.replace("_", " "): int(v.replace(",", "")) for k, v in found.groupdict().items()}
    assert said == suite_figures(items, deselected), "update docs/testing.md's figures to what pytest collects"
