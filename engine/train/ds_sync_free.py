"""Four DeepSpeed 0.19.8 ZeRO stage 1/2 helpers (one of them also stage 3's), replaced by versions that never
wait for the GPU or launch less.

Each step DeepSpeed's stage 1/2 optimizer computes the gradient norm, then clips. Two of its helpers read a value
back to the host on the way: `mask_nan_or_inf_with_val_inplace` builds its fill value with `torch.tensor(-1.0,
device=...)` and fills with a tensor, and `unscale_and_clip_grads` asks `is_invalid_grad_norm(norm)` in Python.
Each read makes the host wait until the GPU has run the whole backward, and the GPU then idles while the host
issues the optimizer step: on the H200 that step took the host 21 ms against 4 ms of GPU work (bench-qwen3-moe,
docs/perf-history.md). The replacements compute the same values with tensor ops only:
- the norm: inf and NaN become -1 (DeepSpeed's sentinel for an invalid norm), filled with a Python scalar;
- the clip: an invalid norm (negative, inf or NaN) clips with an infinite norm, as DeepSpeed does (the update is
  zero); a valid one gives the same clip factor from the same ops, so gradients come out bit for bit the same
  (tests/engine/test_ds_sync_free.py). The trainer still stops on a non-finite gradient norm (trainer.check_finite).
- the 2-norm of the gradients (`get_grad_norm_direct`): DeepSpeed casts each gradient to its norm dtype (fp64 on a
  GPU) and takes its norm, two launches and a Python iteration per tensor while the GPU waits for the step (192
  launches for the 96 LoRA tensors of bench-qwen3-next); here one `torch._foreach_norm` in the same dtype over all
  of them. The per-tensor norms are the same fp64 sums up to their order, so the fp32 total agrees with
  DeepSpeed's to fp64 rounding (tests/engine/test_ds_sync_free.py); other norm types take DeepSpeed's own.
- the gradients' all-reduce after backward (`allreduce_no_retain`): over a data-parallel group of one rank DeepSpeed
  still flattens the gradients into one buffer, divides it by 1, all-reduces it and copies each gradient back out of
  it, one launch a tensor (96 of the 125 device-to-device copies of a bench-qwen3-next step on an H100). Where that
  is the identity (one rank, nothing overlapped, no sequence parallelism, a communication dtype the gradients convert
  to and back without rounding: their own or a wider float) it is skipped, and the gradients stay the tensors
  backward made, bit for bit DeepSpeed's (tests/engine/test_ds_sync_free.py); elsewhere DeepSpeed's code runs.
"""

from __future__ import annotations

import importlib

import torch

# The DeepSpeed release these replacements were written against (setup.cfg pins it exactly).
DEEPSPEED_VERSION = "0.19.8"
# DeepSpeed's own helpers, kept by install() (the tests compare against them).
ORIGINALS: dict[str, object] = {}


def mask_nan_or_inf_with_val_inplace(input: torch.Tensor, device=None, val: float = -1.0) -> None:
    """DeepSpeed's helper of the same name (which ignores `val` and fills -1), without a host round trip."""
    input.masked_fill_(input.isinf() | input.isnan(), -1.0)


def unscale_and_clip_grads(self, grad_groups_flat, total_norm) -> None:
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads, with the norm's validity decided on the device."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    combined_scale = self.loss_scale
    if self.clip_grad > 0.0:
        norm = total_norm if torch.is_tensor(total_norm) else torch.tensor(float(total_norm), dtype=torch.float)
        is_valid = torch.isfinite(norm) & (norm >= 0)
        # norm is in fact norm * scale
        clip_norm = torch.where(is_valid, norm, torch.full_like(norm, float("inf")))
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)


def get_grad_norm_direct(self, gradients, params, norm_type=2):
    """DeepSpeedZeroOptimizer.get_grad_norm_direct with the per-tensor 2-norms in one `torch._foreach_norm`."""
    if float(norm_type) != 2.0:
        return ORIGINALS["get_grad_norm_direct"](self, gradients, params, norm_type)
    stage_1_and_2 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    dist = stage_1_and_2.dist
    # The gradients DeepSpeed's loop counts: not its alignment padding, not pipeline-replicated parameters, and
    # model-parallel-replicated ones on model-parallel rank 0 only.
    param_gradients = (g for g in gradients if not getattr(g, "_zero_padding", False))
    counted = [
        g.detach()
        for g, p in zip(param_gradients, params)
        if not (hasattr(p, stage_1_and_2.PIPE_REPLICATED) and p.ds_pipe_replicated)
        and (stage_1_and_2.is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
    ]
    if counted:
        norms = torch._foreach_norm(counted, 2, dtype=stage_1_and_2.get_norm_dtype())
        total_norm = torch.stack(norms).pow(2).sum().float()
    else:
        total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
    total_norm = total_norm.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
    return total_norm


def allreduce_no_retain(self, bucket, communication_data_type, numel_per_bucket=500000000, rank=None, log=None,
                        divide=True, process_group=None, output_bucket=None):  # fmt: skip
    """DeepSpeedZeroOptimizer.allreduce_no_retain, which over one rank only adds each gradient to its partition
    output (where one is given) when the all-reduce would return the gradients unchanged (module docstring)."""
    stage_1_and_2 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    group = self.dp_process_group if process_group is None else process_group
    if not _reduction_is_identity(self, stage_1_and_2, bucket, communication_data_type, group):
        return ORIGINALS["allreduce_no_retain"](self, bucket, communication_data_type, numel_per_bucket, rank, log,
                                                divide, process_group, output_bucket)  # fmt: skip
    if rank is not None and rank != stage_1_and_2.dist.get_rank(group=group):
        # A reduce to another rank: DeepSpeed leaves this rank's tensors and outputs as they are.
        return None
    add_to_partition = stage_1_and_2.DeepSpeedZeroOptimizer._add_to_grad_partition_buffer
    for tensor, output in zip(bucket, output_bucket or [None] * len(bucket), strict=True):
        add_to_partition(output, tensor)
    return None


# A float converts to these and back unchanged (every value of the narrower format is one of the wider's).
_EXACT_WIDENINGS = {
    torch.float16: (torch.float16, torch.float32, torch.float64),
    torch.bfloat16: (torch.bfloat16, torch.float32, torch.float64),
    torch.float32: (torch.float32, torch.float64),
    torch.float64: (torch.float64,),
}


def _reduction_is_identity(self, stage_1_and_2, bucket, communication_data_type, group) -> bool:
    """Whether DeepSpeed's all-reduce of `bucket` over `group` would leave every tensor as it is: one rank, nothing
    overlapped, no sequence parallelism (whose averaging multiplies), and a dtype round trip without rounding."""
    if stage_1_and_2.dist.get_world_size(group=group) != 1 or self.overlap_comm:
        return False
    if stage_1_and_2.pg_correctness_test or self.sequence_parallel_size != 1:
        return False
    return all(communication_data_type in _EXACT_WIDENINGS.get(t.dtype, ()) for t in bucket)


def install() -> None:
    """Put the replacements in place (idempotent). Raises RuntimeError on another DeepSpeed release, whose helpers
    these were not checked against."""
    import deepspeed

    if deepspeed.__version__ != DEEPSPEED_VERSION:
        raise RuntimeError(
            f"deepspeed {deepspeed.__version__}: moe-tune's sync-free ZeRO helpers were checked against "
            f"{DEEPSPEED_VERSION} only (pip install deepspeed=={DEEPSPEED_VERSION})"
        )
    stage_1_and_2 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    optimizer = stage_1_and_2.DeepSpeedZeroOptimizer
    if not ORIGINALS:
        ORIGINALS["mask_nan_or_inf_with_val_inplace"] = stage_1_and_2.mask_nan_or_inf_with_val_inplace
        ORIGINALS["unscale_and_clip_grads"] = optimizer.unscale_and_clip_grads
        ORIGINALS["get_grad_norm_direct"] = optimizer.get_grad_norm_direct
        ORIGINALS["allreduce_no_retain"] = optimizer.allreduce_no_retain
    stage_1_and_2.mask_nan_or_inf_with_val_inplace = mask_nan_or_inf_with_val_inplace
    # Stage 3 shares the norm helper (its clip already stays on the device; its step still reads the norm once).
    importlib.import_module("deepspeed.runtime.zero.stage3").mask_nan_or_inf_with_val_inplace = (
        mask_nan_or_inf_with_val_inplace
    )
    optimizer.unscale_and_clip_grads = unscale_and_clip_grads
    optimizer.get_grad_norm_direct = get_grad_norm_direct
    optimizer.allreduce_no_retain = allreduce_no_retain
