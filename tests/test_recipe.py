"""docs/recipe-torchvision.md is the difference between torchvision's reference trainer and the same trainer with
dist_resume (tests/user_loops/), as difflib makes it; the page's line count is what this counts. The two scripts run
under torchrun in tests/dist/test_reference_trainer.py."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE, AFTER = ROOT / "tests/user_loops/torchvision_train.py", ROOT / "tests/user_loops/torchvision_train_resumable.py"
PAGE = ROOT / "docs/recipe-torchvision.md"


def _diff() -> list[str]:
    before, after = BEFORE.read_text().splitlines(), AFTER.read_text().splitlines()
    return list(difflib.unified_diff(before, after, BEFORE.name, AFTER.name, n=1, lineterm=""))


def test_the_page_shows_the_difference_between_the_two_scripts():
    shown = re.search(r"```diff\n(.*?)\n```", PAGE.read_text(), re.S)
    assert shown is not None, "docs/recipe-torchvision.md has no ```diff block"
    assert shown.group(1).splitlines() == _diff(), "regenerate the page's diff block from the two scripts"


def test_the_recipe_is_at_most_20_changed_lines_and_the_page_says_how_many():
    diff = _diff()
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    written = [line for line in added if line[1:].strip()]
    assert len(written) <= 20, len(written)
    assert f"+{len(added)}/−{len(removed)}" in PAGE.read_text()
