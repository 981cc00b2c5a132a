"""Runs a function on N gloo ranks of one context group, for the context-parallel layer tests.

    results = run_ranks(fn, size, *args)   # fn(rank, size, *args) on every rank; its return values in rank order

fn runs in a child forked from multiprocessing's fork server (a fresh interpreter with torch and the model code
imported, one intra-op thread each child), with the default process group initialised over gloo; fn and args must
pickle (module-level functions, modules, tensors), and so must what fn returns (it travels as plain pickle bytes, so
tensors outlive the child). The test process itself is not forked: an xdist worker that has run many tests holds
tens of GB of address space. A rank that raises fails the call with that rank's traceback; a rank that hangs fails
it after `timeout` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback

import torch
import torch.distributed as dist

from moe_tune.engine.parallel.launch import rank_env, rendezvous


def _child(fn, rank: int, size: int, port: int, args, queue) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(rank_env(rank, size, port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        try:
            # Plain pickle bytes: the queue's own pickler would send tensors as shared memory that dies with this
            # process before the parent reads it.
            queue.put((rank, True, pickle.dumps(fn(rank, size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, size: int, *args, timeout: float = 120.0) -> list:
    ctx = mp.get_context("forkserver")
    # Imported once by the server, not by every child.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "moe_tune.engine.model.model"])
    queue = ctx.Queue()
    results: dict[int, object] = {}
    with rendezvous() as port:
        procs = [ctx.Process(target=_child, args=(fn, r, size, port, args, queue)) for r in range(size)]
        for proc in procs:
            proc.start()
        try:
            for _ in range(size):
                rank, ok, value = queue.get(timeout=timeout)
                if not ok:
                    raise AssertionError(f"context rank {rank} of {size} failed:\n{value}")
                results[rank] = pickle.loads(value)  # written by our own child above
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
    return [results[r] for r in range(size)]
