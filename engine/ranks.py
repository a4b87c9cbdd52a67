"""The engine's tensor-parallel ranks: rank 0 (the leader, the EngineCore the server or LLM talks to) starts ranks
1..N-1 as child processes, and every rank runs the same EngineCore over its shard of the model.

Ranks never diverge because they compute the same things from the same inputs: the leader broadcasts each call
that changes its core's state (add_request, abort, step) before making it, and each follower makes the same call
on its core; everything the scheduler, the sampler and the DDTree round decide follows from those calls and from
tensors that are identical on every rank after the model's collectives (engine/distributed.py). The two inputs
that are not, the clock (the adaptive budget's measured step and drafter times) and free device memory (the KV
cache size), are taken from the leader and the smallest rank respectively (engine/core.py).

A follower is a plain subprocess (the engine process is a daemonic multiprocessing child, which may not start
multiprocessing children), killed by the kernel when its leader dies (Linux); when a follower dies, the leader's
next collective fails, the leader's step raises, and the server treats that like any engine death (503).
Under torchrun (`torchrun --nproc-per-node N [--nnodes ...] -m server serve ... --tensor-parallel-size N`) every
rank is started by torchrun instead: rank 0 runs the server and the leader, ranks > 0 only their engine
(`follow_launched`), and the rendezvous is torchrun's store (MASTER_ADDR:MASTER_PORT), so ranks may span nodes.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace

from engine.config import EngineConfig

logger = logging.getLogger("ddtree.engine")

HOST = "127.0.0.1"  # one node: ranks rendezvous on the loopback interface
STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class Launch:
    """This process's place in a group that torchrun (torch.distributed.run) started: its environment."""
    rank: int
    local_rank: int
    world_size: int
    host: str
    port: int
    agent_store: bool  # torchrun's agent hosts the store (every rank connects as a client)
    restart: int


def torchrun_launch() -> Launch | None:
    """The torchrun environment of this process, or None when it was not started by torchrun."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return Launch(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"],
                  int(env["MASTER_PORT"]), env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                  int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config one rank runs: on CUDA each rank owns one device, cuda:<its rank on this node>."""
    if config.tensor_parallel_size == 1 or not config.is_cuda:
        return config
    launch = torchrun_launch()
    return replace(config, device=f"cuda:{launch.local_rank if launch is not None else rank}")


def join_launched(config: EngineConfig, launch: Launch):
    """This rank's TPGroup in a torchrun-started group: the rendezvous is torchrun's store (MASTER_ADDR:PORT)."""
    import torch.distributed as dist

    from engine.distributed import LOOPBACK, RENDEZVOUS_TIMEOUT, TPGroup

    if launch.world_size != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {launch.world_size} processes (WORLD_SIZE) but --tensor-parallel-size is "
                         f"{config.tensor_parallel_size}: they must be equal")
    store = dist.TCPStore(launch.host, launch.port, launch.world_size,
                          is_master=launch.rank == 0 and not launch.agent_store, timeout=RENDEZVOUS_TIMEOUT)
    store = dist.PrefixStore(f"ddtree/{launch.restart}", store)
    return TPGroup(launch.rank, launch.world_size, rank_config(config, launch.rank).device, store,
                   loopback=launch.host in LOOPBACK)


def check_devices(config: EngineConfig) -> None:
    if not config.is_cuda:
        return
    import torch

    if config.device not in ("cuda", "cuda:0"):
        raise ValueError(f"with --tensor-parallel-size {config.tensor_parallel_size}, use --device cuda (rank r runs "
                         f"on cuda:r), not {config.device!r}")
    found = torch.cuda.device_count()
    if found < config.tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} needs that many CUDA devices; "
                         f"{found} visible")


class Followers:
    """Rank 0's handle on ranks 1..N-1: started here (subprocesses) before the group forms, or, under torchrun,
    started by it (on this node or others); stopped with the leader's core."""

    def __init__(self, config: EngineConfig, log_level: int | str | None = None):
        from engine.distributed import TPGroup

        n = config.tensor_parallel_size
        launch = torchrun_launch()
        if launch is not None:  # torchrun started every rank; this one is rank 0
            self.processes: list[subprocess.Popen] = []
            self.tp = join_launched(config, launch)
            logger.info("tensor parallel: %d ranks started by torchrun (store %s:%d)", n, launch.host, launch.port)
            return
        check_devices(config)
        store, rendezvous = TPGroup.open_store(HOST, n)
        self.processes = [_spawn(config, rank, rendezvous, log_level) for rank in range(1, n)]
        self.tp = TPGroup.join(0, rendezvous, rank_config(config, 0).device, store)
        logger.info("tensor parallel: %d ranks (followers: pids %s)", n, ", ".join(str(p.pid) for p in self.processes))

    def check(self) -> None:
        """Raises when a follower has exited: the group cannot run another collective (the leader's engine dies
        with this reason, as after any engine death)."""
        for rank, p in enumerate(self.processes, start=1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with status {p.returncode}")

    def stop(self, graceful: bool = True) -> None:
        """Tells the followers to exit (they may be gone already) and reaps them. graceful=False (the leader failed
        while starting, when a follower may be inside a collective the leader will never join): kills them."""
        if graceful:
            try:
                self.tp.broadcast_object(("shutdown", ()))
            except Exception:
                pass
        else:
            for p in self.processes:
                p.kill()
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.tp.shutdown()


def _spawn(config: EngineConfig, rank: int, rendezvous, log_level) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "engine.ranks"], stdin=subprocess.PIPE,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    proc.stdin.write(pickle.dumps((config, rank, rendezvous, log_level)))
    proc.stdin.close()
    return proc


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def follow(core) -> None:
    """A follower's loop: make each call the leader broadcasts, until it says shutdown. The calls' errors are the
    leader's too (same inputs), which reports them; here they are only logged at debug level."""
    while True:
        name, args = core.tp.broadcast_object()
        if name == "shutdown":
            return
        try:
            getattr(core, name)(*args)
        except ValueError as e:  # a bad request: the leader answers it
            logger.debug("rank %d: %s failed: %s", core.tp.rank, name, e)


def follow_launched(config: EngineConfig, launch: Launch, log_level: int | str | None = None) -> int:
    """A torchrun-started rank > 0 (`ddtree serve` under torchrun): its engine follows rank 0's until shutdown."""
    from engine.core import EngineCore
    from engine.process import configure_logging

    configure_logging(log_level)
    tp = join_launched(config, launch)
    core = EngineCore(config, tp=tp)
    logger.info("tensor-parallel rank %d of %d (torchrun) ready", launch.rank, launch.world_size)
    try:
        follow(core)
    finally:
        tp.shutdown()
    return 0


def follower_main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # the leader owns this process's lifetime
        signal.signal(sig, signal.SIG_IGN)
    config, rank, rendezvous, log_level = pickle.loads(sys.stdin.buffer.read())
    if log_level is not None:
        from engine.process import configure_logging

        configure_logging(log_level)
    from engine.core import EngineCore
    from engine.distributed import TPGroup

    tp = TPGroup.join(rank, rendezvous, rank_config(config, rank).device)
    core = EngineCore(config, tp=tp)
    try:
        follow(core)
    finally:
        tp.shutdown()
    os._exit(0)


if __name__ == "__main__":
    follower_main()
