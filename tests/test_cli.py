"""The dist-resume command: convert, inspect, verify, env, errors and exit codes."""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dist_resume
from dist_resume._convert.convert import remove_stale_temps
from dist_resume.cli import main
from dist_resume.cli._common import ExitCode, ProgressBar
from tests.helpers import fake_accelerator, metadata_of, save_with_device_tag
from tests.models import compile_module

Run = Callable[..., tuple[int, str, str]]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.submodule = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 2))  # the `submodule.` trap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.submodule(self.fc(x))


def _trained(wrap: Callable[[nn.Module], nn.Module] = lambda m: m) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    model = wrap(net)
    opt = torch.optim.Adam(model.named_parameters(), lr=0.01)
    net(torch.randn(8, 4)).sum().backward()  # the inner module: no compilation, same parameters
    opt.step()
    return model, opt


def _same_tensors(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_tensors, a, b))
    return bool(a == b)


def test_single_to_ddp_to_single_round_trip(tmp_path: Path, run: Run) -> None:
    model, opt = _trained()
    original: dict[str, Any] = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}
    torch.save(original, tmp_path / "single.pt")
    assert run("convert", tmp_path / "single.pt", tmp_path / "ddp.pt", "--to", "ddp")[0] == ExitCode.OK

    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert all(k.startswith("module.") for k in ddp["model"]) and ddp["epoch"] == 3
    assert ddp["optimizer"]["param_groups"][0]["param_names"][0] == "module.fc.weight"
    target = nn.DataParallel(Net())  # same `module.` keys as DDP, on CPU
    target.load_state_dict(ddp["model"])  # plain torch, strict
    target_opt = torch.optim.Adam(target.named_parameters(), lr=0.01)
    target_opt.load_state_dict(ddp["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(target.module.state_dict().values(), original["model"].values()))

    code, out, _ = run("convert", tmp_path / "ddp.pt", tmp_path / "back.pt", "--to", "single")
    assert code == ExitCode.OK and "module. -> none" in out
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert _same_tensors(back, original)
    assert metadata_of(back["model"]) == metadata_of(original["model"])
    with zipfile.ZipFile(tmp_path / "single.pt") as a, zipfile.ZipFile(tmp_path / "back.pt") as b:
        data = [n for n in a.namelist() if "/data/" in n]
        assert data and all(a.read(n) == b.read(n) for n in data)  # tensor records byte for byte


def test_toolkit_checkpoint_converts_and_still_resumes(tmp_path: Path, run: Run) -> None:
    model, opt = _trained()
    dist_resume.save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, step=5)
    assert run("convert", tmp_path / "ckpt.pt", tmp_path / "ddp.pt", "--to", "ddp", "--quiet") == (0, "", "")
    payload = torch.load(tmp_path / "ddp.pt", weights_only=True)
    target = nn.DataParallel(Net())
    target.load_state_dict(payload["model"])
    assert payload["optimizer"]["param_groups"][0]["param_names"][0] == "module.fc.weight"
    fresh = Net()
    result = dist_resume.resume(tmp_path / "ddp.pt", model=fresh, optimizer=torch.optim.Adam(fresh.parameters()))
    assert result.step == 5 and torch.equal(fresh.fc.weight, model.get_parameter("fc.weight"))


WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,
    "ddp": nn.DataParallel,
    "compiled": compile_module,
    "ddp_of_ddp": lambda m: nn.DataParallel(nn.DataParallel(m)),
    "compile_of_ddp": lambda m: compile_module(nn.DataParallel(m)),
    "ddp_of_compiled": lambda m: nn.DataParallel(compile_module(m)),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("to", ["single", "ddp"])
def test_every_wrapping_converts(tmp_path: Path, run: Run, wrapper: str, to: str) -> None:
    model, opt = _trained(WRAPPERS[wrapper])
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict()}, tmp_path / "a.pt")
    assert run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--to", to)[0] == ExitCode.OK
    out = torch.load(tmp_path / "b.pt", weights_only=True)
    target: nn.Module = Net() if to == "single" else nn.DataParallel(Net())
    target.load_state_dict(out["model_state_dict"])
    assert list(out["model_state_dict"]) == list(target.state_dict())
    assert out["optimizer_state_dict"]["param_groups"][0]["param_names"] == [n for n, _ in target.named_parameters()]
    live = dist_resume.unwrap_model(model).get_parameter("fc.weight")
    assert torch.equal(dist_resume.unwrap_model(target).get_parameter("fc.weight"), live)


def _layouts(model_sd: dict[str, Any], opt_sd: dict[str, Any]) -> dict[str, tuple[dict[str, Any] | Any, str, str]]:
    """layout name -> (payload, model key path, optimizer key path)."""
    return {
        "bare": (model_sd, "", ""),
        "model+optimizer": ({"model": model_sd, "optimizer": opt_sd, "step": 7}, "model", "optimizer"),
        "state_dict": (
            {"state_dict": model_sd, "optimizer_states": [opt_sd], "epoch": 2, "global_step": 9},
            "state_dict",
            "optimizer_states",
        ),
        "model_state_dict": (
            {"model_state_dict": model_sd, "optimizer_state_dict": opt_sd, "loss": 0.5},
            "model_state_dict",
            "optimizer_state_dict",
        ),
    }


@pytest.mark.parametrize("layout", ["bare", "model+optimizer", "state_dict", "model_state_dict"])
def test_each_foreign_layout(tmp_path: Path, run: Run, layout: str) -> None:
    model, opt = _trained(nn.DataParallel)
    payload, model_key, opt_key = _layouts(model.state_dict(), opt.state_dict())[layout]
    torch.save(payload, tmp_path / "a.pt")
    code, out, _ = run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--to", "single", "--json")
    summary = json.loads(out)
    assert code == 0
    assert summary["layout"] == {"bare": "bare state dict", "state_dict": "lightning"}.get(layout, layout)
    assert summary["prefix_after"] == "none"
    loaded = torch.load(tmp_path / "b.pt", weights_only=True)
    Net().load_state_dict(loaded[model_key] if model_key else loaded)
    if opt_key:
        saved_opt = loaded[opt_key][0] if isinstance(loaded[opt_key], list) else loaded[opt_key]
        assert saved_opt["param_groups"][0]["param_names"][:2] == ["fc.weight", "fc.bias"]
        assert {k: v for k, v in loaded.items() if k not in (model_key, opt_key)} == {
            k: v for k, v in payload.items() if k not in (model_key, opt_key)
        }


def test_inspect_json_on_a_gpu_tagged_file(tmp_path: Path, run: Run) -> None:
    model, opt = _trained(nn.DataParallel)
    save_with_device_tag(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 4}, tmp_path / "gpu.pt", "cuda:3"
    )
    code, out, err = run("inspect", tmp_path / "gpu.pt", "--json")
    report = json.loads(out)
    assert code == 0 and err == ""
    assert report["schema"] == "dist-resume/inspect/1" and report["layout"] == "model+optimizer"
    assert set(report["device_tags"]) == {"cuda:3"}
    assert report["model"]["prefix_style"] == "module." and report["model"]["keys"] == 9
    n_params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert report["model"]["bytes"] == n_params * 4 + buffers
    optimizer = report["optimizer"]
    assert optimizer["kind"] == "Adam" and optimizer["params"] == 6 and optimizer["params_with_state"] == 6
    assert optimizer["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert optimizer["step"]["where"] == {"cuda:3": 6}
    assert optimizer["param_names"] == {"present": True, "prefix_style": "module."}
    assert report["tensors"]["by_dtype"]["float32"]["bytes"] == 3 * n_params * 4 + 6 * 4 + 2 * 3 * 4
    assert report["meta"]["epoch"] == 4 and report["scheduler"] is False
    assert any("cuda:3" in w and "rank_map_location" in w for w in report["warnings"])
    code, out, _ = run("inspect", tmp_path / "gpu.pt")
    assert code == 0 and "cuda:3" in out and "Adam" in out


def test_inspect_warns_about_mixed_prefixes_and_misfit_state(tmp_path: Path, run: Run) -> None:
    model, opt = _trained()
    sd = model.state_dict()
    mixed = {("module." + k if k.startswith("fc") else k): v for k, v in sd.items()}
    opt_sd = opt.state_dict()
    opt_sd["state"][0]["exp_avg"] = torch.zeros(5, 5)  # fc.weight is (3, 4)
    torch.save({"model": mixed, "optimizer": opt_sd}, tmp_path / "a.pt")
    report = json.loads(run("inspect", tmp_path / "a.pt", "--json")[1])
    assert report["model"]["prefix_style"] == "mixed"
    warnings = "\n".join(report["warnings"])
    assert "mix prefixes" in warnings
    assert "state['fc.weight']['exp_avg'] is (5, 5), the parameter (3, 4)" in warnings


def test_verify_equal_and_different(tmp_path: Path, run: Run) -> None:
    model, opt = _trained()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    assert run("convert", tmp_path / "a.pt", tmp_path / "ddp.pt", "--to", "ddp", "-q")[0] == 0
    code, out, _ = run("verify", tmp_path / "a.pt", tmp_path / "ddp.pt", "--json")
    report = json.loads(out)
    assert code == ExitCode.OK and report["equal"] and report["differences"] == []
    assert (
        report["compared"] == {"model_tensors": 9, "optimizer_tensors": 18, "bytes": report["compared"]["bytes"]}
        and report["compared"]["bytes"] > 0
    )

    changed = model.state_dict()
    changed["submodule.1.bias"] = changed["submodule.1.bias"].clone()
    changed["submodule.1.bias"][0] += 1
    opt_sd = opt.state_dict()
    opt_sd["state"][1]["exp_avg"] = opt_sd["state"][1]["exp_avg"].double()
    torch.save({"model": changed, "optimizer": opt_sd}, tmp_path / "b.pt")
    code, out, _ = run("verify", tmp_path / "ddp.pt", tmp_path / "b.pt", "--json")
    report = json.loads(out)
    assert code == ExitCode.DIFFERENT and not report["equal"]
    assert {"part": "model", "key": "submodule.1.bias", "problem": "values differ (max |a-b| = 1.0e+00)"} in report[
        "differences"
    ]
    assert {"part": "optimizer", "key": "fc.bias exp_avg", "problem": "dtype float32 in A, float64 in B"} in report[
        "differences"
    ]
    code, out, _ = run("verify", tmp_path / "ddp.pt", tmp_path / "b.pt")
    assert code == 1 and "submodule.1.bias: values differ" in out


def test_env_reports_what_torchrun_set(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    code, out, _ = run("env", "--json")
    report = json.loads(out)
    assert code == 0 and len(out.strip().splitlines()) == 1  # one line per rank
    assert report["rank_info"] == {
        "rank": 3,
        "local_rank": 1,
        "world_size": 4,
        "local_world_size": 2,
        "node_rank": 1,
        "is_distributed": True,
    }
    assert report["device"] == "cpu" and report["backend"] == "gloo" and report["launched_by_torchrun"]
    assert report["torchrun"]["GROUP_RANK"] == "1" and report["schema"] == "dist-resume/env/2"
    assert report["accelerator"] == {
        "type": None,
        "device_count": 0,
        "visible_devices_variable": None,
        "visible_devices": None,
    }
    code, out, _ = run("env")
    assert code == 0 and all(line.startswith("[rank 3] ") for line in out.splitlines())
    monkeypatch.setenv("LOCAL_RANK", "2")
    code, out, err = run("env")
    assert code == ExitCode.INPUT and "LOCAL_RANK=2" in err and "hint:" in err


def test_env_reports_the_accelerator(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.accelerator faked: the report's wording; a real device comes with the test accelerator (tests/accelerator)
    fake_accelerator(monkeypatch, "xpu", count=2)
    monkeypatch.setattr(dist, "is_backend_available", lambda name: name in ("gloo", "xccl"))
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    monkeypatch.setenv("ONEAPI_DEVICE_SELECTOR", "level_zero:0,1")
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    code, out, _ = run("env", "--json")
    report = json.loads(out)
    assert code == 0 and report["device"] == "xpu:1" and report["backend"] == "xccl"
    assert report["accelerator"] == {
        "type": "xpu",
        "device_count": 2,
        "visible_devices_variable": "ONEAPI_DEVICE_SELECTOR",
        "visible_devices": "level_zero:0,1",
    }
    code, out, _ = run("env")
    assert "device       xpu:1 (2 xpu device(s), ONEAPI_DEVICE_SELECTOR=level_zero:0,1)" in out
    assert "backend      xccl" in out


def _evil(path: Path, marker: Path) -> None:
    class RunsCode:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.ones(2), "x": RunsCode()}, path)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", "does not exist"),
        ("empty", "is empty"),
        ("truncated", "damaged or truncated"),
        ("not_zip", "not a file written by torch.save"),
        ("unsafe", "posix.system"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "convert", "verify"])
def test_bad_inputs_exit_2_with_one_line_and_a_hint(
    tmp_path: Path, run: Run, kind: str, message: str, command: str
) -> None:
    bad, marker = tmp_path / "bad.pt", tmp_path / "marker"
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "truncated":
        torch.save({"w": torch.randn(1000)}, bad)
        bad.write_bytes(bad.read_bytes()[:2000])
    elif kind == "not_zip":
        bad.write_text("hello\n")
    elif kind == "unsafe":
        _evil(bad, marker)
    commands: dict[str, list[Any]] = {
        "inspect": [bad],
        "convert": [bad, tmp_path / "out.pt", "--to", "ddp"],
        "verify": [bad, bad],
    }
    args = commands[command]
    code, out, err = run(command, *args)
    lines = err.splitlines()
    assert code == ExitCode.INPUT and out == ""
    assert len(lines) == 2 and lines[0].startswith(f"dist-resume {command}: error: ") and message in lines[0]
    assert lines[1].startswith("hint: ")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(
    ("inner", "code"),
    [
        (dist_resume.errors.NotACheckpointError("'a.pt' holds a sparse tensor"), ExitCode.INPUT),
        (dist_resume.errors.CheckpointWriteError("disk full"), ExitCode.WRITE),
        (ValueError("a bug"), ExitCode.INTERNAL),
    ],
)
def test_a_dcp_checkpoint_exception_is_reported_as_the_error_it_wraps(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch, inner: Exception, code: ExitCode
) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    def convert(*args: Any, **kwargs: Any) -> None:  # DCP wraps each rank's exception in a BaseException
        raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (inner, traceback.StackSummary())})

    monkeypatch.setattr("dist_resume._convert.convert.convert_checkpoint", convert)
    got, _, err = run("convert", tmp_path / "a.pt", tmp_path / "b.dcp", "--format", "dcp")
    assert got == code
    assert (str(inner) in err.splitlines()[0]) == (code != ExitCode.INTERNAL)
    assert ("internal error" in err) == (code == ExitCode.INTERNAL)


def test_convert_refuses_same_file_and_existing_dst(tmp_path: Path, run: Run) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    before = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "link.pt").symlink_to(tmp_path / "a.pt")
    os.link(tmp_path / "a.pt", tmp_path / "hard.pt")
    for dst in ("a.pt", "link.pt", "hard.pt"):
        code, _, err = run("convert", tmp_path / "a.pt", tmp_path / dst, "--to", "ddp", "--force")
        assert code == ExitCode.INPUT and "same file" in err
    assert (tmp_path / "a.pt").read_bytes() == before

    (tmp_path / "b.pt").write_bytes(b"keep me")
    code, _, err = run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--to", "ddp")
    assert code == ExitCode.INPUT and "already exists" in err and "--force" in err
    assert (tmp_path / "b.pt").read_bytes() == b"keep me"
    assert run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--to", "ddp", "--force", "-q")[0] == 0
    assert list(torch.load(tmp_path / "b.pt", weights_only=True)) == ["module.w"]

    code, _, err = run("convert", tmp_path / "a.pt", tmp_path / "no" / "such" / "c.pt", "--to", "ddp")
    assert code == ExitCode.WRITE and "does not exist" in err
    assert run("convert", tmp_path / "a.pt", tmp_path / "d.pt")[0] == ExitCode.INPUT  # --to is required


def test_check_crc_refuses_a_damaged_source(tmp_path: Path, run: Run) -> None:
    torch.save({"w": torch.randn(100)}, tmp_path / "a.pt")
    raw = bytearray((tmp_path / "a.pt").read_bytes())
    offset = raw.index(b"PK\x03\x04", raw.index(b"a/data/0") - 40)  # header of the data record
    raw[offset + 200] ^= 0xFF
    (tmp_path / "a.pt").write_bytes(bytes(raw))
    code, _, err = run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--to", "ddp", "--check-crc")
    assert code == ExitCode.INPUT and "CRC32 mismatch" in err and not (tmp_path / "b.pt").exists()


def test_remove_stale_temps_spares_live_and_foreign_files(tmp_path: Path) -> None:
    dst = tmp_path / "out.pt"
    stale, live = tmp_path / ".out.pt.0123456789abcdef.tmp", tmp_path / ".out.pt.fedcba9876543210.tmp"
    other, notes = tmp_path / ".other.pt.0123456789abcdef.tmp", tmp_path / ".out.pt.notes.tmp"
    for p in (stale, live, other, notes):
        p.write_bytes(b"x")
    with open(live, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        assert remove_stale_temps(dst) == [stale]
    assert live.exists() and other.exists() and notes.exists() and not stale.exists()


def test_progress_bar_only_on_a_terminal_after_a_moment() -> None:
    assert not ProgressBar.for_stderr("x", quiet=False)._enabled  # pytest's stderr is not a TTY
    stream = io.StringIO()
    bar = ProgressBar("converting", enabled=True, stream=stream, delay=0.0)
    bar(50, 100)
    bar.close()
    assert "converting" in stream.getvalue() and "50%" in stream.getvalue() and stream.getvalue().endswith("\n")
    quiet = io.StringIO()
    slow_start = ProgressBar("converting", enabled=True, stream=quiet, delay=60.0)
    slow_start(100, 100)
    slow_start.close()
    assert quiet.getvalue() == ""


def _python(*args: Any, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dist_resume", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_python_dash_m_exit_codes_and_stderr(tmp_path: Path) -> None:
    help_ = _python("--help")
    assert help_.returncode == 0 and "exit status" in help_.stdout and "130" in help_.stdout
    (tmp_path / "a.txt").write_text("nope")
    bad = _python("inspect", tmp_path / "a.txt")
    assert bad.returncode == 2 and bad.stdout == ""
    # ours is exactly one error line and one hint; `import torch` itself may warn first (no numpy installed)
    ours = bad.stderr[bad.stderr.index("dist-resume inspect: error: ") :].splitlines()
    assert len(ours) == 2 and ours[1].startswith("hint: ")
    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    torch.save({"module.w": torch.zeros(3)}, tmp_path / "b.pt")
    diff = _python("verify", tmp_path / "a.pt", tmp_path / "b.pt")
    assert diff.returncode == 1 and "w: values differ" in diff.stdout


def test_killed_conversion_leaves_no_dst_and_the_next_run_cleans_up(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(50_000_000)}, tmp_path / "big.pt")  # 200 MB
    dst = tmp_path / "out.pt"
    slowed = (  # the real command, with the record copy slowed down so the kill lands in the middle of it
        "import sys, time\n"
        "import dist_resume._convert.archive_write as w\n"
        "copy = w._copy_range\n"
        "w._copy_range = lambda *a: (time.sleep(0.05), copy(*a))\n"
        "w._COPY_CHUNK = 4 << 20\n"
        "from dist_resume.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", slowed, "convert", str(tmp_path / "big.pt"), str(dst), "--to", "ddp"],
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            temps = list(tmp_path.glob(".out.pt.*.tmp"))
            if temps and temps[0].stat().st_size > 20 << 20:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the conversion finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists() and len(list(tmp_path.glob(".out.pt.*.tmp"))) == 1
    assert main(["convert", str(tmp_path / "big.pt"), str(dst), "--to", "ddp", "--quiet"]) == 0
    assert list(tmp_path.glob(".*.tmp")) == []
    assert torch.equal(
        torch.load(dst, weights_only=True, mmap=True)["module.w"],
        torch.load(tmp_path / "big.pt", weights_only=True, mmap=True)["w"],
    )


def test_inspect_describes_a_file_in_no_known_layout(tmp_path: Path, run: Run) -> None:
    torch.save({"ema": [torch.ones(2)], "net": {"w": torch.ones(2, dtype=torch.float64), "n": 1}}, tmp_path / "a.pt")
    code, out, _ = run("inspect", tmp_path / "a.pt", "--json")
    report = json.loads(out)
    assert code == 0 and report["layout"] is None and report["model"] is None
    assert report["tensors"]["by_dtype"] == {"float32": {"count": 1, "bytes": 8}, "float64": {"count": 1, "bytes": 16}}
    assert report["extra_keys"] == ["ema", "net"] and "no model state dict" in report["warnings"][0]
    code, _, err = run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--to", "ddp")
    assert code == ExitCode.INPUT and "'ema', 'net'" in err and not (tmp_path / "b.pt").exists()


def test_convert_refuses_keys_that_would_collide(tmp_path: Path, run: Run) -> None:
    torch.save({"fc.weight": torch.ones(2), "module.fc.weight": torch.zeros(2)}, tmp_path / "a.pt")
    code, _, err = run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--to", "single")
    assert code == ExitCode.INPUT and "collide" in err and "'fc.weight' and 'module.fc.weight'" in err
    assert not (tmp_path / "b.pt").exists()


@pytest.mark.skipif(shutil.which("dist-resume") is None, reason="package not installed (pip install -e .)")
def test_console_script(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    done = subprocess.run(
        ["dist-resume", "inspect", str(tmp_path / "a.pt"), "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and json.loads(done.stdout)["layout"] == "bare state dict"


@pytest.mark.dist
def test_env_under_torchrun_one_json_line_per_rank() -> None:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.Popen(
        [torchrun, "--standalone", "--nproc_per_node=2", "-m", "dist_resume", "env", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    reports = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["rank_info"]["rank"])
    assert [r["rank_info"]["local_rank"] for r in reports] == [0, 1]
    assert all(
        r["rank_info"]["world_size"] == 2 and r["launched_by_torchrun"] and r["backend"] == "gloo" for r in reports
    )
    assert reports[0]["torchrun"]["MASTER_PORT"] == reports[1]["torchrun"]["MASTER_PORT"] is not None
