"""The test helpers really produce what they claim (a helper that lies makes other tests meaningless)."""

from __future__ import annotations

import pickle
import zipfile

import pytest
import torch
import torch.serialization as ts

from tests.helpers import device_tagging, save_with_device_tag


def _location_tags(path) -> set[str]:
    """The storage location tags recorded in a zip-format checkpoint's data.pkl, without loading it."""
    tags: set[str] = set()

    class Reader(pickle.Unpickler):
        def find_class(self, module, name):
            return lambda *args: args

        def persistent_load(self, pid):
            tags.add(pid[3])  # ('storage', storage_type, key, location, numel)
            return None

    with zipfile.ZipFile(path) as zf:
        [name] = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        Reader(zf.open(name)).load()
    return tags


def test_saved_file_carries_cuda_tag_and_registry_is_restored(tmp_path, cuda_tagged_save):
    registry_before = list(ts._package_registry)
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(7)}
    path = tmp_path / "gpu_saved.pt"

    cuda_tagged_save(state, path)

    assert ts._package_registry == registry_before
    assert _location_tags(path) == {"cuda:3"}
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
            torch.load(path)
    loaded = torch.load(path, map_location="cpu")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"].item() == 7
    # A dict map_location maps exact tags only (FACTS #3): cuda:0 -> cpu leaves cuda:3 untouched.
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, map_location={"cuda:0": "cpu"})
    # A plain save afterwards is tagged cpu again.
    torch.save(state, tmp_path / "plain.pt")
    assert _location_tags(tmp_path / "plain.pt") == {"cpu"}


def test_callable_tag_gives_mixed_locations_and_unregisters_on_error(tmp_path):
    a, b = torch.zeros(2), torch.ones(3)
    save_with_device_tag(
        {"a": a, "b": b}, tmp_path / "mixed.pt", tag=lambda s: "cuda:1" if s.nbytes() == a.nbytes else None
    )
    assert _location_tags(tmp_path / "mixed.pt") == {"cuda:1", "cpu"}

    registry_before = list(ts._package_registry)
    with pytest.raises(KeyError), device_tagging("cuda:0"):
        raise KeyError("boom")
    assert ts._package_registry == registry_before
