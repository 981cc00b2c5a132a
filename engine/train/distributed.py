"""Process-group set-up for DeepSpeed, on a GPU cluster or one CPU process alike.

The rendezvous follows the standard variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) that
torchrun and the deepspeed launcher set; a bare `moe-tune finetune` becomes a world of one, whose store lives in
its own process (no port).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch

from moe_tune.engine.parallel.context import ContextShard
from moe_tune.engine.train import ds_sync_free
from moe_tune.profiles import ProfileError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # The context groups (parallel.context_parallel), once the trainer has created them; None: rows held whole.
    context: ContextLayout | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which rows this rank reads: its context group's index (its rank without context parallelism)."""
        return self.context.data_rank if self.context is not None else self.rank

    @property
    def data_size(self) -> int:
        """The data-parallel ranks the rows are split over: the context groups (the world without them)."""
        return self.context.data_size if self.context is not None else self.world_size


@dataclass(frozen=True)
class ContextLayout:
    """Where this rank sits under context parallelism (parallel.context_parallel N): world = data x context, ranks
    [d N, (d + 1) N) form context group d and share the rows of data-parallel index d, rank r holding share r % N of
    each. N 1 (group None) is plain data parallelism: every rank holds whole rows."""

    size: int = 1  # N, ranks of a context group
    rank: int = 0  # this rank's share of the row: tokens [rank T / N, (rank + 1) T / N)
    data_rank: int = 0  # which rows this rank's group reads
    data_size: int = 1  # world size / N: the groups the rows are split over
    group: object | None = None

    def shard(self, cu_seqlens: torch.Tensor) -> ContextShard | None:
        """This rank's share of the packed row that cu_seqlens [N + 1] describes; None when rows are held whole."""
        if self.size == 1:
            return None
        return ContextShard.of_row(cu_seqlens, self.group, self.rank, self.size)


def create_context_layout(context_parallel: int, rank: int, world_size: int, timeout_s: float) -> ContextLayout:
    """The context groups of parallel.context_parallel consecutive ranks (every rank calls this: each group's
    creation is a collective of the world). Consecutive, as DeepSpeed's expert groups: on a multi-GPU host a
    group's ranks share its fast links, which carry the gathers of every token-mixing layer."""
    if context_parallel == 1:
        return ContextLayout(data_rank=rank, data_size=world_size)
    group = None
    for first in range(0, world_size, context_parallel):
        ranks = list(range(first, first + context_parallel))
        created = torch.distributed.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
        if rank in ranks:
            group = created
    return ContextLayout(context_parallel, rank % context_parallel, rank // context_parallel,
                         world_size // context_parallel, group)  # fmt: skip


def prepare_environment() -> None:
    """Must run before deepspeed is imported: DeepSpeed picks its accelerator at import time. Without a launcher's
    rank variables, those of a world of one."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"})


def resolve_backend(backend: str, on_gpu: bool, has_nccl: bool) -> str:
    """The profile's parallel.backend for this machine: auto is nccl on a GPU, else gloo; ProfileError for nccl
    where it cannot run (before anything is initialised or written)."""
    if backend == "auto":
        return "nccl" if on_gpu else "gloo"
    if backend == "nccl" and not (on_gpu and has_nccl):
        why = "torch here is built without NCCL" if on_gpu else "this machine has no CUDA GPU"
        raise ProfileError([f"parallel.backend ('nccl') needs a CUDA GPU and NCCL: {why} (use auto or gloo)"])
    return backend


def init_distributed(backend: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the process group; a collective waiting longer than timeout_s fails instead of hanging."""
    prepare_environment()
    import importlib

    import deepspeed

    # `import deepspeed.comm.torch` would bind the torch package that deepspeed.comm re-exports under that name.
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    # DeepSpeed compiles a shared-memory all-reduce op on the CPU accelerator's first init (~40 s); the gloo
    # backend never uses it.
    ds_comm_torch.build_shm_op = lambda: None
    # ZeRO stage 1/2's norm and clip without host round trips (ds_sync_free.py).
    ds_sync_free.install()
    on_gpu = torch.cuda.is_available()
    backend = resolve_backend(backend, on_gpu, torch.distributed.is_nccl_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not torch.distributed.is_initialized() and os.environ.get("WORLD_SIZE", "1") == "1":
        # A world of one joins no peer: its store is a table in this process, where a TCP store would need a port
        # that another process could take between its choice and its binding.
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                                             timeout=timeout)  # fmt: skip
    # On a process group already there (the world of one's), DeepSpeed's communication wraps it.
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    return DistInfo(
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
    )


def shutdown_distributed() -> None:
    """End every distributed run this way, or ranks can hang or warn at exit."""
    if torch.distributed.is_initialized():
        import deepspeed.comm

        torch.distributed.barrier()
        # DeepSpeed's own teardown also drops the groups it cached, so a later run in this process starts clean.
        deepspeed.comm.destroy_process_group()
    release_zero3_modules()


def release_zero3_modules() -> None:
    """Drop the references ZeRO-3's module globals keep to the models of finished runs, which would otherwise keep
    the model, its engine and the engine's process groups (with their gloo threads, 6 a run) alive as long as the
    process. Each engine puts its top module on deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK and never
    takes it off; PartitionedParameterCoordinator caches which parameters to release in a class-level lru_cache
    keyed by (coordinator, module, step). Called when a run is over: no forward is running, and neither holds
    anything else then."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None and isinstance(getattr(offload, "FWD_MODULE_STACK", None), list):
        offload.FWD_MODULE_STACK.clear()
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None and hasattr(coordinator, "PartitionedParameterCoordinator"):
        for method in vars(coordinator.PartitionedParameterCoordinator).values():
            clear_lru_caches(method)


def clear_lru_caches(fn) -> None:
    """Clear `fn`'s functools cache, or that of a function its closure wraps (DeepSpeed's instrument_w_nvtx wraps
    the cached method in a plain closure, without __wrapped__)."""
    cells = getattr(fn, "__closure__", None) or ()
    for candidate in (fn, *(cell.cell_contents for cell in cells if cell_is_filled(cell))):
        if callable(getattr(candidate, "cache_clear", None)):
            candidate.cache_clear()


def cell_is_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when any rank saw `flag` (a collective where several ranks run: every rank must call it)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t)
    return bool(t.item() > 0)
