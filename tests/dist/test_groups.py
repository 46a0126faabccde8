"""The process groups dist_resume makes for its background threads and a node's ranks (dist_resume/_dist/groups.py)
wait as long as the default group, not gloo's 30 minutes; and no other module makes one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dist_resume._core.torch_compat.private import group_timeout
from dist_resume._dist.groups import gloo_group
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

PACKAGE = Path(__file__).resolve().parents[2] / "dist_resume"


def timeouts(rank: int, world_size: int) -> tuple[float | None, float | None, float | None]:
    import torch.distributed as dist

    every, first = gloo_group(), gloo_group([0])
    dist.barrier(group=every)
    return group_timeout(dist.group.WORLD), group_timeout(every), group_timeout(first) if rank == 0 else None


def test_a_new_group_waits_as_long_as_the_default_group(tmp_path: Path) -> None:
    results = run_ranks(timeouts, 2, tmp_path=tmp_path, pg_timeout=37.0)
    assert results == [(37.0, 37.0, 37.0), (37.0, 37.0, None)], results


def test_no_module_but_the_owner_calls_new_group() -> None:
    callers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "new_group" and path.name != "groups.py":
                callers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert callers == [], callers
