"""The one tensor walker: paths, containers walked once (cycles from a pickle), identity when nothing changed."""

from __future__ import annotations

from collections import OrderedDict

import torch

from dist_resume._core.tree import MAX_NESTING, iter_tensors, map_tensors, named_tensors, structure_problem
from tests.helpers import metadata_of


def test_named_tensors_paths_follow_the_containers():
    a, b, c = torch.zeros(1), torch.ones(1), torch.zeros(2)
    got = list(named_tensors({"state": {0: [a, (b,)]}, "x": 3, "c": c}, "opt"))
    assert [p for p, _ in got] == ["opt['state'][0][0]", "opt['state'][0][1][0]", "opt['c']"]
    assert got[0][1] is a and got[1][1] is b and got[2][1] is c


def test_iter_tensors_survives_cycles_and_walks_sets():
    t = torch.zeros(1)
    loop: list[object] = [t]
    loop.append(loop)
    assert list(iter_tensors(loop)) == [t]
    assert list(iter_tensors({"s": frozenset({t})})) == [t]


def test_map_tensors_shares_unchanged_containers_only_when_asked():
    sd = OrderedDict(w=torch.zeros(1), hist=[torch.zeros(1)])
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    same = map_tensors(sd, lambda t: t, share_unchanged=True)
    assert same is sd
    copied = map_tensors(sd, lambda t: t)
    assert copied is not sd and type(copied) is OrderedDict and metadata_of(copied) == metadata_of(sd)
    doubled = map_tensors(sd, lambda t: t + 1, share_unchanged=True)
    assert doubled is not sd and doubled["hist"][0].item() == 1 and type(doubled["hist"]) is list


def test_structure_problem_names_a_cycle_and_too_deep_nesting_but_not_sharing():
    shared = {"w": torch.zeros(1)}
    assert structure_problem({"a": shared, "b": [shared, (shared,)]}) is None  # one object twice is no cycle
    cyclic: list[object] = []
    cyclic.append({"x": cyclic})
    assert structure_problem({"model": {}, "extra": cyclic}) == "a list at ['extra'][0]['x'] contains itself"
    assert structure_problem(cyclic) == "a list at [0]['x'] contains itself"
    deep: object = 1
    for _ in range(MAX_NESTING + 1):
        deep = [deep]
    assert structure_problem({"extra": deep}) == f"containers nested more than {MAX_NESTING} deep at ['extra']"
    ok: object = 1
    for _ in range(MAX_NESTING - 1):
        ok = [ok]
    assert structure_problem({"extra": ok}) is None
