"""The store layer: URLs never taken for local paths, RemotePath's answers, ranged reads, uploads committed by their
last write (on ``memory://``, fsspec's in-process store; tests/test_s3.py runs the same promises against S3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._core.location import RemotePath, local_path
from dist_resume._store.ranges import READ_STATS, RangeFile, cached_copy
from dist_resume._store.upload import conditional_put, put_if_absent, upload
from dist_resume._store.url import is_url, location
from dist_resume.errors import UsageError

fsspec = pytest.importorskip("fsspec")


def test_urls_and_paths_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert location("ckpts") == Path("ckpts") and location(Path("a/b")) == Path("a/b")
    assert location("C:\\ckpts") == Path("C:\\ckpts")  # a drive letter is not a protocol
    assert location(f"file://{tmp_path}/x") == tmp_path / "x"
    remote = location("memory://run/a")
    assert isinstance(remote, RemotePath) and str(remote) == "memory://run/a" and remote.name == "a"
    assert (remote.parent / "b").key == "/run/b" and remote.suffix == "" and is_url("s3://b/k") and not is_url("a")
    assert location(remote) is remote and RemotePath("memory", "/run/a") == remote
    with pytest.raises(TypeError):
        open(remote)  # type: ignore[call-overload]  # never a local path by accident
    with pytest.raises(TypeError, match="local files only"):
        local_path(remote, "this reader")
    for collapsed in ("s3:/bucket/run", Path("s3://bucket/run"), "memory:/run"):
        with pytest.raises(UsageError, match="collapsed") as info:
            location(collapsed)
        assert "as a str" in info.value.hint
    assert not list(tmp_path.iterdir())  # no folder named "s3:" appeared


def test_a_protocol_without_its_backend_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fsspec.get_filesystem_class

    def missing(protocol: str) -> type:
        if protocol in ("gs", "s3"):
            raise ImportError(f"Install the backend of {protocol}")
        return real(protocol)

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(UsageError) as info:
        location("gs://bucket/run")
    assert 'pip install "dist_resume[gcs]"' in info.value.hint and "gcsfs" in info.value.hint
    with pytest.raises(UsageError) as info:
        dr.CheckpointManager("s3://bucket/run")
    assert "dist_resume[s3]" in info.value.hint and "s3fs" in info.value.hint
    with pytest.raises(UsageError, match="knows no implementation"):
        location("nosuchproto://x")
    with pytest.raises(UsageError, match="apply to a URL"):
        location("local/dir", storage_options={"anon": True})


def test_a_scheme_is_case_insensitive_and_a_url_keeps_its_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    upper = location("S3://bucket/Run")
    assert isinstance(upper, RemotePath) and str(upper) == "s3://bucket/Run" and upper.key == "bucket/Run"
    assert location("Memory://run") == location("memory://run")
    with pytest.raises(UsageError, match="collapsed"):
        location("S3:/bucket/run")
    # fsspec's path of ftp:// (and hdfs://, sftp://) leaves the host out: the URL keeps it, the backend gets it
    folder = location("ftp://h:2121/run")
    assert isinstance(folder, RemotePath) and str(folder) == "ftp://h:2121/run"
    assert str(folder / "ckpt.pt") == "ftp://h:2121/run/ckpt.pt"
    assert dict(folder.options) == {"host": "h", "port": 2121} and folder != location("ftp://other:2121/run")
    assert "CheckpointManager('ftp://h/run'" in repr(dr.CheckpointManager("ftp://h/run"))
    assert not list(tmp_path.iterdir())


def test_a_backend_missing_a_module_it_imports_when_used_is_named_at_the_entry(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from dist_resume.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    for call in (
        lambda: location("hdfs://h/run"),
        lambda: dr.CheckpointManager("hdfs://h/run"),
        lambda: dr.resume("hdfs://h/run", model=torch.nn.Linear(2, 2)),
        lambda: dr.save_checkpoint("hdfs://h/run/x.pt", model=torch.nn.Linear(2, 2)),
    ):
        with pytest.raises(UsageError, match="needs the module 'pyarrow'") as info:
            call()
        assert "'hdfs://h/run" in str(info.value) and info.value.hint == "pip install pyarrow"
    assert main(["list", "hdfs://h/run"]) == 2
    assert "pyarrow" in capsys.readouterr().err


def test_import_stays_free_of_torch_and_fsspec() -> None:
    code = "import sys, dist_resume; dist_resume.__version__; print(sorted(m for m in ('torch', 'fsspec') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_remote_path_answers_from_the_store(mem: str) -> None:
    folder = location(mem)
    assert isinstance(folder, RemotePath)
    assert not folder.exists() and not folder.is_dir()
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{mem}/a.pt", b"x" * 10)
    fs.pipe_file(f"{mem}/sub/b", b"y")
    assert folder.exists() and folder.is_dir() and (folder / "a.pt").is_file()
    entries = {p.name: p for p in folder.iterdir()}
    assert sorted(entries) == ["a.pt", "sub"] and entries["sub"].is_dir() and entries["a.pt"].stat().st_size == 10
    stat = (folder / "a.pt").stat()
    fs.pipe_file(f"{mem}/a.pt", b"z" * 10)
    assert (folder / "a.pt").stat().st_ino != stat.st_ino or (folder / "a.pt").stat().st_mtime_ns != stat.st_mtime_ns
    (folder / "sub").remove_tree()
    (folder / "a.pt").unlink()
    assert not folder.exists()


def test_range_file_reads_windows_and_batches(mem: str) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    fsspec.filesystem("memory").pipe_file(f"{mem}/blob", data)
    path = location(f"{mem}/blob")
    assert isinstance(path, RemotePath)
    with RangeFile(path, window=64 << 10) as f:
        assert f.read(10) == data[:10] and f.requests == 1
        f.seek(1000)
        assert f.read(100) == data[1000:1100] and f.requests == 1  # inside the window
        f.prefetch([(500_000, 500_100), (500_200, 500_300), (900_000, 900_010)])
        assert f.requests == 3  # the two near ranges merged
        f.seek(500_250)
        assert f.read(20) == data[500_250:500_270] and f.requests == 3
        assert b"".join(f.chunks(0, len(data))) == data
        assert max(len(p) for p in f.chunks(0, len(data))) == 64 << 10
        f.seek(-5, os.SEEK_END)
        assert f.read() == data[-5:]


def test_cache_dir_keeps_one_copy_per_etag(mem: str, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{mem}/blob", b"a" * 1000)
    path = location(f"{mem}/blob", cache_dir=tmp_path / "cache")
    assert isinstance(path, RemotePath)
    first = cached_copy(path, path.stat())
    READ_STATS.reset()
    with RangeFile(path) as f:
        assert f.read(4) == b"aaaa" and READ_STATS.requests == 0  # read from the copy
    assert cached_copy(path, path.stat()) == first and len(list((tmp_path / "cache").iterdir())) == 1


def test_upload_is_visible_only_when_complete(mem: str) -> None:
    path = location(f"{mem}/obj")
    assert isinstance(path, RemotePath)
    seen = []

    def write(f: object) -> None:
        f.write(b"part one")  # type: ignore[attr-defined]
        seen.append(path.exists())
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        upload(path, write)
    assert seen == [False] and not path.exists()
    upload(path, lambda f: f.write(b"whole"))
    assert path.read_bytes() == b"whole"
    assert conditional_put(path)
    lease = path.parent / "lease"
    assert put_if_absent(lease, b"1") and not put_if_absent(lease, b"2") and lease.read_bytes() == b"1"


def test_a_checkpoint_round_trips_through_ranged_reads(mem: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    first: torch.nn.Linear = model[0]  # type: ignore[assignment]
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    path = dr.save_checkpoint(f"{mem}/ckpt.pt", model=model, optimizer=opt, step=4)
    assert isinstance(path, RemotePath) and str(path) == f"{mem}/ckpt.pt"
    assert dr.tools.verify_archive(str(path)) == [] and dr.tools.inspect_checkpoint(str(path)).step == 4
    loaded = dr.load_checkpoint(str(path), map_location="cpu")
    assert torch.equal(loaded["model"]["0.weight"], first.weight)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    READ_STATS.reset()
    result = dr.resume(str(path), model=fresh, optimizer=fresh_opt)
    assert result.step == 4 and result.path == path and result.restored == ("model", "optimizer", "rng")
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    moments = [s["exp_avg"] for s in fresh_opt.state.values()]
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, opt.state.values()))
    assert READ_STATS.requests <= 8
