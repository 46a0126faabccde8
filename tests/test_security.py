"""The torch security floor: one warning per process when torch predates the weights_only fixes."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
import torch

from dist_resume._core import security
from dist_resume._core.security import SAFE_TORCH, TorchSecurityWarning, torch_release, warn_if_unsafe_torch


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(security, "_warned", False)
    return monkeypatch


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("2.13.0", (2, 13, 0)),
        ("2.9.1+cu126", (2, 9, 1)),
        ("2.10.0a0+git1234abc", (2, 10, 0)),
        ("2.5", (2, 5, 0)),
        ("garbage", None),
    ],
)
def test_torch_release_parses_local_and_pre_release_versions(version: str, release: object) -> None:
    assert torch_release(version) == release


@pytest.mark.parametrize(
    ("version", "cves"),
    [("2.5.1", ["CVE-2025-32434", "CVE-2026-24747"]), ("2.9.1+cpu", ["CVE-2026-24747"])],
)
def test_an_old_torch_warns_once_naming_the_cves_and_the_fixed_release(
    fresh: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: str, cves: list[str]
) -> None:
    fresh.setattr(torch, "__version__", version)
    with pytest.warns(TorchSecurityWarning) as record, caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert warn_if_unsafe_torch() is True
        assert warn_if_unsafe_torch() is False  # once per process
    assert len(record) == 1
    message = str(record[0].message)
    assert f"torch {version}" in message and "2.10.0" in message and "upgrade torch" in message
    for cve in ("CVE-2025-32434", "CVE-2026-24747"):
        assert (cve in message) == (cve in cves), message
    assert [r.getMessage() for r in caplog.records] == [message]


@pytest.mark.parametrize("version", ["2.10.0", "2.13.0+cpu", "3.0.0", "not a version"])
def test_a_safe_torch_is_silent(fresh: pytest.MonkeyPatch, version: str) -> None:
    fresh.setattr(torch, "__version__", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_unsafe_torch() is False


def test_the_package_requires_the_floor() -> None:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floor = ".".join(map(str, SAFE_TORCH[:2]))
    assert re.search(rf'^dependencies = \["torch>={re.escape(floor)}"\]$', text, re.M), "pyproject's torch floor"
    assert torch_release(str(torch.__version__)) >= SAFE_TORCH  # type: ignore[operator]  # the tests' torch
