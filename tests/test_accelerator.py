"""dist_resume._dist.accelerator, the one module that knows device types; and the proof that no other module
names torch.cuda.

torch.accelerator is faked (tests.helpers.fake_accelerator) for the device types this machine cannot have: these
test decisions and tables. PrivateUse1 is the real test accelerator (the accelerator fixture: sim, and CUDA in the
multi-GPU job), as are the tests that move tensors (test_*_accelerator.py).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_resume._dist import accelerator as acc
from dist_resume._dist.comm import comm_device
from tests.accelerator import Accel, on_accelerators
from tests.helpers import fake_accelerator
from tests.models import single_rank_group

REPO = Path(__file__).resolve().parents[1]
OWNER = Path("dist_resume/_dist/accelerator.py")


def cuda_uses(root: Path) -> list[str]:
    """``path:line: what`` for every use of torch.cuda (or ``Tensor.is_cuda``) under ``root``/dist_resume outside
    the owner module: ``torch.cuda.x``, ``import torch.cuda``, ``from torch import cuda``, ``from torch.cuda import``."""
    found = []
    for path in sorted((root / "dist_resume").rglob("*.py")):
        rel = path.relative_to(root)
        if rel == OWNER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            what = None
            if isinstance(node, ast.Attribute) and node.attr == "cuda" and _is_torch(node.value):
                what = "torch.cuda"
            elif isinstance(node, ast.Attribute) and node.attr == "is_cuda":
                what = ".is_cuda"
            elif isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names):
                what = "import torch.cuda"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.cuda"):
                what = f"from {node.module} import"
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module == "torch"
                and any(a.name == "cuda" for a in node.names)
            ):
                what = "from torch import cuda"
            if what:
                assert isinstance(node, (ast.expr, ast.stmt))  # an Attribute, Import or ImportFrom: it has a line
                found.append(f"{rel}:{node.lineno}: {what}")
    return found


def _is_torch(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "torch"


def test_no_module_but_the_owner_names_torch_cuda():
    assert cuda_uses(REPO) == []


def test_the_walk_finds_every_planted_use(tmp_path):
    shutil.copytree(REPO / "dist_resume", tmp_path / "dist_resume", ignore=shutil.ignore_patterns("__pycache__"))
    planted = {
        "_core/tree.py": "\n\ndef _gpus() -> int:\n    return torch.cuda.device_count()\n",
        "_state/optim/prepare.py": "\nimport torch.cuda  # noqa: E402\n",
        "_format/load.py": "\nfrom torch import cuda as _cuda  # noqa: E402\n",
        "_exact/rng.py": "\nfrom torch.cuda import amp as _amp  # noqa: E402\n",
        "_save/save.py": "\n\ndef _on_gpu(t):\n    return t.is_cuda\n",
    }
    for module, text in planted.items():
        source = tmp_path / "dist_resume" / module
        source.write_text(source.read_text() + text)
    owner = tmp_path / OWNER
    owner.write_text(owner.read_text() + "\n\ndef _count() -> int:\n    return torch.cuda.device_count()\n")
    found = [line.split(":")[0] + ": " + line.split(": ", 1)[1] for line in cuda_uses(tmp_path)]
    assert found == sorted(
        [
            "dist_resume/_save/save.py: .is_cuda",
            "dist_resume/_core/tree.py: torch.cuda",
            "dist_resume/_exact/rng.py: from torch.cuda import",
            "dist_resume/_format/load.py: from torch import cuda",
            "dist_resume/_state/optim/prepare.py: import torch.cuda",
        ]
    )  # the owner's own use is allowed


# ---------------------------------------------------------------- what this process has


def test_a_cpu_host_has_no_accelerator():
    if torch.accelerator.is_available():
        pytest.skip("this host has an accelerator")
    assert acc.current_accelerator() is None
    assert not acc.pinned_staging("cuda")
    assert acc.current_device("cuda") == torch.device("cuda")  # no index to add


@pytest.mark.parametrize("device_type", ["cuda", "xpu", "hpu", "mps"])
def test_current_accelerator_is_torchs_answer_as_a_value(monkeypatch, device_type):
    fake = fake_accelerator(monkeypatch, device_type, count=3)
    found = acc.current_accelerator()
    assert found == acc.Accelerator(device_type, 3)
    with pytest.raises(AttributeError):
        found.count = 4  # type: ignore[misc,union-attr]
    acc.set_device(torch.device(device_type, 2))
    assert fake.current == 2 and acc.current_device(device_type) == torch.device(device_type, 2)
    assert acc.current_device("cpu") == torch.device("cpu")


@on_accelerators(2)
def test_current_accelerator_of_a_real_accelerator(accelerator: Accel):
    assert acc.current_accelerator() == acc.Accelerator(accelerator.type, accelerator.count)
    before = torch.accelerator.current_device_index()
    try:
        acc.set_device(accelerator.device(1))
        assert torch.accelerator.current_device_index() == 1
        assert acc.current_device(accelerator.type) == accelerator.device(1)
        assert torch.empty(1, device=accelerator.type).device == accelerator.device(1)  # torch's current device too
    finally:
        torch.accelerator.set_device_index(before)
    assert acc.current_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    "device_type, env, expected",
    [
        ("cuda", {}, ("CUDA_VISIBLE_DEVICES", None)),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "3"}, ("CUDA_VISIBLE_DEVICES", "3")),
        ("cuda", {"HIP_VISIBLE_DEVICES": "1"}, ("HIP_VISIBLE_DEVICES", "1")),  # ROCm: type cuda
        ("xpu", {"ONEAPI_DEVICE_SELECTOR": "level_zero:1"}, ("ONEAPI_DEVICE_SELECTOR", "level_zero:1")),
        ("xpu", {"ZE_AFFINITY_MASK": "0", "ONEAPI_DEVICE_SELECTOR": "x"}, ("ZE_AFFINITY_MASK", "0")),
        ("npu", {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, ("ASCEND_RT_VISIBLE_DEVICES", "0,1")),
        ("hpu", {}, ("HABANA_VISIBLE_MODULES", None)),
        ("mps", {}, (None, None)),
        ("sim", {}, (None, None)),  # a PrivateUse1 backend: its variable is its own business
    ],
)
def test_visible_devices_variable_per_type(monkeypatch, device_type, env, expected):
    for names in acc.VISIBLE_DEVICES.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert acc.visible_devices(device_type) == expected


def test_describe_says_what_was_found(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert acc.Accelerator("cuda", 2).describe() == "2 visible cuda device(s) (CUDA_VISIBLE_DEVICES=4,5)"
    assert acc.Accelerator("mps", 1).describe() == "1 visible mps device(s) (no visible-devices variable)"


def test_backend_serves_follows_torchs_tables(monkeypatch):
    assert acc.backend_serves("gloo", "cpu") and acc.backend_serves("gloo", "cuda")
    assert acc.backend_serves("nccl", "cuda") and not acc.backend_serves("nccl", "cpu")
    assert acc.backend_serves("gloo", "mps")  # torch's default map names gloo for mps
    assert not acc.backend_serves("gloo", "mtia")
    monkeypatch.setitem(dist.Backend.backend_capability, "mtiaccl", ["cpu", "mtia"])  # register_backend(devices=)
    assert acc.backend_serves("mtiaccl", "mtia")


def test_backend_serves_a_backend_registered_for_a_privateuse1_device(sim_accelerator: Accel):
    assert acc.backend_serves("simgloo", "sim")  # the test accelerator's register_backend(..., devices=["sim"])
    assert not acc.backend_serves("gloo", "sim") and not acc.backend_serves("simgloo", "cuda")


def test_synchronize_waits_on_each_accelerator_device_once(monkeypatch):
    fake = fake_accelerator(monkeypatch, "cuda", count=2)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    acc.synchronize([cuda1, torch.device("cpu"), cuda1, cuda0])
    assert fake.synced == [cuda1, cuda0]
    acc.synchronize([])
    assert fake.synced == [cuda1, cuda0]


def test_pinned_staging_asks_torch_for_the_accelerators_type_only(monkeypatch):
    fake_accelerator(monkeypatch, "cuda", count=1)
    assert not acc.pinned_staging("xpu")  # not this process's accelerator
    probe = acc._pins
    probe.cache_clear()
    try:
        # the CPU build has no pinned-memory allocator: the probe says so instead of raising
        assert acc.pinned_staging("cuda") is torch.cuda.is_available()
        monkeypatch.setattr(acc, "_pins", lambda device_type: True)
        assert acc.pinned_staging("cuda")
    finally:
        probe.cache_clear()


def test_device_rng_functions_touch_the_named_device_only(monkeypatch):
    fake = fake_accelerator(monkeypatch, "cuda", count=2)
    assert fake.rng is not None
    one = torch.device("cuda", 1)
    state = acc.device_rng_state(one)
    assert state is not None and torch.equal(state, fake.rng[1]) and fake.rng_reads == [one]
    assert acc.set_device_rng_state(torch.full((8,), 9, dtype=torch.uint8), one)
    assert fake.rng[1][0] == 9 and fake.rng[0][0] == 0
    assert acc.seed_device(7, one) and fake.rng[1][0] == 7 and fake.rng[0][0] == 0 and fake.current == 0
    assert acc.device_rng_state(torch.device("cpu")) is None and not acc.seed_device(7, torch.device("cpu"))
    assert acc.device_rng_state(torch.device("xpu", 0)) is None  # not this process's accelerator


# ---------------------------------------------------------------- object collectives


def test_object_collectives_use_the_groups_device(tmp_path, monkeypatch):
    with single_rank_group(tmp_path):
        assert comm_device() == torch.device("cpu")  # gloo
        fake_accelerator(monkeypatch, "xpu", count=2)
        acc.set_device(torch.device("xpu", 1))
        from dist_resume._dist import comm

        monkeypatch.setattr(comm, "object_collective_device_type", lambda group=None: "xpu")  # as for an xccl group
        assert comm_device() == torch.device("xpu", 1)  # the current device, as torch's own collectives use
