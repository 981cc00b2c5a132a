"""The DeepSpeed config, generated from the profile; written next to the outputs as it was used."""

from __future__ import annotations

from typing import Any

from moe_tune.profiles.schema import JobProfile


def deepspeed_config(profile: JobProfile, world_size: int) -> dict[str, Any]:
    train, parallel = profile.train, profile.parallel
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * world_size,
        # DeepSpeed clips at 1.0 when this is absent: always say what the profile asks for.
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {
            "stage": parallel.zero_stage,
            "overlap_comm": False,
            # Stage 1 in one process keeps the gradients where backward put them: DeepSpeed's contiguous buffer
            # would copy each one into a bucket and again into the partition at the end of backward, two launches
            # and a Python pass a tensor while the GPU waits (bench-qwen3-next on an H200, by turns in one process:
            # 95.8 / 92.8 ms a step without against 105.1 / 96.5 with, same loss and gradient norm;
            # docs/perf-history.md).
            "contiguous_gradients": not (parallel.zero_stage == 1 and world_size == 1),
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        # The optimizer is a client torch.optim.AdamW over the trainable parameters only.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) waits for the device at the start of every forward and at
        # every step: the host could not queue a step's first work while the device finishes the previous one.
        # Nothing reads it (steps_per_print above); the trainer times steps itself.
        "timers": {"throughput": {"enabled": False}},
    }
    if parallel.offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if train.precision == "bf16":
        # bf16 needs no loss scaling. DeepSpeed's overflow check would read every gradient each step (seven small
        # kernels per tensor and a wait for the GPU: 13 ms of bench-qwen3-moe's 117 ms step on the H200,
        # docs/perf-history.md); the trainer stops on a non-finite loss or gradient norm instead (trainer.check_finite).
        config["bf16"] = {"enabled": True, "check_grad_overflow": False}
    return config


# The ZeRO stage that costs a single GPU process least: nothing to partition over one rank, and no per-parameter
# gradient hooks (bench-qwen3-next on an H200, docs/bench.md: 97.5 ms a step at stage 1, 115.5 at 0, 142.0 at 2).
ONE_GPU_ZERO_STAGE = 1


def zero_stage_note(profile: JobProfile, world_size: int, device_type: str) -> str | None:
    """A one-line hint when the profile asks for ZeRO-2 or -3 on a single GPU process, where they only cost time."""
    stage = profile.parallel.zero_stage
    if world_size != 1 or stage < 2 or device_type != "cuda":
        return None
    what = "gradients and dense weights" if stage == 3 else "gradients"
    return (
        f"note: parallel.zero_stage {stage} on one GPU partitions the {what} over a single rank (nothing saved) and "
        "its hooks cost host time every step (bench-qwen3-next on an H200: 97.5 ms a step at stage 1, 142.0 at stage "
        f"2, 391 at stage 3; docs/bench.md); on one GPU set parallel.zero_stage: {ONE_GPU_ZERO_STAGE}"
    )
