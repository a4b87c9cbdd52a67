"""A tensor-parallel group of engine processes and its collectives, on torch.distributed's process-group objects
(gloo on CPU; NCCL for CUDA tensors, with a gloo group beside it for host-side objects). No default group, no
global state: a group is an object, so one process can hold several engines (tests) and nothing else in it sees
torch.distributed initialised.

Rendezvous is a TCPStore that rank 0 opens on an ephemeral port of `host`; the other ranks are told (host, port).
All-reduce results are bit-identical on every rank (ring and tree algorithms compute each element once and
distribute it), and all-gathers copy: so everything computed after the last collective of a forward (logits,
sampling) agrees across ranks without further traffic.
"""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# a rank may wait this long on the others: an idle follower blocks on the leader's next operation for as long as
# the server is idle; a dead peer fails the collective at once (its connection closes), not after this
IDLE_TIMEOUT = timedelta(days=7)
RENDEZVOUS_TIMEOUT = timedelta(seconds=300)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int
    world_size: int


class TPGroup:
    """One rank's handle on the tensor-parallel group."""

    def __init__(self, rank: int, world_size: int, device: torch.device, store, loopback: bool = False):
        """loopback: every rank is on this machine, so gloo talks over 127.0.0.1 (its default device resolves the
        hostname, which containers do not always map to a usable address; GLOO_SOCKET_IFNAME picks it otherwise)."""
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL binds this rank's communicator to the current device
        self._store = store  # kept alive: the groups use it
        self.cpu = _gloo(dist.PrefixStore("gloo", store), rank, world_size, loopback)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)
        else:
            self.dev = self.cpu

    @classmethod
    def open_store(cls, host: str, world_size: int):
        """Rank 0's store on an ephemeral port, and where the others find it; rank 0 then calls `join` with it
        once the others are started."""
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=RENDEZVOUS_TIMEOUT,
                              wait_for_workers=False)
        return store, Rendezvous(host, store.port, world_size)

    @classmethod
    def join(cls, rank: int, rendezvous: Rendezvous, device, store=None) -> "TPGroup":
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=False,
                                  timeout=RENDEZVOUS_TIMEOUT)
        return cls(rank, rendezvous.world_size, device, store, loopback=rendezvous.host in LOOPBACK)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- collectives over model tensors (one group per device kind)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (x must be contiguous); returns x."""
        self.dev.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.dev.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    # ---- host-side agreement (always over gloo)

    def broadcast_object(self, obj=None):
        """Rank 0's obj on every rank (pickled; None elsewhere on input)."""
        if self.is_leader:
            buf = io.BytesIO()
            pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.cpu.broadcast(size, 0).wait()
        if not self.is_leader:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.cpu.broadcast(data, 0).wait()
        return obj if self.is_leader else pickle.loads(data.numpy().tobytes())

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV blocks that fit on each rank's device)."""
        t = torch.tensor([value], dtype=torch.int64)
        self.cpu.allreduce([t], _min_options()).wait()
        return int(t.item())

    def barrier(self) -> None:
        self.cpu.barrier().wait()

    def shutdown(self) -> None:
        for group in {id(self.cpu): self.cpu, id(self.dev): self.dev}.values():
            try:
                group.shutdown()
            except Exception:  # a peer already gone: nothing left to tear down cleanly
                pass


def _gloo(store, rank: int, world_size: int, loopback: bool):
    if not loopback:
        return dist.ProcessGroupGloo(store, rank, world_size, IDLE_TIMEOUT)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = IDLE_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _min_options():
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    return options
