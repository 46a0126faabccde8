"""A seeded slice of the mutation fuzzer (scripts/fuzz.py) and the kept reproducers: no read path may escape,
crash, hang or allocate past its bound."""

from __future__ import annotations

import copy
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

from _fuzz_pool import BAD  # noqa: E402  # the outcomes the fuzzer counts as found bugs

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


@pytest.mark.e2e
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


# ------------------------------------------------ what structure-aware fuzzing of every path found (issue 28)


@pytest.mark.parametrize("value", [1.5, None, [0.1, 0.2], {"value": 1.0}])
def test_a_model_entry_that_is_not_a_tensor_is_refused_before_anything_changes(tmp_path: Path, value: Any) -> None:
    """A model weight replaced by a float passed the plan; load_state_dict copied the weights around it, then raised,
    and nothing had kept a copy to put back (a half-restore). The plan refuses it now, strict or not."""
    from _fuzz_corpus import trained

    from tests.models import assert_same, snapshot

    model, opt, sched, scaler = trained()
    path = dr.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scheduler=sched, scaler=scaler, step=1)
    obj = torch.load(path, weights_only=True)
    obj["model"]["fc2.weight"] = value
    torch.save(obj, path)
    live = trained(seed=5, steps=3)
    frozen = snapshot(*live)
    for options in (None, dr.ResumeOptions(strict=False), dr.ResumeOptions(map_location="cpu")):
        with pytest.raises(dr.errors.KeyMismatchError) as info:
            dr.resume(path, model=live[0], optimizer=live[1], scheduler=live[2], scaler=live[3], options=options)
        found = {float: "a float", type(None): "None", list: "a list", dict: "a dict"}[type(value)]
        assert f"fc2.weight: checkpoint {found}, model a (4, 16) tensor" in str(info.value)
        assert "damaged or edited" in str(info.value)
        assert info.value.mismatched and info.value.mismatched[0].startswith("fc2.weight"), options
        assert_same(snapshot(*live), frozen, str(options))


def _own_file(tmp_path: Path, edit: Any, name: str = "c.pt") -> Path:
    """A dist_resume file of the fuzz corpus's objects (an EMA and RNG streams too) with ``edit(obj)`` applied."""
    from _fuzz_corpus import averaged, trained

    model, opt, sched, scaler = trained()
    path = Path(
        dr.save_checkpoint(
            tmp_path / name, model=model, optimizer=opt, scheduler=sched, scaler=scaler, ema=averaged(model), rng=True
        )
    )
    obj = torch.load(path, weights_only=True)
    edit(obj)
    torch.save(obj, path)
    return path


def _refused_and_unchanged(path: Path, error: type[Exception], words: str) -> None:
    """``resume`` of ``path`` (default and lenient options) raises ``error`` saying ``words``; nothing changes."""
    import random

    from _fuzz_corpus import averaged, trained

    from tests.models import assert_same, snapshot

    model, opt, sched, scaler = trained(seed=5, steps=3)
    ema = averaged(model, 3)
    frozen = {**snapshot(model, opt, sched, scaler), "ema": snapshot(ema)["model"]}
    for options in (None, dr.ResumeOptions(strict=False, allow_missing="all")):
        streams = random.getstate(), torch.get_rng_state()
        with pytest.raises(error, match=words):
            dr.resume(path, model=model, optimizer=opt, scheduler=sched, scaler=scaler, ema=ema, options=options)
        assert_same({**snapshot(model, opt, sched, scaler), "ema": snapshot(ema)["model"]}, frozen, str(options))
        assert random.getstate() == streams[0] and torch.equal(torch.get_rng_state(), streams[1])


@pytest.mark.parametrize(
    ("stream", "value", "words"),
    [
        ("torch", 1.5, "the torch stream is a float, not a tensor"),
        ("torch", torch.zeros(0, dtype=torch.uint8), r"the torch stream is refused \(RuntimeError"),
        ("python", (3, (1, 2), None), r"the python stream holds 2 ints, not the 625 of random.getstate\(\)"),
        ("numpy", {"bit_generator": "MT19937", "keys": torch.zeros(3, dtype=torch.int64)}, "the numpy stream"),
        ("numpy", {"keys": 7}, "the numpy stream is not a mapping with a 'keys' tensor"),
    ],
)
def test_a_damaged_rng_stream_is_refused_before_anything_changes(
    tmp_path: Path, stream: str, value: Any, words: str
) -> None:
    """The plan checked only that each rank's entry had 'python' and 'torch' keys: a stream torch, random or numpy
    refuses failed in the commit, after the model and the optimizer were restored (a RestoreError, undone)."""

    def edit(obj: dict[str, Any]) -> None:
        obj["rng"][0][stream] = value

    path = _own_file(tmp_path, edit)
    _refused_and_unchanged(path, dr.errors.StateMismatchError, f"RNG state of rank 0 .*{words}")
    state = dr.rng_state_dict()
    state[stream] = value
    before = torch.get_rng_state()
    with pytest.raises(dr.errors.StateMismatchError, match=words):  # the public loader refuses it first too
        dr.load_rng_state_dict(state)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda obj: obj["scaler"].update(scale=1e308), r"scale is refused \(RuntimeError: value cannot be converted"),
        (lambda obj: obj["scaler"].update(_growth_tracker=2**40), r"_growth_tracker is refused \(RuntimeError"),
        (
            lambda obj: obj["rng"][0].update(device={"type": "cpu"}),
            r"the device stream is a mapping with keys \['type'\]",
        ),
        (lambda obj: obj["rng"][0].update(device=[1, 2]), "the device stream is a list, not"),
        (lambda obj: obj.update(scaler=torch.zeros(3)), "the GradScaler entry is a Tensor, not a state dict"),
    ],
)
def test_a_scaler_number_past_its_dtype_or_a_malformed_device_stream_is_refused_before_anything_changes(
    tmp_path: Path, edit: Any, words: str
) -> None:
    """GradScaler.load_state_dict fills float32 and int32 tensors with the saved numbers (1e308 overflows), and
    load_rng_state_dict checked the device stream's form only when it ran, in the commit: both failed after the model
    and the optimizer were restored (RestoreError, undone)."""
    _refused_and_unchanged(_own_file(tmp_path, edit), dr.errors.StateMismatchError, words)


def test_scheduler_states_a_lambda_or_an_inner_scheduler_cannot_take_are_refused(tmp_path: Path) -> None:
    """LambdaLR and SequentialLR load their attributes, then each lambda's or inner scheduler's state: one that does
    not fit failed half-way through, in the commit."""
    from tests.models import assert_same, snapshot

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        inner = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5), torch.optim.lr_scheduler.StepLR(opt, 2)]
        return model, opt, torch.optim.lr_scheduler.SequentialLR(opt, inner, milestones=[1])

    model, opt, sched = build(0)
    path = dr.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scheduler=sched)
    obj = torch.load(path, weights_only=True)
    for name, edit in {
        "lr_lambdas": lambda sd: sd["_schedulers"][0].update(lr_lambdas=[1.5]),
        "_schedulers": lambda sd: sd["_schedulers"].pop(),
    }.items():
        bad = copy.deepcopy(obj)
        edit(bad["scheduler"])
        torch.save(bad, tmp_path / "bad.pt")
        model, opt, sched = build(1)
        sched.step()
        frozen = snapshot(model, opt, sched)
        with pytest.raises(dr.errors.StateMismatchError, match=f"the LR scheduler's '{name}' are not one state per"):
            dr.resume(tmp_path / "bad.pt", model=model, optimizer=opt, scheduler=sched)
        assert_same(snapshot(model, opt, sched), frozen, name)


@pytest.mark.parametrize("value", [1.5, torch.zeros(2), "3"])
def test_an_ema_count_that_is_not_a_tensor_of_its_shape_is_refused_before_anything_changes(
    tmp_path: Path, value: Any
) -> None:
    """AveragedModel's ``n_averaged`` was taken from the file unchecked: load_state_dict copied the EMA's weights,
    then refused it (a RestoreError; the undo found no copy of the EMA to put back)."""

    def edit(obj: dict[str, Any]) -> None:
        obj["ema"]["n_averaged"] = value

    path = _own_file(tmp_path, edit)
    _refused_and_unchanged(path, dr.errors.KeyMismatchError, "the EMA's 'n_averaged' is .*damaged or was edited")


def test_meta_and_model_keys_of_another_type_are_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ``optimizer_class`` that was a tensor reached ``if saved_class`` in the plan (RuntimeError: Boolean value of
    Tensor ... is ambiguous); model keys that are not strings reached str methods. Every reader refuses them now."""
    from dist_resume.cli import main

    good = _own_file(tmp_path, lambda obj: None, "good.pt")
    bad_class = _own_file(tmp_path, lambda obj: obj["meta"].update(optimizer_class=torch.zeros(3)), "class.pt")
    _refused_and_unchanged(bad_class, dr.errors.NotACheckpointError, "'optimizer_class' is a Tensor, not a str")
    bad_meta = _own_file(tmp_path, lambda obj: obj.update(meta=torch.zeros(3)), "meta.pt")  # `or {}` raised
    _refused_and_unchanged(bad_meta, dr.errors.NotACheckpointError, "its 'meta' entry is Tensor, not a mapping")
    bad_key = _own_file(tmp_path, lambda obj: obj["model"].update({7: torch.ones(1)}), "key.pt")
    _refused_and_unchanged(bad_key, dr.errors.NotACheckpointError, r"model state has keys that are not strings \(7\)")
    for path in (
        bad_class,
        bad_meta,
        bad_key,
    ):  # inspect, verify and convert refuse it as list and the manager do (exit status 2, no traceback)
        assert main(["inspect", str(path)]) == 2
        assert "is marked as a dist_resume checkpoint but" in capsys.readouterr().err
        assert main(["convert", str(path), str(tmp_path / "o.pt"), "--to", "ddp"]) == 2
        assert "is marked as a dist_resume checkpoint but its" in capsys.readouterr().err
        assert main(["verify", str(good), str(path)]) == 2
        assert "is marked as a dist_resume checkpoint but" in capsys.readouterr().err


def test_convert_to_the_sharded_format_refuses_an_ema_entry_that_is_not_a_state_dict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dist_resume.cli import main

    path = _own_file(tmp_path, lambda obj: obj.update(ema=[obj["ema"]]))  # split_payload: dict(list) ValueError
    assert main(["convert", str(path), str(tmp_path / "ckpt_1.dcp"), "--format", "sharded"]) == 2
    assert "its EMA entry is a list, not a state dict" in capsys.readouterr().err
    assert not (tmp_path / "ckpt_1.dcp").exists()


def test_a_whole_number_past_float_range_is_a_number(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dist_resume.cli import main

    torch.save({"MODEL_STATE": {"w": torch.ones(2)}, "EPOCHS_RUN": 10**400}, tmp_path / "snapshot.pt")
    assert main(["inspect", str(tmp_path / "snapshot.pt"), "--json"]) == 0  # float() of it raised OverflowError
    assert json.loads(capsys.readouterr().out)["meta"]["epoch"] == 10**400


@pytest.mark.parametrize(
    ("name", "value"), [("amsgrad", torch.zeros(3)), ("fused", torch.zeros(3)), ("betas", (0.9,)), ("lr", "0.1")]
)
def test_a_hyperparameter_of_another_kind_than_the_live_one_is_refused_before_anything_changes(
    tmp_path: Path, name: str, value: Any
) -> None:
    """An Adam group's ``amsgrad`` (a flag) or ``fused`` (None or a flag) that is a tensor reached a truth test in the
    plan's checks or in torch's load_state_dict, after the model was restored; ``betas`` of one number and a string
    ``lr`` would fail at the first step."""
    from tests.models import assert_same, snapshot

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        return model, opt

    saved_model, saved_opt = build(0)
    path = dr.save_checkpoint(tmp_path / "c.pt", model=saved_model, optimizer=saved_opt)
    obj = torch.load(path, weights_only=True)
    obj["optimizer"]["param_groups"][0][name] = value
    torch.save(obj, path)
    model, opt = build(1)
    frozen = snapshot(model, opt)
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match=f"of another kind than this optimizer's .*{name}="):
        dr.resume(path, model=model, optimizer=opt)
    assert_same(snapshot(model, opt), frozen)


_MALFORMED_OPTIMIZERS: dict[str, Any] = {
    "group not a mapping": lambda o: o["param_groups"].__setitem__(0, 3),
    "params not a list": lambda o: o["param_groups"][0].__setitem__("params", 0),
    "params missing": lambda o: o["param_groups"][0].pop("params"),
    "an id that is a dict": lambda o: o["param_groups"][0]["params"].__setitem__(0, {"a": 1}),
    "an id twice": lambda o: o["param_groups"][0]["params"].__setitem__(1, 0),
    "a state entry that is a float": lambda o: o["state"].__setitem__(0, 1.5),
    "param_names of ints": lambda o: o["param_groups"][0].__setitem__("param_names", [0, 1, 2, 3]),
    "param_names too short": lambda o: o["param_groups"][0].__setitem__("param_names", ["fc1.weight"]),
}


@pytest.mark.parametrize("name", sorted(_MALFORMED_OPTIMIZERS))
def test_optimizer_state_not_in_state_dict_form_is_said_by_every_reader(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect, verify and convert to every format read the optimizer entry without the plan's check of its form
    (KeyError, TypeError, AttributeError out of the CLI); one check of the form serves every reader now."""
    from dist_resume.cli import main

    good = _own_file(tmp_path, lambda obj: None, "good.pt")
    path = _own_file(tmp_path, lambda obj: _MALFORMED_OPTIMIZERS[name](obj["optimizer"]))
    _refused_and_unchanged(path, dr.errors.OptimizerStateMismatchError, "it was not written by Optimizer.state_dict")
    assert main(["inspect", str(path)]) == 0  # inspect describes the file and says what is wrong
    assert "the optimizer entry " in capsys.readouterr().out
    assert main(["verify", str(good), str(path), "--json"]) == 1  # verify: a difference, not a crash
    assert json.loads(capsys.readouterr().out)["differences"][-1]["part"] == "optimizer"
    for fmt, dst, extra in (
        ("pt", "ddp.pt", ["--to", "ddp"]),
        ("dcp", "out_dcp", []),
        ("sharded", "ckpt_7.dcp", []),
    ):
        assert main(["convert", str(path), str(tmp_path / dst), "--format", fmt, *extra]) == 2, fmt
        assert "it was not written by Optimizer.state_dict()" in capsys.readouterr().err
        assert not (tmp_path / dst).exists()
