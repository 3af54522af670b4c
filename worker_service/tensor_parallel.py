"""A tensor-parallel worker group: T processes (ranks) joined by torch.distributed.

`option.tensor_parallel_degree=T` makes one worker a group of T ranks. Rank 0 is the
worker the scheduler talks to (one address); ranks 1..T-1 serve no gRPC and follow rank
0 (tp_engine.py). Every rank loads the model with transformers' own tensor-parallel plan
(`DistributedConfig(tp_size=T)`, the architecture's `base_model_tp_plan`): linear layers
are split column- and row-wise, attention runs on each rank's own heads, and so each
rank's KV buffers hold its own heads only. Tensors move only through torch.distributed:
gloo on CPU, NCCL for the model's tensors on CUDA (where the control messages still go
over gloo on CPU).

Two ways to start a group:
- `seqserve-worker --tensor-parallel-degree T` with no torchrun variables: the process is
  rank 0 and starts ranks 1..T-1 itself (`launch_followers`), the same command with
  RANK/WORLD_SIZE/LOCAL_RANK in the environment and the address of rank 0's TCPStore.
  A follower dies with its launcher (PR_SET_PDEATHSIG), and rank 0 exits as soon as one
  follower does (`watch_followers`), so a dead rank is the group's failure, which the
  scheduler sees as its worker failing and recovers from.
- torchrun (`torchrun --nproc-per-node T -m worker_service.main ...`): RANK, WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT come from it; torchrun's agent stops the others when one
  rank fails.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

logger = logging.getLogger(__name__)

# Set on the ranks a launcher started: the launcher's pid, so a follower can die with it.
LAUNCHER_ENV = "SEQSERVE_TP_LAUNCHER_PID"
# How long a collective may wait for a rank before the group counts as failed. Loading a
# large model with rank skew takes long, so this is generous; a rank that dies is noticed
# at once (its sockets close), and an idle group exchanges heartbeats (tp_engine.py).
GROUP_TIMEOUT = timedelta(minutes=30)
PR_SET_PDEATHSIG = 1


class TensorParallelError(ValueError):
    """The model cannot be split as asked; the message names the architecture."""


@dataclass(frozen=True)
class Rank:
    """This process's place in its group."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls, degree: int) -> Rank | None:
        """The rank torchrun (or our launcher) gave this process; None if none was."""
        if "RANK" not in os.environ:
            return None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != degree:
            raise TensorParallelError(
                f"WORLD_SIZE={world} but option.tensor_parallel_degree={degree}; start "
                f"exactly tensor_parallel_degree ranks (torchrun --nproc-per-node {degree})")
        rank = int(os.environ["RANK"])
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


def follow_launcher() -> None:
    """On a rank our launcher started: die with the launcher, even if it was SIGKILLed."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before prctl took effect
        os._exit(1)


def split_threads(degree: int) -> None:
    """On CPU, give each of the T ranks on this machine its share of the cores, unless
    OMP_NUM_THREADS says otherwise: T ranks with all cores each would oversubscribe."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // degree))


def launch_followers(degree: int, argv: list[str]) -> tuple[Rank, object, list[subprocess.Popen]]:
    """Become rank 0 of a new group: open the rendezvous store and start ranks 1..T-1
    with this process's own arguments. Returns (rank 0, the store, the followers)."""
    import torch.distributed as dist

    # Port 0: the OS picks a free port and the store keeps it bound, so nothing can take
    # it between choosing and listening.
    store = dist.TCPStore("127.0.0.1", 0, degree, is_master=True, timeout=GROUP_TIMEOUT,
                          wait_for_workers=False)
    followers = []
    for rank in range(1, degree):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(degree), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), LAUNCHER_ENV: str(os.getpid())}
        followers.append(subprocess.Popen([sys.executable, "-m", "worker_service.main", *argv],
                                          env=env))
    logger.info("tensor-parallel group of %d: started ranks 1-%d (pids %s), rendezvous on "
                "127.0.0.1:%d", degree, degree - 1, [p.pid for p in followers], store.port)
    return Rank(0, degree, 0), store, followers


def watch_followers(followers: list[subprocess.Popen], stopping: threading.Event) -> None:
    """Run until `stopping`: if a follower exits meanwhile, the group has failed; exit
    rank 0 at once (and with it, through PR_SET_PDEATHSIG, the other followers) so the
    scheduler recovers its sequences and a supervisor restarts the group."""
    while not stopping.wait(0.1):
        for rank, proc in enumerate(followers, start=1):
            code = proc.poll()
            if code is not None and not stopping.is_set():
                logger.critical("rank %d (pid %d) exited with %s: the tensor-parallel "
                                "group has failed; rank 0 exits so that the scheduler "
                                "recovers its requests", rank, proc.pid, code)
                logging.shutdown()
                os._exit(1)


def join_group(me: Rank, device: str, store=None) -> None:
    """Join the process group: gloo for CPU tensors; on CUDA also NCCL for the model's."""
    import torch
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(me.local_rank)
    if store is None and os.environ.get(LAUNCHER_ENV):
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              me.world_size, is_master=False, timeout=GROUP_TIMEOUT)
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=me.rank, world_size=me.world_size,
                            timeout=GROUP_TIMEOUT, **kwargs)
    logger.info("joined the tensor-parallel group as rank %d of %d (%s)", me.rank,
                me.world_size, backend)


def rank_device(device: str, me: Rank | None) -> str:
    """The device a rank computes on: its own GPU (cuda:LOCAL_RANK) on CUDA."""
    if me is not None and device == "cuda":
        return f"cuda:{me.local_rank}"
    return device


def shard_kwargs(config, degree: int) -> dict:
    """`from_pretrained` arguments that split the model over `degree` ranks with its
    architecture's own plan; raises TensorParallelError naming what is missing."""
    if degree == 1:
        return {}
    import transformers
    from transformers.distributed import DistributedConfig

    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if not getattr(config, "base_model_tp_plan", None):
        raise TensorParallelError(
            f"{arch} cannot run with tensor_parallel_degree={degree}: transformers "
            f"{transformers.__version__} defines no tensor-parallel plan for it "
            f"(its config's base_model_tp_plan is empty). Serve it with "
            f"tensor_parallel_degree=1, and several workers for more throughput (data "
            f"parallel, option.worker_addresses)")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % degree:
            raise TensorParallelError(
                f"{arch} cannot run with tensor_parallel_degree={degree}: its {name}="
                f"{heads} does not divide among {degree} ranks (each rank computes whole "
                f"heads); choose a degree that divides it")
    return {"distributed_config": DistributedConfig(tp_size=degree)}


def label_logs(rank: int) -> None:
    """Name the rank in every log line: a group's ranks share one log."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"))
