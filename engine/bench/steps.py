"""The end-to-end profile behind `moe-tune profile PROFILE`: real training steps of a profile (the trainer's model,
LoRA, DeepSpeed ZeRO and optimizer), timed one by one, with peak memory, MFU (engine/bench/flops.py), the memory
policy's metrics, a per-operator breakdown of one more step (engine/bench/breakdown.py) and, on request, the same
steps of the transformers + PEFT baseline (engine/bench/against.py).

`profile_steps` returns one result dict (RESULT_KEYS); `StepRunner` is the loop it drives, also used by
`memory_sweep` to find the longest sequence each memory preset trains, and by `--against bf16-base` to time the
same steps of an FP8-base profile's dequantized twin (engine/bench/bf16_base.py). Nothing is written to output.dir.
"""

from __future__ import annotations

import dataclasses

import gc
import math
import statistics
from pathlib import Path
from typing import Any, Callable

import torch

from moe_tune.engine.bench.flops import piece_lengths
from moe_tune.engine.bench.machine import MACHINE_KEYS, machine_info
from moe_tune.engine.bench.timing import QueuedStep, median_ms, run_steps, timed_steps
from moe_tune.engine.train import ds_config
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

# Steps run before the timed ones: Triton compiles and autotunes in the first, the allocator settles in the second.
WARMUP_STEPS = 2
# Baselines `--against` can time.
AGAINST = ("transformers", "bf16-base")
# Pinned copy probe: large enough to reach the link's sustained rate, small enough to pin quickly.
COPY_PROBE_BYTES = 512 * 2**20
RESULT_KEYS = (
    "profile", "seq_len", "micro_batch_size", "gradient_accumulation_steps", "precision", "memory_policy",
    "graphed_moe_blocks",
    "warmup_steps", "steps", "first_step_loss", "losses",
    "tokens_per_s", "step_time_s", "step_times_s", "host_launch_s", "peak_memory_bytes",
    "model_flops_per_step", "model_flops_parts", "achieved_tflops", "peak_tflops", "mfu", "gpu_clocks",
    "parameters", "trainable_parameters", "breakdown", "against", "complete", "memory",
    "pinned_h2d_gb_per_s", "pinned_d2h_gb_per_s", "swap_fraction_of_pinned",
    *MACHINE_KEYS,
)  # fmt: skip


class StepRunner:
    """One process's training set-up for a profile, stepped by hand: `step()` runs one optimizer step.

    `prepare_model(model)` sees the built model (LoRA injected) before DeepSpeed takes it."""

    def __init__(self, profile: JobProfile, prepare_model: Callable[[torch.nn.Module], None] | None = None):
        from moe_tune.engine.train.distributed import prepare_environment

        prepare_environment()  # before deepspeed's import, which picks its accelerator (and says so on a CPU)
        import deepspeed

        import tempfile

        from moe_tune.engine.data.tokenizer import load_tokenizer
        from moe_tune.engine.memory import find_activation_memory
        from moe_tune.engine.parallel.expert_parallel import create_expert_layout
        from moe_tune.engine.train.distributed import create_context_layout, init_distributed
        from moe_tune.engine.train.ds_config import deepspeed_config
        from moe_tune.engine.train.graphs import check_cuda_graphs
        from moe_tune.engine.train.resources import check_memory_fits
        from moe_tune.engine.train.trainer import (
            build_dataset,
            build_optimizer,
            build_trainable_model,
            check_chunked_expert_adapters,
            check_world,
            lr_factor,
            optimizer_groups,
            quiet_third_party_noise,
            run_steps,
            watched_weights,
        )

        quiet_third_party_noise()
        # ZeRO-3 replaces torch.nn.functional.linear for good ("memory efficient linear"); close() puts it back, so
        # what runs after this runner in the process (the --against baseline) runs torch's own.
        self._functional_linear = torch.nn.functional.linear
        self.profile = profile
        train = profile.train
        self.dist = init_distributed(profile.parallel.backend, profile.parallel.timeout_s)
        check_world(profile, self.dist.world_size)
        check_chunked_expert_adapters(profile)
        check_memory_fits(profile, self.dist.world_size, self.dist.device)
        torch.manual_seed(train.seed)
        tokenizer = load_tokenizer(profile.tokenizer)
        # Nothing is written to output.dir: a generated corpus goes to a directory that lives as long as the runner.
        self._generated = tempfile.TemporaryDirectory(prefix="moe-tune-profile-")
        self.dataset, _, _, _ = build_dataset(profile, tokenizer, Path(self._generated.name))
        # As the trainer: rows are read by context group, each rank of a group training its share of the row.
        context = create_context_layout(profile.parallel.context_parallel, self.dist.rank, self.dist.world_size,
                                        profile.parallel.timeout_s)  # fmt: skip
        self.dist = dataclasses.replace(self.dist, context=context)
        # The schedule of the whole run the profile describes (train.steps, or what train.epochs gives).
        self.total_steps = run_steps(train, self.dataset, self.dist.data_size)
        layout = create_expert_layout(profile.parallel.expert_parallel, self.dist.world_size)
        check_cuda_graphs(profile, self.dist.device.type, layout.expert_parallel)
        ds_config = deepspeed_config(profile, self.dist.world_size)
        init_device = self.dist.device if self.dist.device.type == "cuda" else None
        model, _ = build_trainable_model(profile, layout, ds_config, init_device)
        if prepare_model is not None:
            prepare_model(model)
        self.activation_memory = find_activation_memory(model)
        optimizer = build_optimizer(optimizer_groups(model, train.weight_decay), profile, self.dist.device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train, self.total_steps))
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
        )
        self.is_cuda = self.dist.device.type == "cuda"
        self._watched = watched_weights(self.engine.module)
        self.steps_done = 0
        self._batches = None
        # The MoE blocks' CUDA graphs (train.cuda_graphs), captured at the first step for its micro-batch shape and
        # again after set_seq_len (the memory sweep's peaks must not hold a previous length's graph memory).
        self._expert_parallel = layout.expert_parallel
        self.graphs = None
        self._graphs_tokens = None

    def step(self) -> dict[str, Any]:
        """One optimizer step on an idle device, read at once: its time, tokens, loss and the memory policy's
        metrics."""
        if self.is_cuda:
            torch.cuda.synchronize()
        return self.finish(self.launch())

    def launch(self, behind=None) -> QueuedStep:
        """Queue one optimizer step, the trainer's own (engine/train/trainer.py, launch_step): its micro-batches
        forward and backward, the optimizer's step, the selection biases updated, the non-finite weight check, the
        copy of its values to the host; nothing waits for the device. behind: the unread QueuedStep it is queued
        behind."""
        from moe_tune.engine.train.trainer import launch_step

        self._capture_graphs(self.profile.train.micro_batch_size * self.dataset.seq_len)
        pieces: list[int] = []
        launched = launch_step(self, self.steps_done, self._watched, False, behind.values if behind else None,
                               on_share=lambda share: pieces.extend(piece_lengths(share.cu_seqlens)))  # fmt: skip
        self.steps_done += 1
        return QueuedStep(launched.tokens, pieces, launched.values, launched.memory_metrics)

    def finish(self, queued: QueuedStep) -> dict[str, Any]:
        """A queued step's record once its loss is on the host: its loss, tokens, time (StepValues.seconds), the
        host's time launching it, document pieces and the memory policy's metrics."""
        loss = queued.values.read()["loss"]
        seconds = queued.values.seconds()
        record = {"loss": loss, "tokens": queued.tokens, "step_time_s": seconds,
                  "tokens_per_s": queued.tokens / seconds, "launch_s": queued.values.launch_seconds(),
                  "pieces": queued.pieces}  # fmt: skip
        if queued.memory_metrics is not None:
            record.update(queued.memory_metrics)
        return record

    def document_loss(self, document) -> float:
        """Mean next-token loss on `document` (a micro-batch, here one document alone) in eval mode without gradients,
        as the trainer's evaluate() runs it: no expert loads counted, the training mode restored."""
        was_training = self.engine.module.training
        self.engine.eval()
        try:
            with torch.no_grad():
                out = self.engine(**document.model_inputs(self.dist.device), loss_denominator=1.0, return_logits=False)
        finally:
            self.engine.train(was_training)
        tokens = document.num_label_tokens
        return float(out.lm_loss) / tokens if tokens else math.nan

    def _capture_graphs(self, tokens: int) -> None:
        from moe_tune.engine.train.graphs import maybe_graph_moe_blocks

        if tokens == self._graphs_tokens:
            return
        self.release_graphs()
        self.graphs = maybe_graph_moe_blocks(
            self.engine.module, self.profile, self.dist.device, self._expert_parallel, tokens
        )
        self._graphs_tokens = tokens

    def release_graphs(self) -> None:
        """Destroy the MoE blocks' CUDA graphs (if any): the next step captures them again, with the kernels and the
        launch it then runs (engine/bench/launch_turns.py lets go of them between launches)."""
        if self.graphs is not None:
            # release() has destroyed the graphs; their pool's memory goes back to the device here.
            self.graphs.release()
            self.graphs = None
            torch.cuda.empty_cache()
        self._graphs_tokens = None

    @property
    def batches(self):
        """The micro-batches step() trains, each collated while the device runs the one before (MicroBatchesAhead),
        up to the end of the run the profile describes."""
        from moe_tune.engine.data.dataset import MicroBatchesAhead

        if self._batches is None:
            train = self.profile.train
            end = self.total_steps * train.gradient_accumulation_steps
            self._batches = MicroBatchesAhead(
                self.dataset, train.micro_batch_size, self.dist.data_rank, self.dist.data_size, end
            )
        return self._batches

    def micro_batches(self, step: int, rank: int = 0, world_size: int = 1) -> list:
        """The micro-batches `rank` trains in optimizer step `step` (what `step()` feeds, in order)."""
        train = self.profile.train
        first = step * train.gradient_accumulation_steps
        return [self.dataset.micro_batch(first + micro, train.micro_batch_size, rank, world_size)
                for micro in range(train.gradient_accumulation_steps)]  # fmt: skip

    def set_seq_len(self, seq_len: int) -> None:
        """Pack the same documents into rows of `seq_len` tokens from now on (the model does not change)."""
        from moe_tune.engine.data.dataset import PackedDataset

        d = self.dataset
        self.dataset = PackedDataset(d.documents, seq_len, d.pad_id, d.seed, d.image_settings)
        self._batches = None

    def close(self) -> None:
        from moe_tune.engine.train.distributed import shutdown_distributed
        from moe_tune.engine.train.trainer import release_engine

        self.release_graphs()
        # Its gradient hooks hold the engine (and its gradient buckets) for as long as the process lives otherwise.
        release_engine(self.engine)
        self.engine = None
        self.activation_memory = None
        torch.nn.functional.linear = self._functional_linear
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()
        shutdown_distributed()


def pinned_copy_bandwidth() -> tuple[float, float]:
    """Median GB/s (timing.median_ms) of a large copy from page-locked host memory to the GPU and back (the ceiling
    of swapping)."""
    host = torch.empty(COPY_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(COPY_PROBE_BYTES, dtype=torch.uint8, device="cuda")
    h2d_ms = median_ms(lambda: dev.copy_(host, non_blocking=True))
    d2h_ms = median_ms(lambda: host.copy_(dev, non_blocking=True))
    return COPY_PROBE_BYTES / h2d_ms * 1e-6, COPY_PROBE_BYTES / d2h_ms * 1e-6


def _median_metrics(records: list[dict]) -> dict[str, Any]:
    """Median over the timed steps of every memory_* metric (None when no step had it)."""
    keys = [k for k in records[0] if k.startswith("memory_")]
    merged = {}
    for key in keys:
        values = [r[key] for r in records if r.get(key) is not None]
        merged[key.removeprefix("memory_")] = statistics.median(values) if values else None
    return merged


def check_against(profile: JobProfile, against: str) -> None:
    """Refuse a baseline that cannot run before anything is built: ProfileError naming the field and the rule."""
    import os

    from moe_tune.engine.bench.against import check_buildable
    from moe_tune.engine.bench.bf16_base import check_bf16_base

    if against not in AGAINST:
        raise ProfileError([f"--against ({against!r}) must be one of: {', '.join(AGAINST)}"])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        raise ProfileError([f"--against {against} runs one process (WORLD_SIZE is {world_size}): run the profile "
                            "without a launcher"])  # fmt: skip
    if against == "bf16-base":
        check_bf16_base(profile)
    else:
        check_buildable(profile)


def profile_steps(
    profile: JobProfile,
    steps: int,
    warmup: int = WARMUP_STEPS,
    on_step: Callable[[int, bool, dict], None] | None = None,
    against: str | None = None,
    on_line: Callable[[str], None] | None = None,
    on_ours: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run `warmup` + `steps` training steps of `profile`, one more under the profiler and, on CUDA, one more with
    the host's waits for the GPU recorded (engine/bench/host_waits.py) and one with only the device's work profiled
    (breakdown.timeline_step); medians over the timed steps, MFU, the breakdown (RESULT_KEYS). `against`
    ('transformers' or 'bf16-base'): then the same steps of that baseline on the same micro-batches, in this
    process, after ours is freed (result["against"]); 'bf16-base' (an FP8-base profile) adds the per-step loss gap
    to it (against["loss_gap"]), 'transformers' both models' loss on one document before any step
    (against["one_document"]: the longest document of the first micro-batch alone).

    on_step(index, is_warmup, record) follows every step (record["impl"] says whose); on_line(text) says what
    runs next; on_ours(result) gets our measurements once they are all in, before any baseline runs: with a
    baseline still to run, `against` None and `complete` False (a run stopped in the baseline keeps ours)."""
    from moe_tune.engine.bench.breakdown import profiled_step, timeline_step
    from moe_tune.engine.bench.clocks import sampled_clocks
    from moe_tune.engine.bench.flops import FlopModel, gemm_peak_tflops
    from moe_tune.engine.bench.host_waits import host_wait_sites, recorded_host_waits
    from moe_tune.engine.bench.launch_sites import launch_sites_step
    from moe_tune.engine.memory import resolve_policy
    from moe_tune.engine.plan import count_parameters

    say = on_line or (lambda line: None)
    if against is not None:
        from moe_tune.engine.bench.against import base_precision_note

        check_against(profile, against)
        if against == "transformers" and (note := base_precision_note(profile)):
            say(note)
    twin, twin_problem, prepare_model = None, None, None
    fp8_weights: dict = {}
    initial = None
    if against == "transformers" and profile.model.checkpoint is None:
        from moe_tune.engine.bench.against import InitialWeights

        # The baseline starts from our initial weights, written as a transformers checkpoint before our first step
        # (a temporary folder, removed after the baseline ran or when the process ends).
        initial = InitialWeights(profile)
        say(f"writing our initial weights as a transformers checkpoint for the baseline ({initial.nbytes() / 1e9:.2f} "
            "GB)")  # fmt: skip
        prepare_model = initial.write
    if against == "bf16-base":
        from moe_tune.engine.bench.bf16_base import bf16_base_profile, fp8_base_weights, twin_fit_problem

        twin = bf16_base_profile(profile)
        # Asked while the device is empty; a twin that cannot fit gets no host copy of the FP8 base.
        twin_problem = twin_fit_problem(twin)
        if twin_problem is None:

            def prepare_model(model: torch.nn.Module) -> None:
                fp8_weights.update(fp8_base_weights(model))

    flop_model = FlopModel(profile.model, profile.lora)
    runner = StepRunner(profile, prepare_model=prepare_model)
    # The same hint finetune prints: ZeRO-2 and -3 on one GPU process cost host time and save nothing.
    if note := ds_config.zero_stage_note(profile, runner.dist.world_size, runner.dist.device.type):
        say(note)
    all_records = []
    document, document_loss = None, None
    try:
        if against == "transformers":
            from moe_tune.engine.bench.against import longest_document

            document = longest_document(runner.micro_batches(0)[0])
            document_loss = runner.document_loss(document)
        step_clocks = sampled_clocks(runner.dist.device)

        def before_launch(index: int) -> None:
            if index == warmup:
                # The timed steps start: their memory peak and the clocks they run at.
                step_clocks.mark()
                if runner.is_cuda:
                    torch.cuda.reset_peak_memory_stats()

        def keep(index: int, record: dict) -> None:
            record = dict(record, impl="moe-tune")
            if on_step is not None:
                on_step(index, index < warmup, record)
            all_records.append(record)

        with step_clocks:
            run_steps(runner, warmup + steps, keep, before_launch=before_launch)
        records = all_records[warmup:]
        peak = torch.cuda.max_memory_allocated() if runner.is_cuda else None
        copy_rates = pinned_copy_bandwidth() if runner.is_cuda else (None, None)
        say("measuring the GEMM peak (the MFU denominator)")
        with sampled_clocks(runner.dist.device) as peak_clocks:
            peak_tflops = gemm_peak_tflops(runner.dist.device, profile.train.precision)
        gpu_clocks = dict(steps=step_clocks.summary, gemm_peak=peak_clocks.summary) if runner.is_cuda else None
        say("one more step under torch.profiler (the breakdown)")
        breakdown = profiled_step(runner, statistics.median(r["step_time_s"] for r in records))
        if runner.is_cuda:
            say("one more step with the host's waits for the GPU recorded")
            torch.cuda.synchronize()
            with recorded_host_waits() as waits:
                runner.step()
            breakdown["host_waits"] = host_wait_sites(waits)
            say("one more step with only the device's work profiled (where it idles)")
            breakdown["device_timeline"] = timeline_step(runner)
        say("one more step with its dispatched ops recorded by call site")
        breakdown["launch_sites"] = launch_sites_step(runner)
        is_cuda, device = runner.is_cuda, runner.dist.device
        graphed_blocks = len(runner.graphs.blocks) if runner.graphs is not None else 0
        # The baseline trains on the very micro-batches our steps trained on.
        step_batches = [runner.micro_batches(step) for step in range(warmup + steps)] if against else []
    finally:
        runner.close()
    mfu_rows = [_mfu(flop_model.step(r["pieces"]), r["step_time_s"], peak_tflops) for r in records]
    memory = _median_metrics(records) if "memory_gpu_saved_bytes" in records[0] else {}
    swap_rates = [memory.get("h2d_gb_per_s"), memory.get("d2h_gb_per_s")]
    swap_fraction = None
    if copy_rates[0] is not None and all(r is not None for r in swap_rates):
        swap_fraction = min(swap_rates[0] / copy_rates[0], swap_rates[1] / copy_rates[1])
    policy = resolve_policy(profile.memory)
    policy_text = (
        "activation_checkpointing (whole layers)"
        if profile.memory.activation_checkpointing
        else f"{profile.memory.preset}: " + ", ".join(f"{k}={v}" for k, v in policy.classes.items())
    )
    counts = count_parameters(profile.model, profile.lora)
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
    result = dict(
        profile=profile.name,
        seq_len=profile.data.seq_len,
        micro_batch_size=profile.train.micro_batch_size,
        gradient_accumulation_steps=profile.train.gradient_accumulation_steps,
        precision=profile.train.precision,
        memory_policy=policy_text,
        graphed_moe_blocks=graphed_blocks,
        warmup_steps=warmup,
        steps=len(records),
        first_step_loss=all_records[0]["loss"],
        losses=[r["loss"] for r in records],
        tokens_per_s=tokens_per_s,
        step_time_s=statistics.median(r["step_time_s"] for r in records),
        step_times_s=[r["step_time_s"] for r in records],
        host_launch_s=statistics.median(r["launch_s"] for r in records),
        peak_memory_bytes=peak,
        model_flops_per_step=statistics.median(m["model_flops_per_step"] for m in mfu_rows),
        model_flops_parts=mfu_rows[0]["model_flops_parts"],
        achieved_tflops=statistics.median(m["achieved_tflops"] for m in mfu_rows),
        peak_tflops=peak_tflops,
        mfu=statistics.median(m["mfu"] for m in mfu_rows),
        gpu_clocks=gpu_clocks,
        parameters=counts.total,
        trainable_parameters=counts.trainable,
        breakdown=breakdown,
        against=None,
        complete=against is None,
        memory=memory,
        pinned_h2d_gb_per_s=copy_rates[0],
        pinned_d2h_gb_per_s=copy_rates[1],
        swap_fraction_of_pinned=swap_fraction,
        **machine_info(is_cuda),
    )
    if on_ours is not None:
        on_ours(dict(result))
    if against is None:
        return result
    loss_gap = None
    if against == "bf16-base":
        from moe_tune.engine.bench.bf16_base import loss_gap as relative_loss_gap

        say(f"the same {warmup + steps} steps with model.base_precision bf16 holding the FP8 base's weights "
            f"dequantized to {profile.train.precision}")  # fmt: skip
        baseline, twin_records = run_bf16_base(twin, fp8_weights, twin_problem, step_batches, warmup, on_step)
        if baseline["out_of_memory"] is None:
            twin_mfu = [_mfu(flop_model.step(r["pieces"]), r["step_time_s"], peak_tflops)
                        for r in twin_records[warmup:]]  # fmt: skip
            baseline.update({key: statistics.median(m[key] for m in twin_mfu)
                             for key in ("model_flops_per_step", "achieved_tflops", "mfu")})  # fmt: skip
            loss_gap = relative_loss_gap([r["loss"] for r in all_records], [r["loss"] for r in twin_records])
        else:
            baseline.update(model_flops_per_step=None, achieved_tflops=None, mfu=None)
    else:
        from moe_tune.engine.bench.against import run_transformers

        def tell(index: int, is_warmup: bool, record: dict) -> None:
            if on_step is not None:
                on_step(index, is_warmup, dict(record, impl=against))

        say(f"the same {warmup + steps} steps in {against}")
        try:
            baseline = run_transformers(profile, step_batches, warmup, device, runner.total_steps, on_step=tell,
                                        initial=initial, document=document)  # fmt: skip
        finally:
            if initial is not None:
                initial.close()
        # transformers attends over each whole row (one piece of seq_len tokens per row).
        rows_per_step = profile.train.micro_batch_size * profile.train.gradient_accumulation_steps
        flops = flop_model.step([profile.data.seq_len] * rows_per_step)
        if baseline["out_of_memory"] is None:
            baseline.update(_mfu(flops, baseline["step_time_s"], peak_tflops))
            baseline.pop("model_flops_parts")
        else:
            baseline.update(model_flops_per_step=flops.total, achieved_tflops=None, mfu=None)
    against_result = dict(
        baseline,
        baseline=against,
        speedup=tokens_per_s / baseline["tokens_per_s"] if baseline["tokens_per_s"] else None,
        memory_ratio=peak / baseline["peak_memory_bytes"] if peak and baseline["peak_memory_bytes"] else None,
    )
    if against == "bf16-base":
        against_result["loss_gap"] = loss_gap
    else:
        against_result["one_document"] = dict(tokens=document.input_ids.shape[1], moe_tune_loss=document_loss,
                                              baseline_loss=against_result.pop("document_loss"))  # fmt: skip
    return dict(result, against=against_result, complete=True)


def run_bf16_base(
    twin: JobProfile,
    fp8_weights: dict,
    fit_problem: str | None,
    step_batches: list[list],
    warmup: int,
    on_step: Callable[[int, bool, dict], None] | None = None,
) -> tuple[dict[str, Any], list[dict]]:
    """`--against bf16-base`: the steps of `twin` (bf16_base_profile of ours) with `fp8_weights` (fp8_base_weights
    of our model) dequantized into its base, one per entry of `step_batches` (the micro-batches ours trained on,
    checked equal to the twin's; the first `warmup` untimed), timed as ours. Returns (its row, every step's record);
    a twin that does not fit (`fit_problem`) or runs out of memory gives a row saying where (`out_of_memory`)."""
    from moe_tune.engine.bench.against import is_out_of_memory, timed_baseline_steps
    from moe_tune.engine.bench.bf16_base import BASELINE, impl_name, load_dequantized, same_batches
    from moe_tune.engine.plan import count_parameters
    from moe_tune.engine.train.distributed import shutdown_distributed

    is_cuda = torch.cuda.is_available()
    gc.collect()
    if is_cuda:
        torch.cuda.empty_cache()
    counts = count_parameters(twin.model, twin.lora)
    row: dict[str, Any] = dict(
        impl=impl_name(twin), steps=0, losses=[], first_step_loss=None, tokens_per_s=None, step_time_s=None,
        step_times_s=[], peak_memory_bytes=None,
        allocated_before_bytes=torch.cuda.memory_allocated() if is_cuda else None,
        parameters=counts.total, trainable_parameters=counts.trainable, dequantized_modules=len(fp8_weights),
        out_of_memory=None,
    )  # fmt: skip
    if fit_problem is not None:
        return dict(row, out_of_memory=f"building the model: {fit_problem}"), []
    try:
        runner = StepRunner(twin, prepare_model=lambda model: load_dequantized(model, fp8_weights))
    except Exception as err:  # noqa: BLE001 - only running out of memory becomes a row; anything else re-raises
        fp8_weights.clear()
        shutdown_distributed()
        if not is_out_of_memory(err):
            raise
        gc.collect()
        if is_cuda:
            torch.cuda.empty_cache()
        return dict(row, out_of_memory="building the model"), []
    all_records: list[dict] = []
    try:
        for step, batches in enumerate(step_batches):
            if not same_batches(batches, runner.micro_batches(step)):
                raise RuntimeError(f"--against {BASELINE}: the twin's micro-batches of step {step + 1} are not ours")
        def keep(index: int, record: dict) -> None:
            record = dict(record, impl=BASELINE)
            if on_step is not None:
                on_step(index, index < warmup, record)
            all_records.append(record)

        where = timed_baseline_steps(runner, len(step_batches), warmup, runner.is_cuda, keep)
        if where is not None:
            return dict(row, steps=max(len(all_records) - warmup, 0), out_of_memory=where), all_records
        peak = torch.cuda.max_memory_allocated() if runner.is_cuda else None
    finally:
        runner.close()
    return dict(row, **timed_steps(all_records, warmup, peak)), all_records


def _mfu(flops, step_time_s: float, peak_tflops: float) -> dict[str, Any]:
    """A step's model FLOPs (total and per part), the rate it reached and its share of the GEMM peak."""
    achieved = flops.total / step_time_s * 1e-12
    return dict(model_flops_per_step=flops.total, model_flops_parts=dict(flops.training), achieved_tflops=achieved,
                mfu=achieved / peak_tflops)  # fmt: skip


def sweep_lengths(
    profile: JobProfile,
    lengths: list[int],
    timed_length: int,
    timed_steps: int,
    on_line=print,
    on_result: Callable[[dict[str, Any]], None] = lambda result: None,
    rung_steps: int = 1,
) -> dict[str, Any]:
    """For one profile (its memory policy as set): median throughput and peak memory at `timed_length`, then each of
    `lengths` (ascending) for `rung_steps` steps, stopping at the first that runs out of memory: its tokens/s is the
    median of its steps after the first (the first's alone when it has one), its peak the rung's. peak_host_bytes is
    the process's peak resident host memory so far (the pinned pool of the memory policy included), so a rung's
    covers every earlier one.

    One model for the whole ladder: rows are re-packed, the model is not rebuilt. Peak memory needs CUDA.
    `on_result` gets the result so far after the timed steps and after each rung (a run stopped from outside keeps
    what it measured)."""
    from moe_tune.engine.bench.against import is_out_of_memory
    from moe_tune.engine.bench.machine import peak_host_memory

    runner = StepRunner(profile)
    result: dict[str, Any] = dict(memory_policy=str(profile.memory.preset), timed_length=timed_length, ladder=[])
    try:
        runner.set_seq_len(timed_length)
        records = []
        for index in range(WARMUP_STEPS + timed_steps):
            if index == WARMUP_STEPS:
                _reset_peak(runner)
            record = runner.step()
            if index >= WARMUP_STEPS:
                records.append(record)
        result["timed"] = dict(
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
            step_time_s=statistics.median(r["step_time_s"] for r in records),
            step_times_s=[r["step_time_s"] for r in records],
            losses=[r["loss"] for r in records],
            peak_memory_bytes=_peak(runner),
            peak_host_bytes=peak_host_memory(),
            memory=_median_metrics(records) if runner.activation_memory is not None else {},
        )
        on_line(f"{result['memory_policy']} @ {timed_length}: {result['timed']['tokens_per_s']:,.0f} tok/s, "
                f"peak {_gb_text(result['timed']['peak_memory_bytes'])}, "
                f"host {_gb_text(result['timed']['peak_host_bytes'])}")  # fmt: skip
        result["max_trained_length"] = None
        on_result(result)
        for seq_len in lengths:
            runner.set_seq_len(seq_len)
            _reset_peak(runner)
            try:
                rung = [runner.step() for _ in range(rung_steps)]
            except Exception as err:  # noqa: BLE001 - only out-of-memory ends the ladder; anything else re-raises
                if not is_out_of_memory(err):
                    raise
                result["ladder"].append(dict(seq_len=seq_len, outcome="out of memory"))
                on_line(f"{result['memory_policy']} @ {seq_len}: out of memory")
                on_result(result)
                break
            # The first step at a new length pays its kernels' first launches at that shape.
            timed = rung[1:] or rung
            record = timed[-1]
            step = dict(seq_len=seq_len, outcome="trained",
                        step_time_s=statistics.median(r["step_time_s"] for r in timed),
                        tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
                        step_times_s=[r["step_time_s"] for r in rung], losses=[r["loss"] for r in rung],
                        peak_memory_bytes=_peak(runner), peak_host_bytes=peak_host_memory(),
                        memory={k.removeprefix("memory_"): v for k, v in record.items()
                                if k.startswith("memory_")})  # fmt: skip
            result["ladder"].append(step)
            result["max_trained_length"] = seq_len
            on_line(f"{result['memory_policy']} @ {seq_len}: {step['step_time_s']:.2f} s, "
                    f"{step['tokens_per_s']:,.0f} tok/s, peak {_gb_text(step['peak_memory_bytes'])}, "
                    f"host {_gb_text(step['peak_host_bytes'])}")  # fmt: skip
            on_result(result)
    finally:
        runner.close()
    result.update(machine_info(runner.is_cuda))
    return result


def _reset_peak(runner: StepRunner) -> None:
    if runner.is_cuda:
        torch.cuda.reset_peak_memory_stats()


def _peak(runner: StepRunner) -> int | None:
    return torch.cuda.max_memory_allocated() if runner.is_cuda else None


def _gb_text(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.1f} GB"
