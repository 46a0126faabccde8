"""load_checkpoint / rank_map_location: accelerator-saved files on this host, and a clear error for every bad file."""

from __future__ import annotations

import fractions
import json
import os
import pickle
import zipfile
from typing import Any

import pytest
import torch

import dist_resume as dr
from tests.helpers import fake_accelerator, save_with_device_tag
from tests.models import TinyNet

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(), reason="checks CPU-only-host behaviour")
# the device tags of every accelerator type a checkpoint may come from (PrivateUse1: its own name, or unrenamed)
FOREIGN_TAGS = ["cuda:0", "cuda:3", "xpu:1", "npu:0", "hpu:0", "mps:0", "sim:1", "privateuseone:0"]


@pytest.fixture
def state():
    return {"model": TinyNet().state_dict(), "step": torch.tensor(7), "lr": 0.1}


@pytest.fixture
def good_file(tmp_path, state):
    path = tmp_path / "good.pt"
    torch.save(state, path)
    return path


def _assert_loaded(loaded, state):
    assert loaded["step"].item() == 7 and loaded["lr"] == 0.1
    for key, value in state["model"].items():
        assert loaded["model"][key].device == torch.device("cpu")
        assert loaded["model"][key].dtype == value.dtype
        assert torch.equal(loaded["model"][key], value), key


# ---------------------------------------------------------------- placement


def test_rank_map_location_values(monkeypatch):
    assert dr.rank_map_location() == torch.device("cpu")  # rank_device() on this host
    assert dr.rank_map_location("cpu") == torch.device("cpu")
    assert dr.rank_map_location(torch.device("meta")) == torch.device("meta")
    assert dr.rank_map_location("cuda:2") == torch.device("cuda", 2)
    with pytest.raises(dr.errors.EnvironmentMismatchError, match=r"map_location=1 .* has none"):
        dr.rank_map_location(1)  # an index of the accelerator this host lacks (torch.device(1) raises too)
    fake_accelerator(monkeypatch, "xpu", count=2)
    assert dr.rank_map_location(1) == torch.device("xpu", 1)


def test_rank_map_location_is_a_device_which_torch_load_applies_to_every_storage():
    """FACTS #3: only a str/device map_location sends every storage, whatever its tag, to one place."""
    assert isinstance(dr.rank_map_location(), torch.device)


@pytest.mark.parametrize("tag", FOREIGN_TAGS)
@pytest.mark.parametrize("mmap", [True, False])
def test_accelerator_tagged_file_loads_on_this_cpu_host(tmp_path, state, tag, mmap):
    path = tmp_path / f"saved_on_{tag.replace(':', '')}.pt"
    save_with_device_tag(state, path, tag=tag)
    with pytest.raises(RuntimeError):  # what users get with plain torch.load
        torch.load(path, weights_only=True)
    _assert_loaded(dr.load_checkpoint(path, mmap=mmap), state)  # default: rank_map_location()
    _assert_loaded(dr.load_checkpoint(path, mmap=mmap, map_location=dr.rank_map_location()), state)


def test_a_file_with_every_accelerator_tag_at_once_lands_on_cpu(tmp_path, state):
    path = tmp_path / "mixed.pt"
    tags = iter([*FOREIGN_TAGS, "cpu"] * 100)
    save_with_device_tag(state, path, tag=lambda storage: next(tags))
    _assert_loaded(dr.load_checkpoint(path), state)


@pytest.mark.parametrize("tag", ["cuda:3", "xpu:1", "npu:0", "hpu:0", "sim:1"])
def test_a_dict_map_location_does_not_move_other_tags(tmp_path, state, tag):
    """FACTS #3: {'cuda:0': 'cpu'} maps the exact tag only; a cuda:3 (or npu:0...) storage still targets it."""
    path = tmp_path / "other.pt"
    save_with_device_tag(state, path, tag=tag)
    with pytest.raises(dr.errors.CheckpointError) as info:
        dr.load_checkpoint(path, map_location={"cuda:0": "cpu"})
    msg = str(info.value)
    assert str(path) in msg and "rank_map_location" in msg and "saved on an accelerator" in msg
    assert not isinstance(info.value, dr.errors.CheckpointCorruptError)  # the file is fine: the placement is not
    assert isinstance(info.value.__cause__, RuntimeError)
    # while the same dict works for a cuda:0 file
    cuda0 = tmp_path / "cuda0.pt"
    save_with_device_tag(state, cuda0, tag="cuda:0")
    _assert_loaded(dr.load_checkpoint(cuda0, map_location={"cuda:0": "cpu"}), state)


@pytest.mark.parametrize("where", ["cuda", "cuda:1", torch.device("cuda", 0), "xpu:1"])
def test_map_location_to_a_device_this_host_lacks(good_file, where):
    err = _expect(dr.errors.CheckpointError, good_file, map_location=where)
    msg = str(err)
    assert f"0 visible {torch.device(where).type} device(s)" in msg and "rank_map_location" in msg
    assert "saved on an accelerator" not in msg  # it was not: the map_location asked for one


def test_callable_map_location_is_passed_through(good_file, state):
    seen = []

    def where(storage, location):
        seen.append(location)
        return storage

    _assert_loaded(dr.load_checkpoint(good_file, map_location=where, mmap=False), state)
    assert seen and set(seen) == {"cpu"}


def _mapped_from(path) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux /proc/self/maps")
def test_mmap_true_maps_the_file(good_file):
    loaded = dr.load_checkpoint(good_file, mmap=True)
    ptr = loaded["model"]["fc.weight"].data_ptr()
    assert any(a <= ptr < b for a, b in _mapped_from(good_file))  # the bytes live in the mapping
    del loaded
    loaded = dr.load_checkpoint(good_file, mmap=False)
    ptr = loaded["model"]["fc.weight"].data_ptr()
    assert not any(a <= ptr < b for a, b in _mapped_from(good_file))


# ---------------------------------------------------------------- bad inputs


def _expect(exc_type, path, **kwargs):
    with pytest.raises(exc_type) as info:
        dr.load_checkpoint(path, **kwargs)
    err = info.value
    assert isinstance(err, dr.errors.CheckpointError)
    assert str(path) in str(err), str(err)
    for bare in (EOFError, pickle.UnpicklingError, zipfile.BadZipFile):
        assert not isinstance(err, bare)
    return err


@pytest.mark.parametrize("mmap", [True, False])
def test_missing_file(tmp_path, mmap):
    err = _expect(dr.errors.CheckpointNotFoundError, tmp_path / "nope.pt", mmap=mmap)
    assert "does not exist" in str(err)
    err = _expect(dr.errors.CheckpointNotFoundError, tmp_path / "no_dir" / "nope.pt", mmap=mmap)
    assert "folder" in str(err)
    assert isinstance(err, FileNotFoundError)  # still catchable the usual way


def test_folder_is_not_a_file(tmp_path):
    err = _expect(dr.errors.CheckpointNotFoundError, tmp_path)
    assert "folder" in str(err)


@pytest.mark.parametrize("mmap", [True, False])
def test_empty_file(tmp_path, mmap):
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    err = _expect(dr.errors.CheckpointCorruptError, path, mmap=mmap)
    assert "empty" in str(err) and "earlier checkpoint" in str(err)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("fraction", [0.0005, 0.01, 0.25, 0.5, 0.9, 0.99, -22, -1])
def test_truncated_file(tmp_path, good_file, fraction, mmap):
    data = good_file.read_bytes()
    cut = max(1, int(len(data) * fraction)) if fraction > 0 else len(data) + fraction
    path = tmp_path / "truncated.pt"
    path.write_bytes(data[:cut])
    with pytest.raises(dr.errors.CheckpointError) as info:
        dr.load_checkpoint(path, mmap=mmap)
    err = info.value
    assert str(path) in str(err)
    if cut >= 4:  # with the zip magic intact the file is recognisably a damaged checkpoint
        assert isinstance(err, dr.errors.CheckpointCorruptError)
        assert "interrupted" in str(err)
    else:
        assert isinstance(err, (dr.errors.CheckpointCorruptError, dr.errors.NotACheckpointError))


@pytest.mark.parametrize("mmap", [True, False])
def test_random_bytes(tmp_path, mmap):
    path = tmp_path / "noise.pt"
    g = torch.Generator().manual_seed(0)
    path.write_bytes(bytes(torch.randint(0, 256, (4096,), generator=g, dtype=torch.uint8).tolist()))
    assert path.read_bytes()[:1] != b"\x80"
    err = _expect(dr.errors.NotACheckpointError, path, mmap=mmap)
    assert "torch.save" in str(err)


def test_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"lr": 0.1}))
    _expect(dr.errors.NotACheckpointError, path)


def test_plain_pickle(tmp_path):
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"w": [1, 2, 3]}))
    err = _expect(dr.errors.NotACheckpointError, path, mmap=False)
    assert "pickle" in str(err)


@pytest.mark.parametrize("mmap", [True, False])
def test_zip_without_data_pkl(tmp_path, mmap):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/notes.txt", "hello")
    err = _expect(dr.errors.CheckpointError, path, mmap=mmap)
    assert isinstance(err, (dr.errors.NotACheckpointError, dr.errors.CheckpointCorruptError))
    path2 = tmp_path / "almost.pt"  # a torch-like archive that lacks its data.pkl
    with zipfile.ZipFile(path2, "w") as zf:
        zf.writestr("archive/version", "3\n")
        zf.writestr("archive/byteorder", "little")
    err = _expect(dr.errors.CheckpointError, path2, mmap=mmap)
    assert isinstance(err, (dr.errors.NotACheckpointError, dr.errors.CheckpointCorruptError))
    assert "data.pkl" in str(err)


def test_legacy_format(tmp_path, state):
    path = tmp_path / "legacy.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    err = _expect(dr.errors.NotACheckpointError, path, mmap=True)
    assert "legacy" in str(err) and "mmap=False" in str(err)
    _assert_loaded(dr.load_checkpoint(path, mmap=False), state)


def test_legacy_format_saved_on_gpu(tmp_path, state):
    path = tmp_path / "legacy_gpu.pt"
    from tests.helpers import device_tagging

    with device_tagging("cuda:3"):
        torch.save(state, path, _use_new_zipfile_serialization=False)
    _assert_loaded(dr.load_checkpoint(path, mmap=False), state)


def test_weights_only_refused_global_names_it_and_the_fix(tmp_path):
    path = tmp_path / "frac.pt"  # argparse.Namespace is allowed by default: see test_resume_options
    torch.save({"model": {"w": torch.ones(1)}, "ratio": fractions.Fraction(1, 3)}, path)
    err = _expect(dr.errors.UnsafeCheckpointError, path)
    msg = str(err)
    assert "fractions.Fraction" in msg and "add_safe_globals" in msg and "weights_only=False" in msg
    assert isinstance(err.__cause__, pickle.UnpicklingError)
    # the suggested fix works
    with torch.serialization.safe_globals([fractions.Fraction]):
        assert dr.load_checkpoint(path)["ratio"] == fractions.Fraction(1, 3)
    assert dr.load_checkpoint(path, weights_only=False)["ratio"] == fractions.Fraction(1, 3)


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _OpenBoom(_Boom):
    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("cls", [_Boom, _OpenBoom])
@pytest.mark.parametrize("mmap", [True, False])
def test_code_running_pickle_is_refused_and_never_runs(tmp_path, cls, mmap):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "payload": cls(str(marker))}, path)
    err = _expect(dr.errors.UnsafeCheckpointError, path, mmap=mmap)
    assert not marker.exists()
    name = "system" if cls is _Boom else "open"
    assert name in str(err)  # names the refused global
    # a bare pickle with the same payload is not even unpickled
    raw = tmp_path / "evil.pkl"
    raw.write_bytes(pickle.dumps(cls(str(marker))))
    _expect(dr.errors.NotACheckpointError, raw, mmap=mmap)
    _expect(dr.errors.NotACheckpointError, raw, mmap=False, weights_only=False)
    assert not marker.exists()


def test_corrupt_pickle_inside_a_valid_archive(tmp_path, good_file):
    path = tmp_path / "garbled.pt"
    with zipfile.ZipFile(good_file) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("data.pkl"):
                data = data[:2] + b"\xff\xfe\xfd" + data[5:]
            dst.writestr(item, data)
    for weights_only in (True, False):
        err = _expect(dr.errors.CheckpointCorruptError, path, weights_only=weights_only)
        assert "weights_only=False" not in str(err)  # damaged bytes are no reason to lower the guard
        assert "Weights only load failed" not in str(err)


def test_a_pickle_calling_exec_is_refused_without_import_advice(tmp_path):
    marker = tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w')",))

    path = tmp_path / "exec.pt"
    torch.save({"a": torch.ones(1)}, path)
    with zipfile.ZipFile(path) as z:
        records = {name: z.read(name) for name in z.namelist()}
    pkl = next(name for name in records if name.endswith("data.pkl"))
    records[pkl] = pickle.dumps(RunsCode(), protocol=2)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            z.writestr(name, data)
    with pytest.raises(dr.errors.UnsafeCheckpointError, match="builtin exec") as info:
        dr.load_checkpoint(path)
    assert "add_safe_globals" not in str(info.value) and "from  import" not in str(info.value)
    assert not marker.exists()


# ---------------------------------------------------------------- damaged pickles (issue 12 fuzz reproducers)

FUZZ_CASES = os.path.join(os.path.dirname(__file__), "fuzz_cases")


@pytest.mark.parametrize(
    "name",
    [
        "00-attributeerror_load_checkpoint.pt",
        "01-indexerror_load_checkpoint.pt",
        "03-keyerror_load_checkpoint.pt",
        "06-runtimeerror_load_checkpoint.pt",
        "07-typeerror_load_checkpoint.pt",
        "12-alloc_4gib_load_checkpoint.pt",
    ],
)
def test_a_damaged_pickle_or_directory_is_a_corrupt_checkpoint(name):
    err = _expect(dr.errors.CheckpointCorruptError, os.path.join(FUZZ_CASES, name), mmap=False)
    assert name in str(err) and "earlier checkpoint" in str(err)


def test_an_error_in_a_map_location_callable_is_not_called_damage(good_file):
    def broken(storage, location):
        table: dict[str, Any] = {}
        return table["no such key"]  # a bug in the caller's code, not damage in the file

    with pytest.raises(KeyError, match="no such key"):
        dr.load_checkpoint(good_file, map_location=broken)


def test_load_checkpoint_runs_the_security_check(good_file, monkeypatch):
    from dist_resume._core import security

    monkeypatch.setattr(security, "_warned", False)
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.warns(dr.errors.TorchSecurityWarning, match="CVE-2025-32434"):
        dr.load_checkpoint(good_file, map_location="cpu")
