"""save_checkpoint: a file that loads under weights_only=True, canonical keys and names, metadata, atomic writes."""

from __future__ import annotations

import argparse
import errno
import os

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._layout.layout import FORMAT_NAME, FORMAT_VERSION, Key
from tests.models import WRAPPERS, TinyNet, make_batches, train_steps, wrap


def _trained(kind="plain"):
    net = TinyNet()
    model = wrap(net, kind)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    train_steps(net, opt, make_batches(3), scheduler=sched, scaler=scaler)  # the unwrapped net: no compiling
    return net, model, opt, sched, scaler


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_file_loads_with_plain_torch_load_and_is_canonical(tmp_path, kind):
    net, model, opt, sched, scaler = _trained(kind)
    path = tmp_path / "ckpt.pt"
    returned = dr.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, scaler=scaler, step=3, epoch=1)
    assert returned == path

    obj = torch.load(path, weights_only=True, map_location="cpu")  # no safe_globals, no dist_resume
    assert obj[Key.FORMAT] == FORMAT_NAME and obj[Key.VERSION] == FORMAT_VERSION
    assert list(obj[Key.MODEL]) == list(net.state_dict())  # no module./_orig_mod.
    for key, value in net.state_dict().items():
        assert torch.equal(obj[Key.MODEL][key], value)
    assert obj[Key.MODEL]._metadata["bn"]["version"] == 2
    names = obj[Key.OPTIMIZER]["param_groups"][0]["param_names"]
    assert names == [n for n, _ in net.named_parameters()]  # canonical, though built from the wrapped names
    assert obj[Key.SCHEDULER] == sched.state_dict()
    assert obj[Key.SCALER] == scaler.state_dict()
    assert len(obj[Key.OPTIMIZER]["state"]) == len(list(net.parameters()))


def test_metadata(tmp_path):
    net, model, opt, sched, scaler = _trained()
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, step=12, epoch=2, extra={"best": 0.5, "tags": ["a"]})
    obj = torch.load(path, weights_only=True)
    meta = obj[Key.META]
    assert meta["step"] == 12 and meta["epoch"] == 2 and meta["world_size"] == 1
    assert type(meta["torch_version"]) is str and meta["torch_version"] == str(torch.__version__)
    assert meta["dist_resume_version"] == dr.__version__
    assert meta["model_class"] == "TinyNet" and meta["optimizer_class"] == "AdamW"
    assert obj[Key.EXTRA] == {"best": 0.5, "tags": ["a"]}
    assert Key.SCHEDULER not in obj and Key.SCALER not in obj
    res = dr.resume(path, model=TinyNet(seed=3), optimizer=torch.optim.AdamW(TinyNet().parameters()))
    assert (res.step, res.epoch, res.extra) == (12, 2, {"best": 0.5, "tags": ["a"]})


def test_every_plain_value_that_save_accepts_loads_under_weights_only(tmp_path):
    extra = {
        "i": 1,
        "f": 0.5,
        "c": 1j,
        "b": b"x",
        "s": "y",
        "n": None,
        "t": True,
        "set": {1, 2},
        "tuple": (1, "a"),
        "list": [torch.ones(1)],
        "size": torch.Size([2]),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "nested": {"a": {"b": [{"c": 3}]}},
    }
    dr.save_checkpoint(tmp_path / "x.pt", model=TinyNet(), extra=extra)
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)[Key.EXTRA]
    assert loaded.keys() == extra.keys()
    assert loaded["set"] == {1, 2} and loaded["dtype"] is torch.float16 and loaded["size"] == torch.Size([2])


def test_model_only(tmp_path):
    net = TinyNet()
    dr.save_checkpoint(tmp_path / "m.pt", model=net)
    obj = torch.load(tmp_path / "m.pt", weights_only=True)
    assert Key.OPTIMIZER not in obj and obj[Key.META]["step"] is None and obj[Key.META]["optimizer_class"] is None


@pytest.mark.parametrize(
    "extra, where",
    [
        (argparse.Namespace(lr=0.1), "extra is an argparse.Namespace"),
        ({"args": argparse.Namespace(lr=0.1)}, "extra['args']"),
        ({"cfg": [1, {"v": torch.__version__}]}, "extra['cfg'][1]['v']"),  # TorchVersion, a str subclass
        ({"fn": print}, "extra['fn']"),
        ({"ids": frozenset({1, 2})}, "extra['ids'] is a builtins.frozenset"),
    ],
)
def test_extra_that_weights_only_refuses_is_rejected_before_writing(tmp_path, extra, where):
    net = TinyNet()
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=net, step=1)
    before = path.read_bytes()
    with pytest.raises(dr.errors.CheckpointWriteError) as info:
        dr.save_checkpoint(path, model=net, step=2, extra=extra)
    msg = str(info.value)
    assert where in msg and "weights_only=True" in msg
    if isinstance(extra, argparse.Namespace):
        assert "vars(obj)" in msg
    if "cfg" in str(where):
        assert "str(obj)" in msg
    assert path.read_bytes() == before  # previous file untouched
    assert _files(tmp_path) == ["ckpt.pt"]  # no temporary file


@pytest.mark.parametrize("bad", [1.0, "3", True])
def test_step_and_epoch_must_be_ints(tmp_path, bad):
    with pytest.raises(TypeError):
        dr.save_checkpoint(tmp_path / "c.pt", model=TinyNet(), step=bad)
    with pytest.raises(TypeError):
        dr.save_checkpoint(tmp_path / "c.pt", model=TinyNet(), epoch=bad)
    assert _files(tmp_path) == []


def test_missing_folder(tmp_path):
    path = tmp_path / "no" / "such" / "ckpt.pt"
    with pytest.raises(dr.errors.CheckpointWriteError, match="does not exist") as info:
        dr.save_checkpoint(path, model=TinyNet())
    assert str(path) in str(info.value)
    assert not (tmp_path / "no").exists()


def test_write_failure_midway_leaves_the_previous_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    net = TinyNet()
    dr.save_checkpoint(path, model=net, step=1)
    before = path.read_bytes()
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(dr.errors.CheckpointWriteError) as info:
        dr.save_checkpoint(path, model=TinyNet(seed=4), step=2)
    monkeypatch.setattr(torch, "save", real_save)
    msg = str(info.value)
    assert str(path) in msg and "No space left on device" in msg and "untouched" in msg
    assert isinstance(info.value.__cause__, OSError)
    assert path.read_bytes() == before
    assert _files(tmp_path) == ["ckpt.pt"]
    assert dr.resume(path, model=TinyNet(seed=9)).step == 1


def test_object_whose_save_raises_leaves_no_temp_file(tmp_path):
    class Unpicklable(nn.Linear):
        def get_extra_state(self):
            return lambda: None  # a local lambda: torch.save cannot pickle it

        def set_extra_state(self, state):
            pass

    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=nn.Linear(2, 2))
    before = path.read_bytes()
    with pytest.raises(Exception) as info:
        dr.save_checkpoint(path, model=Unpicklable(2, 2))
    assert "lambda" in str(info.value) or "pickle" in str(info.value).lower()
    assert path.read_bytes() == before
    assert _files(tmp_path) == ["ckpt.pt"]


def test_replaces_an_existing_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=TinyNet(), step=1)
    dr.save_checkpoint(path, model=TinyNet(), step=2)
    assert torch.load(path, weights_only=True)[Key.META]["step"] == 2
    assert _files(tmp_path) == ["ckpt.pt"]


def test_str_path_and_compiled_and_dataparallel_models_round_trip(tmp_path):
    src = TinyNet(seed=1)
    for kind in ("compiled", "dp_compile", "compile_dp"):
        path = str(tmp_path / f"{kind}.pt")
        dr.save_checkpoint(path, model=wrap(src, kind))
        dst = TinyNet(seed=2)
        dr.resume(path, model=dst)
        for key, value in src.state_dict().items():
            assert torch.equal(dst.state_dict()[key], value)


def test_unpicklable_state_is_a_write_error_and_leaves_nothing(tmp_path):
    class WithLambda(torch.nn.Linear):
        def get_extra_state(self):
            return {"fn": lambda x: x}

        def set_extra_state(self, state):
            pass

    (tmp_path / "ckpt.pt").write_bytes(b"previous")
    with pytest.raises(dr.errors.CheckpointWriteError, match="could not be pickled"):
        dr.save_checkpoint(tmp_path / "ckpt.pt", model=WithLambda(2, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert (tmp_path / "ckpt.pt").read_bytes() == b"previous"


# what torch.save writes as readily as a dense tensor, but no resume can take (issue 45): refused at every save entry
ODD_BUFFERS = {
    "sparse": lambda: torch.eye(3).to_sparse(),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
    "meta": lambda: torch.ones(3, device="meta"),
    "expanded": lambda: torch.zeros(1).expand(3),
}


def _save_entries():
    """Each save entry, as a call ``(folder, model, **kwargs)``: save_checkpoint(_async) and the manager's save,
    save_async and snapshot (whose close() writes the snapshot into the folder)."""

    def manager(method):
        def call(folder, model, **kwargs):
            with dr.CheckpointManager(folder, model=model) as mgr:
                result = getattr(mgr, method)(1, **kwargs)
                return result.wait() if method == "save_async" else result

        return call

    return {
        "save_checkpoint": lambda folder, model, **kw: dr.save_checkpoint(folder / "c.pt", model=model, step=1, **kw),
        "save_checkpoint_async": lambda folder, model, **kw: dr.save_checkpoint_async(
            folder / "c.pt", model=model, step=1, **kw
        ).wait(),
        "CheckpointManager.save": manager("save"),
        "CheckpointManager.save_async": manager("save_async"),
        "CheckpointManager.snapshot": manager("snapshot"),
    }


@pytest.mark.parametrize("kind", list(ODD_BUFFERS))
def test_a_state_no_resume_could_take_is_refused_at_every_save_entry_before_anything_is_written(
    tmp_path, monkeypatch, kind
):
    from dist_resume._shm import place

    (tmp_path / "shm").mkdir()
    monkeypatch.setenv(place.SHM_DIR_ENV, str(tmp_path / "shm"))
    for name, save in _save_entries().items():
        folder = tmp_path / name
        folder.mkdir()
        model = TinyNet()
        model.register_buffer("odd", ODD_BUFFERS[kind]())
        with pytest.raises(dr.errors.UsageError, match=r"not dense \(1: \['model'\]\['odd'\]") as info:
            save(folder, model)
        assert f"{name.split('.')[-1]}" in str(info.value) and "nothing was written" in str(info.value), name
        with pytest.raises(dr.errors.UsageError, match=r"\['extra'\]\['mask'\]"):  # extra is saved too
            save(folder, TinyNet(), extra={"mask": ODD_BUFFERS[kind]()})
        assert not list(folder.rglob("*.pt")), name
        model.odd = torch.ones(3)  # the same state, dense: saved
        save(folder, model)
        assert list(folder.rglob("*.pt")), name


@pytest.mark.parametrize("step", [-1, 2**63, 2**70])
def test_a_step_or_epoch_no_reader_takes_is_refused_at_save(tmp_path, step):
    with pytest.raises(dr.errors.UsageError, match="step must be a non-negative int up to 2\\*\\*63-1"):
        dr.save_checkpoint(tmp_path / "c.pt", model=TinyNet(), step=step)
    with pytest.raises(dr.errors.UsageError, match="epoch must be a non-negative int up to 2\\*\\*63-1"):
        dr.save_checkpoint(tmp_path / "c.pt", model=TinyNet(), epoch=step)
    with (
        pytest.raises(ValueError, match="step must be a non-negative int"),
        dr.CheckpointManager(tmp_path / "run") as mgr,
    ):
        mgr.save(step, model=TinyNet())
    assert _files(tmp_path) == []  # not even the manager's folder
