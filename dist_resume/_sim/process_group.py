"""``simgloo``: a process-group backend for sim tensors (gloo refuses PrivateUse1 tensors).

Every collective copies its sim tensors to the CPU, runs the same collective on an inner ``ProcessGroupGloo``,
waits, and copies the results back; CPU tensors go through untouched. Everything is synchronous: each call returns
a completed ``Work`` whose future holds the (updated) tensors, as DDP's comm hooks expect.

How ``torch.distributed`` sees it once ``register()`` ran (``activate()`` calls it)::

    dist.Backend.default_device_backend_map == {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "mps": "gloo",
                                                "sim": "simgloo"}
    dist.Backend.backend_capability["simgloo"] == ["sim"]
    dist.get_default_backend_for_device("sim:0") == "simgloo"

so code that picks a backend by device type finds it as it finds nccl for cuda: ``init_process_group(
device_id=torch.device("sim", local_rank))``, ``init_process_group(backend="simgloo")``, ``"cpu:gloo,sim:simgloo"``
and a bare ``init_process_group()`` (torch asks the current accelerator, sim) all work (checked; ``dist.get_backend()``
then reads ``"simgloo"``, the string given, or ``"undefined"`` for the bare call). torch treats a backend
that is a ``ProcessGroup`` subclass as the whole group, so this one also serves CPU tensors, including the object
collectives (``broadcast_object_list`` sends CPU byte tensors; a pickled sim tensor arrives tagged with the
sender's device, ``sim:0``, unless the receiver remaps it).

Served: allreduce, allreduce_coalesced, broadcast, allgather, all_gather_single (``_allgather_base``),
reduce_scatter, reduce_scatter_single (``_reduce_scatter_base``), barrier, send, recv. Called from C++ (DDP's
reducer, ``_broadcast_coalesced``, ``_verify_params_across_processes``) only the overridable virtuals reach Python:
allreduce, allreduce_coalesced, broadcast, allgather, reduce_scatter, barrier, send, recv.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

__all__ = ["BACKEND", "SimGlooProcessGroup", "register"]

BACKEND = "simgloo"

# Not in torch's stubs: wraps a completed future as the Work a collective returns.
_work_from_future: Callable[[torch.futures.Future[Any]], dist.Work] = c10d._create_work_from_future  # type: ignore[attr-defined]


def _host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What gloo works on: CPU tensors themselves, CPU copies of the others."""
    return [t if t.device.type == "cpu" else t.detach().to("cpu") for t in tensors]


def _back(tensors: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    """Copy gloo's results into the tensors that were not on the CPU."""
    for t, h in zip(tensors, hosts):
        if t is not h:
            t.copy_(h)


def _done(result: Any) -> dist.Work:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    return _work_from_future(fut)


# The stubs overload these methods with Python-level convenience forms; C++ (the trampoline) and torch.distributed's
# functions call the (tensors, options) form implemented here, hence the override ignores.
class SimGlooProcessGroup(dist.ProcessGroup):
    """gloo behind a CPU copy: collectives for sim (and CPU) tensors. Built by ``init_process_group``."""

    def __init__(self, store: c10d.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) constructor: not in the stubs
        self._gloo: Any = dist.ProcessGroupGloo(store, rank, size, timeout)  # Any: its stub lacks most methods
        # init_process_group(device_id=...) asks pg._get_backend(device_id); the collectives below never use it
        for device, kind in (
            ("cpu", dist.ProcessGroup.BackendType.GLOO),
            ("sim", dist.ProcessGroup.BackendType.CUSTOM),
        ):
            self._register_backend(torch.device(device), kind, self._gloo)

    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        hosts = _host(tensors)
        self._gloo.allreduce(hosts, opts or c10d.AllreduceOptions()).wait()
        _back(tensors, hosts)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        hosts = _host(tensors)
        self._gloo.allreduce_coalesced(hosts, opts or c10d.AllreduceCoalescedOptions()).wait()
        _back(tensors, hosts)
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        hosts = _host(tensors)
        self._gloo.broadcast(hosts, opts or c10d.BroadcastOptions()).wait()
        _back(tensors, hosts)
        return _done(tensors)

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        hosts = [_host(outs) for outs in output_tensors]
        self._gloo.allgather(hosts, _host(input_tensors), opts or c10d.AllgatherOptions()).wait()
        for outs, host_outs in zip(output_tensors, hosts):
            _back(outs, host_outs)
        return _done(output_tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        hosts = _host([output])
        self._gloo._allgather_base(hosts[0], _host([input])[0], opts or c10d.AllgatherOptions()).wait()
        _back([output], hosts)
        return _done([output])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.all_gather_single(output, input, opts)

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        hosts = _host(output_tensors)
        inputs = [_host(ins) for ins in input_tensors]
        self._gloo.reduce_scatter(hosts, inputs, opts or c10d.ReduceScatterOptions()).wait()
        _back(output_tensors, hosts)
        return _done(output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        hosts = _host([output])
        self._gloo._reduce_scatter_base(hosts[0], _host([input])[0], opts or c10d.ReduceScatterOptions()).wait()
        _back([output], hosts)
        return _done([output])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.reduce_scatter_single(output, input, opts)

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        self._gloo.barrier(opts or c10d.BarrierOptions()).wait()
        return _done(None)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work:
        self._gloo.send(_host(tensors), dstRank, tag).wait()
        return _done(tensors)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work:
        hosts = _host(tensors)
        self._gloo.recv(hosts, srcRank, tag).wait()
        _back(tensors, hosts)
        return _done(tensors)


def _create(store: c10d.Store, rank: int, size: int, timeout: timedelta) -> SimGlooProcessGroup:
    return SimGlooProcessGroup(store, rank, size, timeout)


def register(devices: Sequence[str] = ("sim",)) -> None:
    """Register ``simgloo`` as the backend of ``devices`` (idempotent; local to this process)."""
    if BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND, _create, devices=list(devices))
