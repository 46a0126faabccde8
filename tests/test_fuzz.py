"""A seeded slice of the mutation fuzzer (scripts/fuzz.py) and the kept reproducers: no read path may escape,
crash, hang or allocate past its bound."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from fuzz import BAD  # noqa: E402  # the outcomes the fuzzer counts as found bugs

FUZZ_ENV = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
MANIFEST = REPO_ROOT / "tests" / "fuzz_cases" / "manifest.json"


def _fuzz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "fuzz.py"), "--jobs", "2", *args],
        env={**os.environ, **FUZZ_ENV},
        capture_output=True,
        text=True,
        timeout=200,
    )


def _no_bad_outcome(summary: dict[str, Any], output: str) -> None:
    assert summary["outcomes"].get("success", 0) > 0 and summary["outcomes"].get("refused", 0) > 0, summary
    bad = {k: v for k, v in summary["outcomes"].items() if k in BAD}
    assert not bad, output


def test_corpus_reproducers_and_a_seeded_slice_in_one_fuzz_run(tmp_path: Path) -> None:
    """scripts/fuzz.py --ci: one corpus, one worker pool (each costs seconds to build) for three guarantees."""
    out = _fuzz("--ci", "--cases", "150", "--seed", "1", "--replay", str(MANIFEST), "--out", str(tmp_path))
    output = out.stdout + out.stderr
    result = json.loads((tmp_path / "ci.json").read_text())
    # the worker's resume targets match each unmutated corpus item: otherwise the slice would fuzz refusals only
    assert result["corpus"]["cases"] > 30 and result["corpus"]["not_successful"] == [], output
    # every kept reproducer ends in success or a DistResumeError
    rows = result["replay"]
    assert len(rows) == len(json.loads(MANIFEST.read_text())), output
    still_bad = [
        f"{r['file']} ({r['path']}): {r['now']} {r['now_type']}" for r in rows if r["now"] not in ("success", "refused")
    ]
    assert not still_bad, "\n".join(still_bad)
    # 150 seeded mutations: no escape, crash, hang, memory overrun or half-restore
    assert result["fuzz"]["cases"] == 150, output
    _no_bad_outcome(result["fuzz"], out.stdout)
    assert out.returncode == 0, output


@pytest.mark.slow
def test_a_1000_case_fuzz_slice_has_no_escape_crash_or_hang(tmp_path: Path) -> None:  # 25-35 s
    out = _fuzz("--cases", "1000", "--seed", "0", "--out", str(tmp_path), "--no-minimise")
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["cases"] == 1000, out.stdout + out.stderr
    _no_bad_outcome(summary, out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------ the escapes the interop formats' corpus found (unit level)

FUZZ_CASES = REPO_ROOT / "tests" / "fuzz_cases"


@pytest.mark.parametrize("name", ["14-assertionerror_load_torch_file.pt", "21-runtimeerror_version_load_torch_file.pt"])
def test_a_damaged_torch_file_raw_torch_error_is_a_corrupt_checkpoint(name: str) -> None:
    with pytest.raises(dr.errors.CheckpointCorruptError, match="damaged"):
        dr.load_checkpoint(FUZZ_CASES / name, map_location="cpu")


@pytest.mark.parametrize(
    "name",
    [
        "15-memoryerror_read_dcp_metadata.metadata",
        "16-overflowerror_read_dcp_metadata.metadata",
        "17-keyerror_read_dcp_metadata.metadata",
        "22-memoryerror_read_dcp_metadata.metadata",
    ],
)
def test_damaged_dcp_metadata_is_refused_without_a_huge_allocation(tmp_path: Path, name: str) -> None:
    from dist_resume._foreign.dcp_metadata import read_dcp_metadata

    shutil.copy(FUZZ_CASES / name, tmp_path / ".metadata")
    with pytest.raises(dr.errors.CheckpointCorruptError, match=r"\.metadata' is damaged"):
        read_dcp_metadata(tmp_path)


def test_a_safetensors_dtype_that_is_not_a_string_is_corruption(tmp_path: Path) -> None:
    shutil.copy(FUZZ_CASES / "18-typeerror_check_entry.safetensors", tmp_path / "m.safetensors")
    with pytest.raises(dr.errors.CheckpointCorruptError, match="has dtype"):
        dr.load_checkpoint(tmp_path / "m.safetensors", map_location="cpu")


@pytest.mark.parametrize("name", ["23-typeerror_read_sharded_unhashable.json", "24-typeerror_read_sharded_order.json"])
def test_a_shard_index_mapping_to_a_non_name_is_corruption(tmp_path: Path, name: str) -> None:
    from _fuzz_corpus import _hf_sharded

    folder = _hf_sharded(tmp_path / "checkpoint-3", {"a.w": torch.ones(2), "b.w": torch.ones(3), "c.w": torch.ones(1)})
    shutil.copy(FUZZ_CASES / name, folder / "model.safetensors.index.json")
    with pytest.raises(dr.errors.CheckpointCorruptError, match="not shard file names"):
        dr.load_checkpoint(folder, map_location="cpu")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("33-recursionerror_detect_cycle.pt", r"a list at \['history'\]\[0\]\['again'\] contains itself"),
        ("34-recursionerror_detect_nesting.pt", r"containers nested more than 100 deep at \['history'\]"),
    ],
)
def test_a_pickle_built_to_overflow_the_walkers_is_not_a_checkpoint(tmp_path: Path, name: str, problem: str) -> None:
    # detection by content walks every entry; a cycle or a 3,000-deep nesting overflowed it (RecursionError)
    from _fuzz_corpus import trained

    path = FUZZ_CASES / name
    model = trained()[0]
    for read in (
        lambda: dr.resume(path, model=model, options=dr.ResumeOptions(map_location="cpu")),
        lambda: dr.load_checkpoint(path, map_location="cpu"),
        lambda: dr.tools.convert_checkpoint(path, tmp_path / "out.pt", dr.tools.KeyForm.DDP),
    ):
        with pytest.raises(dr.errors.NotACheckpointError, match=problem):
            read()
    assert not (tmp_path / "out.pt").exists()


def test_save_refuses_extra_that_contains_itself(tmp_path: Path) -> None:
    history: list[object] = [1]
    history.append(history)
    with pytest.raises(dr.errors.CheckpointWriteError, match=r"a list at \[1\] contains itself \(paths inside extra\)"):
        dr.save_checkpoint(tmp_path / "c.pt", model=torch.nn.Linear(2, 2), extra=history)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("header", ["central", "local"])
def test_a_record_flagged_encrypted_is_damage_at_every_reader(tmp_path: Path, header: str) -> None:
    """zipfile raises RuntimeError ("password required") and torch "unsupported encryption" for flag bit 0;
    torch.save never sets it, so verify_archive must not pass such a file and the readers call it damaged."""
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(3)}, path)
    data = bytearray(path.read_bytes())
    signature, flags_at = (b"PK\x01\x02", 8) if header == "central" else (b"PK\x03\x04", 6)
    at = data.index(signature) + flags_at  # the first record's general-purpose flags
    data[at] |= 0x01
    path.write_bytes(bytes(data))
    findings = dr.tools.verify_archive(path, strict=False)
    assert [f.kind for f in findings] == [dr.tools.FindingKind.UNREADABLE] and "encrypted" in str(findings[0])
    with pytest.raises(dr.errors.CheckpointCorruptError, match="encrypted"):
        dr.tools.inspect_checkpoint(path)
    with pytest.raises(dr.errors.CheckpointCorruptError):
        dr.load_checkpoint(path, map_location="cpu")


def test_the_fuzzers_encrypted_flag_files_are_damage() -> None:
    for name in sorted(FUZZ_CASES.glob("3[5-7]-runtimeerror_encrypted_*.pt")):
        with pytest.raises(dr.errors.CheckpointCorruptError, match="encrypted"):
            dr.tools.inspect_checkpoint(name)
