"""Helpers that test modules import (``from tests.helpers import ...``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import pytest
import torch
import torch.serialization as ts
from torch.utils.data import Dataset

__all__ = [
    "DESELECTED",
    "TORCHRUN_VARS",
    "FakeAccelerator",
    "device_tagging",
    "dataset_of",
    "flip_byte_in_tensor_record",
    "fake_accelerator",
    "local_shard",
    "metadata_of",
    "save_with_device_tag",
]

# everything torchrun sets that changes what dist_resume does (TORCHELASTIC_RUN_ID: init_distributed makes a group)
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
)

# the items -m/-k left out of this session (tests/conftest.py's pytest_deselected keeps them): the slow tests
DESELECTED = pytest.StashKey[list[pytest.Item]]()

Tag = str | Callable[[Any], str | None]
T = TypeVar("T")


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``fully_shard`` parameter (``to_local()``, sharing its storage): torch types the
    parameters of a sharded module as plain ``Parameter``. AssertionError for a parameter that is not a DTensor."""
    from torch.distributed.tensor import DTensor  # here: most tests never import torch.distributed.tensor

    assert isinstance(param, DTensor), f"not a DTensor: {type(param).__name__}"
    return param.to_local()


def nested_equal(a: Any, b: Any) -> bool:
    """Whether two nested dicts/lists/tuples of tensors and plain values are equal, tensors bitwise (dtype included)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(nested_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(nested_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def flip_byte_in_tensor_record(path: os.PathLike[str] | str) -> None:
    """Flip one bit inside the first tensor record of a torch file: its size and zip structure stay intact, its CRC-32
    does not (only a CRC check finds it)."""
    from pathlib import Path

    from dist_resume._format.records import read_records

    _, records = read_records(Path(path))
    record = next(r for r in records if "/data/" in r.name and r.file_size >= 16)
    data = bytearray(Path(path).read_bytes())
    data[record.data_offset + 4] ^= 0x01
    Path(path).write_bytes(bytes(data))


def dataset_of(items: Sequence[T]) -> Dataset[T]:
    """``items`` (a list, a range) as the map-style dataset a DataLoader or sampler takes: it has ``__getitem__``
    and ``__len__``, which is all they use; torch types the argument as ``Dataset``. Returns ``items`` itself."""
    return cast("Dataset[T]", items)


def metadata_of(state_dict: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``state_dict._metadata``: the per-module versions ``nn.Module.state_dict`` attaches (BatchNorm's ``version``),
    typed (torch's stubs do not declare the attribute). AttributeError where there is none, as the attribute."""
    return cast(dict[str, dict[str, Any]], state_dict._metadata)  # type: ignore[attr-defined]


@contextlib.contextmanager
def device_tagging(tag: Tag = "cuda:3") -> Iterator[None]:
    """While active, ``torch.save`` records CPU storages under the location ``tag`` (a string, or a
    callable ``storage -> str | None``; None falls through to torch's own taggers) instead of ``cpu``.

    This is how a checkpoint "saved on cuda:3" is made on a CPU-only host (FACTS #4). Loading is not
    affected: the registered deserializer always returns None, so torch's own deserializers decide.
    """

    def tagger(storage: Any) -> str | None:
        if storage.device.type != "cpu":
            return None
        return tag(storage) if callable(tag) else tag

    def deserializer(storage: Any, location: str) -> None:
        return None

    # Lower number = asked first; torch's CPU tagger is 10. A unique priority also keeps the registry's
    # list.sort() from comparing two functions when priorities tie.
    priority = min(entry[0] for entry in ts._package_registry) - 1
    ts.register_package(priority, tagger, deserializer)  # appends (priority, tagger, deserializer)
    try:
        yield
    finally:
        ts._package_registry[:] = [e for e in ts._package_registry if e[1] is not tagger]


def save_with_device_tag(obj: Any, path: str | os.PathLike[str], tag: Tag = "cuda:3") -> None:
    """``torch.save(obj, path)`` with every CPU storage tagged ``tag`` (default ``"cuda:3"``)."""
    with device_tagging(tag):
        torch.save(obj, path)


@dataclass
class FakeAccelerator:
    """What :func:`fake_accelerator` made ``torch.accelerator`` answer, and what dist_resume asked of it.

    ``rng`` is the device module's per-index RNG state (None: the module has no RNG functions);
    ``set_index``, ``synced`` and ``rng_reads`` record ``set_device_index``, ``synchronize`` and
    ``get_rng_state`` calls.
    """

    type: str
    count: int
    current: int = 0
    rng: dict[int, torch.Tensor] | None = None
    set_index: list[Any] = field(default_factory=list)
    synced: list[Any] = field(default_factory=list)
    rng_reads: list[Any] = field(default_factory=list)

    def index(self, device: Any) -> int:
        if device is None:
            return self.current
        device = torch.device(self.type, device) if isinstance(device, int) else torch.device(device)
        assert device.type == self.type, f"{device} asked of a {self.type} accelerator"
        return self.current if device.index is None else device.index


def fake_accelerator(
    monkeypatch: pytest.MonkeyPatch, device_type: str = "cuda", count: int = 2, *, rng: bool = True
) -> FakeAccelerator:
    """Make this process look as if its accelerator were ``count`` devices of ``device_type``.

    Patches ``torch.accelerator`` (current_accelerator, device_count, current_device_index,
    set_device_index, device_index, synchronize) and ``torch.get_device_module(device_type)`` (RNG
    functions when ``rng``). Only decisions can be tested with it: no tensor can live there. The
    tests that move real tensors run on the test accelerator (tests/accelerator) and on CUDA.
    ``device_type`` must be a built-in type this machine cannot have (cuda, xpu, hpu, mps, mtia, ...):
    PrivateUse1 is the test accelerator's once it is loaded (renamed ``sim``), so a PrivateUse1 case
    runs on the real one (the ``accelerator`` and ``sim_accelerator`` fixtures), never faked.
    """
    fake = FakeAccelerator(
        device_type, count, rng={i: torch.full((8,), i, dtype=torch.uint8) for i in range(count)} if rng else None
    )

    def current_accelerator(check_available: bool = False) -> torch.device:
        return torch.device(device_type)

    def set_device_index(device: Any) -> None:
        fake.set_index.append(device)
        fake.current = fake.index(device)

    @contextlib.contextmanager
    def device_index(device: int | None) -> Iterator[None]:
        before = fake.current
        fake.current = before if device is None else device
        try:
            yield
        finally:
            fake.current = before

    monkeypatch.setattr(torch.accelerator, "current_accelerator", current_accelerator)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: fake.current)
    monkeypatch.setattr(torch.accelerator, "set_device_index", set_device_index)
    monkeypatch.setattr(torch.accelerator, "device_index", device_index)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: fake.synced.append(device))

    class Module:  # the device module's RNG functions, as torch.cuda / torch.xpu / torch.mps spell them
        if rng:

            @staticmethod
            def get_rng_state(device: Any = None) -> torch.Tensor:
                fake.rng_reads.append(device)
                assert fake.rng is not None
                return fake.rng[fake.index(device)].clone()

            @staticmethod
            def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
                assert fake.rng is not None and state.dtype == torch.uint8 and state.device.type == "cpu"
                fake.rng[fake.index(device)] = state.clone()

            @staticmethod
            def manual_seed(seed: int) -> None:
                assert fake.rng is not None
                fake.rng[fake.current] = torch.full((8,), seed % 256, dtype=torch.uint8)

    real = torch.get_device_module

    def get_device_module(device: Any = None) -> Any:
        kind = device.type if isinstance(device, torch.device) else str(device or device_type).split(":")[0]
        return Module if kind == device_type else real(device)

    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    return fake
