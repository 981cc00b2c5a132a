"""What a run needs before it allocates it: the parameters a profile implies on this rank (weights, adapters,
gradients, optimizer state) and a lower bound of one micro-batch's tensors, against the memory this rank has, so
that an impossible size is one line, not an out-of-memory kill (or hours of building rows) later."""

from __future__ import annotations

import os

import torch

from moe_tune.engine.plan import plan_layouts
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

__all__ = ["available_memory", "host_available_memory", "check_memory_fits", "micro_batch_bytes"]

GB = 1e9
# A micro-batch's input ids and labels, int64 each.
TOKEN_BYTES = 16


def host_available_memory() -> int:
    """Bytes the host can give without swapping: MemAvailable of /proc/meminfo, else the free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes this rank may allocate on `device` and where that figure comes from (for the message)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    # Local ranks on one host share its memory.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    available = host_available_memory()
    if local_ranks > 1:
        return available // local_ranks, f"host memory available per local rank ({local_ranks} ranks)"
    return available, "host memory available"


def check_memory_fits(profile: JobProfile, world_size: int, device: torch.device) -> None:
    """Raise ProfileError when the parameters the profile implies on this rank cannot fit the memory it has.

    The need is engine/plan's per-device bytes with every tensor sharded over all ranks (ZeRO-3): a lower
    bound for every stage, so a run this refuses could not have started; activations are left out (the memory policy
    decides them)."""
    plan = plan_layouts(profile, max(world_size, 1), device_memory=0)
    layout = next((lay for lay in plan.layouts if lay.is_profile_layout), None)
    if layout is None:
        # parallel.expert_parallel does not divide the world: check_world refuses the run in its own words.
        return
    weights = layout.dense_weights + layout.expert_weights + layout.lora_weights
    need = weights + layout.gradients
    # An offloaded optimizer keeps its state in host memory, not on the GPU.
    if not (device.type == "cuda" and profile.parallel.offload_optimizer):
        need += layout.optimizer
    available, where = available_memory(device)
    cfg = profile.model
    if need > available:
        raise ProfileError([
            f"model (vocab_size {cfg.vocab_size}, hidden_size {cfg.hidden_size}, {len(cfg.layers)} layers) needs "
            f"~{need / GB:.1f} GB on this rank for weights ({weights / GB:.1f} GB), gradients and optimizer state, "
            f"more than the {available / GB:.1f} GB {where} (moe-tune plan shows the layouts that fit)"])  # fmt: skip
    batch = micro_batch_bytes(profile)
    if need + batch > available:
        train, seq_len = profile.train, profile.data.seq_len
        raise ProfileError([
            f"train.micro_batch_size ({train.micro_batch_size}) rows of data.seq_len ({seq_len}) tokens need at least "
            f"~{batch / GB:.1f} GB on this rank (token ids, labels and one hidden state of hidden_size "
            f"{cfg.hidden_size} a token) beside the model's ~{need / GB:.1f} GB, more than the "
            f"{available / GB:.1f} GB {where}: lower train.micro_batch_size or data.seq_len"])  # fmt: skip


def micro_batch_bytes(profile: JobProfile) -> int:
    """A lower bound of what one micro-batch takes on a rank: its tokens' ids and labels (int64) and one hidden state
    [tokens, hidden_size] in the training dtype, which every layer's input is (offloading to host memory keeps at
    least the one at work). A context-parallel rank holds 1 / parallel.context_parallel of each row."""
    tokens = profile.train.micro_batch_size * profile.data.seq_len // profile.parallel.context_parallel
    hidden_bytes = profile.model.hidden_size * (2 if profile.train.precision == "bf16" else 4)
    return tokens * (TOKEN_BYTES + hidden_bytes)
