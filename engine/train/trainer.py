"""`moe-tune finetune`: build the model from the profile, wrap it in DeepSpeed ZeRO, train, save.

Outputs in profile.output.dir:
  profile.yaml             the resolved profile          deepspeed_config.json  the DeepSpeed config used
  metrics.jsonl            one record per step           tensorboard/           events (output.report_to)
  checkpoints/step-N/      atomic, resumable             adapter/               PEFT adapter (LoRA runs)
  adapter-transformers/    the adapter for transformers + PEFT on the checkpoint (runs from a checkpoint)
  model.safetensors        all weights (full fine-tune)  merged/                adapters merged, hub layout (save_merged)
  summary.json             losses, timings, paths
  loggers.json             W&B / MLflow run ids          wandb/, mlruns/        their local files (output.report_to)
Every export is consolidated into the single-process layout, whatever the expert-parallel layout of the run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import yaml

from moe_tune.engine.data.dataset import Batch, MicroBatchesAhead
from moe_tune.engine.parallel.context import ContextShard
from moe_tune.engine.parallel.expert_parallel import (
    ExpertLayout,
    create_expert_layout,
    gather_expert_tensor,
    is_expert_parameter,
)
from moe_tune.engine.train.expert_tags import tag_expert_parameters
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile, TrainProfile, ignored_setting_notes

from .checkpoint import (
    best_checkpoint,
    resume_checkpoint,
    run_signature,
    save_checkpoint,
    write_json_atomic,
    write_text_atomic,
)
from .distributed import (
    ContextLayout,
    DistInfo,
    any_rank,
    create_context_layout,
    init_distributed,
    shutdown_distributed,
)
from .ds_config import deepspeed_config, zero_stage_note
from .loggers import check_report_to
from .step_values import StepValues, launch_clock


@dataclass
class RunResult:
    output_dir: Path
    start_step: int
    last_step: int
    losses: list[float] = field(default_factory=list)
    checkpoint: Path | None = None
    adapter: Path | None = None
    # Checkpoint models: the adapter renamed for transformers + PEFT on the checkpoint, or why it could not be.
    transformers_adapter: Path | None = None
    transformers_adapter_problem: str | None = None
    # output.save_merged: the merged model in the hub's layout (out/merged), or why the model has none.
    merged: Path | None = None
    merged_problem: str | None = None
    weights: Path | None = None
    metrics: Path | None = None
    deepspeed_config: Path | None = None
    interrupted_by: str | None = None
    skipped_records: list[str] = field(default_factory=list)  # records left out (data.bad_images: skip), and why
    resume_notes: list[str] = field(default_factory=list)  # checkpoints skipped on --resume (and why), notes
    elapsed_s: float = 0.0
    is_main: bool = True
    # The run's optimizer steps: train.steps, or what train.epochs gives (run_steps).
    total_steps: int = 0
    epochs: int | None = None
    # Evaluation (eval data given): the last eval and the best so far (over the whole run, resumes included), and
    # the checkpoint with the lowest eval loss, which output.keep_last pruning keeps.
    eval_loss: float | None = None
    eval_step: int | None = None
    best_eval_loss: float | None = None
    best_eval_step: int | None = None
    best_checkpoint: Path | None = None
    eval_rows: int | None = None
    # A checkpoint model's base weights as the run trained on them (checkpoint folder and fingerprint of each weight
    # file, CheckpointReader.fingerprint; carried over --resume): export and generate merge the adapter into the
    # folder's weights only while they are these.
    base_checkpoint: dict | None = None

    def summary(self) -> dict[str, Any]:
        data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items() if k != "losses"}
        data["first_loss"] = self.losses[0] if self.losses else None
        data["final_loss"] = self.losses[-1] if self.losses else None
        data["eval_perplexity"] = perplexity(self.eval_loss) if self.eval_loss is not None else None
        return data


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def warmup_steps_of(train: TrainProfile, total_steps: int) -> int:
    """train.warmup_steps, or floor(train.warmup_ratio x the run's steps)."""
    return math.floor(train.warmup_ratio * total_steps) if train.warmup_ratio is not None else train.warmup_steps


def run_steps(train: TrainProfile, dataset, world_size: int) -> int:
    """The run's optimizer steps: train.steps, or for train.epochs the steps that cover every row of those epochs
    (a step takes micro_batch_size x gradient_accumulation_steps rows on each of `world_size` data-parallel ranks:
    under context parallelism the context groups; the last step may run into the next epoch). ProfileError when the
    warm-up does not fit."""
    if train.steps is not None:
        return train.steps
    rows = dataset.rows_in_epochs(train.epochs)
    rows_per_step = train.micro_batch_size * train.gradient_accumulation_steps * world_size
    total = math.ceil(rows / rows_per_step)
    warmup = warmup_steps_of(train, total)
    if warmup >= total:
        raise ProfileError([
            f"train.warmup_steps ({warmup}) must be < the {total} steps that train.epochs ({train.epochs}) gives "
            f"({rows} rows / {rows_per_step} rows a step: micro_batch_size {train.micro_batch_size} x "
            f"gradient_accumulation_steps {train.gradient_accumulation_steps} x {world_size} ranks)"
        ])  # fmt: skip
    return total


def lr_factor(step: int, train: TrainProfile, total_steps: int | None = None) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warm-up, then the schedule over
    `total_steps` (default train.steps; a train.epochs run passes run_steps)."""
    total = train.steps if total_steps is None else total_steps
    if total is None:
        raise ValueError("lr_factor: train.epochs sets no step count; pass total_steps (run_steps)")
    warmup = warmup_steps_of(train, total)
    if step < warmup:
        return (step + 1) / warmup
    if train.lr_schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    floor = train.min_lr_ratio
    if train.lr_schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def check_world(profile: JobProfile, world_size: int) -> None:
    """Checks of the profile against the machine: the layout must use the ranks there are."""
    problems = []
    # Expert and context groups are each consecutive ranks, independent of each other: tokens reach their experts
    # whichever rank of a row holds them.
    for name in ("expert_parallel", "context_parallel"):
        size = getattr(profile.parallel, name)
        if size > world_size:
            problems.append(f"parallel.{name} ({size}) must be <= the world size ({world_size})")
        elif world_size % size:
            problems.append(f"parallel.{name} ({size}) must divide the world size ({world_size})")
    if problems:
        raise ProfileError(problems)


def training_dtype(profile: JobProfile) -> torch.dtype:
    return torch.bfloat16 if profile.train.precision == "bf16" else torch.float32


def build_trainable_model(
    profile: JobProfile,
    layout: ExpertLayout | None = None,
    ds_config: dict | None = None,
    init_device: torch.device | None = None,
):
    """The model with LoRA injected (or all weights trainable), and its trainable parameters; routed experts are
    tagged for their expert-data-parallel group when spread over several ranks.

    `init_device` (a CUDA device, or None for the CPU): where the model is built and drawn, in the training dtype
    (ZeRO-3 checkpoint runs are built partitioned instead). `moe-tune profile` builds there (a 30B-80B model's init
    takes minutes on the CPU), finetune for checkpoint runs only; random-init runs draw on the CPU, so a run's
    export rebuilds the same initial weights anywhere.

    A model read from a checkpoint under ZeRO-3 (`ds_config` given) is built partitioned: no rank ever holds the
    whole model (see build_partitioned), and the weights stream in one tensor at a time."""
    from moe_tune.engine.lora import inject_lora
    from moe_tune.engine.lora.experts import GroupedExpertsLoRA
    from moe_tune.engine.memory import attach_activation_memory
    from moe_tune.engine.model.model import build_model

    cfg = profile.model
    if cfg.checkpoint is not None:
        from moe_tune.engine.families import load_checkpoint_weights

        if ds_config is not None and profile.parallel.zero_stage == 3:
            model = build_partitioned(cfg, ds_config, profile.memory.activation_checkpointing, layout)
        else:
            model = build_model(cfg, profile.memory.activation_checkpointing, layout, init_device,
                                training_dtype(profile) if init_device else None)
        # Each rank reads only its own experts; unread tensors can be reported only when one rank reads them all.
        load_checkpoint_weights(model, cfg, check_unread=layout is None or layout.expert_parallel == 1)
    else:
        model = build_model(cfg, profile.memory.activation_checkpointing, layout, init_device,
                            training_dtype(profile) if init_device else None)
    if not profile.lora.enabled:
        from moe_tune.engine.lora import freeze_vision_parts

        freeze_vision_parts(model, profile.lora)
    if profile.lora.enabled:
        model = inject_lora(model, profile.lora)
        if profile.parallel.zero_stage == 3:
            from deepspeed.utils import set_z3_leaf_modules

            # The expert LoRA layer reads its adapters' parameters directly: ZeRO-3 must gather them all at once.
            expert_adapters = [m for m in model.modules() if isinstance(m, GroupedExpertsLoRA)]
            if expert_adapters:
                set_z3_leaf_modules(model, [GroupedExpertsLoRA])
                for module in expert_adapters:
                    module.register_forward_pre_hook(_input_requiring_grad)
    if layout is not None and layout.expert_parallel > 1:
        tag_expert_parameters(model, layout)
    # After LoRA: the memory policy classifies the adapter layers too (engine/memory).
    attach_activation_memory(model, profile.memory)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, trainable


def _input_requiring_grad(module: torch.nn.Module, args: tuple) -> tuple | None:
    """A ZeRO-3 leaf module releases its gathered parameters after its backward only when an input of its forward
    requires grad (deepspeed 0.19.8 counts the gradients its inputs get): the first expert adapters of a model whose
    layers before them train nothing (lora.target_modules empty, or only after the first MoE block) would otherwise
    get their gradients against released parameters. Their input then becomes a leaf that requires grad."""
    x = args[0]
    if not torch.is_grad_enabled() or x.requires_grad:
        return None
    return (x.detach().requires_grad_(), *args[1:])


def build_partitioned(cfg, ds_config: dict, activation_checkpointing: bool, layout: ExpertLayout | None):
    """Our model constructed under deepspeed.zero.Init, so each dense module is partitioned over the ranks as soon
    as it is built, with no random init (the checkpoint overwrites every weight). Routed experts must not be
    partitioned over the whole world (ZeRO-3 would then train them wrong): each MoE layer's experts are rebuilt
    outside zero.Init, holding only this rank's E_local experts, and are tagged for their expert-data-parallel
    group later, like the experts of a model built in full."""
    import deepspeed

    from moe_tune.engine.model.model import MoECausalLM
    from moe_tune.engine.model.moe import GroupedExperts

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = MoECausalLM(cfg, activation_checkpointing, layout)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, GroupedExperts):
                setattr(module, child_name, child.rebuilt())
    return model


def _gathered_state(module: torch.nn.Module, only_trainable: bool, layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """Full tensors of the module's parameters on the CPU, under any ZeRO stage and expert layout: ZeRO partitions
    are gathered first, then each expert tensor [E_local, ...] is assembled into [E, ...] across the expert group.
    (deepspeed's zero_to_fp32 cannot consolidate this layout.) Every rank must call this."""
    import deepspeed

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad or not only_trainable]
    state = {}
    for name, param in named:
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            full = param.detach()
            if is_expert_parameter(param):
                full = gather_expert_tensor(full, layout)
            state[name] = full.to("cpu", copy=True).contiguous()
    return state


def export_weights(
    engine, profile: JobProfile, out: Path, is_main: bool, layout: ExpertLayout, result: RunResult,
    data_summary=None,
) -> tuple[Path | None, Path | None]:
    """Save the PEFT adapter (LoRA) or every weight as safetensors (full fine-tuning), consolidated into the
    single-process layout; for a checkpoint model also the adapter as transformers + PEFT load it on the
    checkpoint (result.transformers_adapter). Returns (adapter, weights)."""
    module = engine.module
    from moe_tune.engine.atomic_write import new_file_mode, save_tensors
    from moe_tune.engine.export.sources import ROUTING_BIASES_IN_NO_ADAPTER, SELECTION_BIASES_FILE

    from .model_card import write_model_card

    biases = trained_biases(module, profile)
    if profile.lora.enabled:
        state = _gathered_state(module, only_trainable=True, layout=layout)
        adapter_dir = out / "adapter"
        if is_main:
            module.save_pretrained(str(adapter_dir), state_dict=state, safe_serialization=True)
            os.chmod(adapter_dir / "adapter_model.safetensors", new_file_mode())  # PEFT's save_file creates 0o600
            if biases:
                save_tensors(biases, out / SELECTION_BIASES_FILE, metadata={"format": "pt"})
            # Over PEFT's generic card: what was trained on what (engine/train/model_card.py).
            write_model_card(adapter_dir, profile, result, data_summary)
            if profile.model.checkpoint is not None and biases:
                result.transformers_adapter_problem = ROUTING_BIASES_IN_NO_ADAPTER
            elif profile.model.checkpoint is not None:
                _export_for_transformers(module, state, profile, out, result)
        if profile.output.save_merged:
            full_state = _gathered_state(module, only_trainable=False, layout=layout)
            # Buffers (the experts' selection biases) are replicated, not sharded: take this rank's.
            persistent = set(module.state_dict(keep_vars=True))
            full_state.update({n: b.detach().cpu() for n, b in module.named_buffers() if n in persistent})
            if is_main:
                _export_merged(profile, _merged_state(profile, full_state), out / "merged", result)
        return adapter_dir, None

    state = _gathered_state(module, only_trainable=False, layout=layout) | biases
    path = out / "model.safetensors"
    if is_main:
        _save_atomic(state, path, profile)
    return None, path


def trained_biases(module, profile: JobProfile) -> dict[str, torch.Tensor]:
    """The MoE blocks' selection biases by our names, where model.moe.bias_update_rate trains them ({} otherwise):
    buffers, replicated on every rank, which neither the adapter nor the parameters hold."""
    from moe_tune.engine.export.sources import ADAPTER_PREFIX

    if profile.model.moe is None or profile.model.moe.bias_update_rate <= 0:
        return {}
    return {name.removeprefix(ADAPTER_PREFIX): buffer.detach().cpu().contiguous()
            for name, buffer in module.named_buffers() if name.endswith(".selection_bias")}  # fmt: skip


def _export_for_transformers(module, state: dict[str, torch.Tensor], profile: JobProfile, out: Path, result) -> None:
    """out/adapter-transformers: the adapter on the checkpoint's own module names (engine/families/export.py). A
    model whose adapted layers have no place in the checkpoint's model gets the reason instead, not a failed run."""
    from peft import get_peft_model_state_dict

    from moe_tune.engine.families import UnsupportedModel, family_for
    from moe_tune.engine.families.checkpoint import read_config
    from moe_tune.engine.families.export import write_reference_adapter

    cfg = profile.model
    saved = get_peft_model_state_dict(module, state_dict=state)
    try:
        family = family_for(read_config(cfg.checkpoint))
        result.transformers_adapter = write_reference_adapter(
            module.base_model.model, saved, cfg, family, profile.lora, out / "adapter-transformers"
        )
    except UnsupportedModel as err:
        result.transformers_adapter_problem = err.problems[0] + (
            f" (and {len(err.problems) - 1} more)" if len(err.problems) > 1 else ""
        )


def _save_atomic(state: dict[str, torch.Tensor], path: Path, profile: JobProfile) -> None:
    from moe_tune.engine.atomic_write import save_tensors

    tmp = path.with_name(f".{path.name}.tmp")
    save_tensors(state, tmp, metadata={"format": "pt", "moe_tune_profile": profile.name})
    tmp.replace(path)


def _export_merged(profile: JobProfile, merged, directory: Path, result) -> None:
    """out/merged: the merged weights (a state source, engine/export) as `moe-tune export --merge` writes them (the
    hub's layout), or the reason a model has no such layout (result.merged_problem), not a failed run."""
    import shutil

    from moe_tune.engine.export.hub import DEFAULT_SHARD_SIZE, export_hub, parse_size, run_chat_template
    from moe_tune.engine.families import UnsupportedModel

    if directory.exists():
        shutil.rmtree(directory)
    try:
        result.merged = export_hub(merged, profile.model, directory, parse_size(DEFAULT_SHARD_SIZE),
                                   profile.train.precision, run_chat_template(profile),
                                   tokenizer=profile.data.tokenizer)
    except (ProfileError, UnsupportedModel) as err:
        result.merged_problem = err.problems[0] + (f" (and {len(err.problems) - 1} more)" if len(err.problems) > 1 else "")


def _merged_state(profile: JobProfile, full_state: dict[str, torch.Tensor]):
    """The base model's weights with the adapters merged in, as a state source (engine/export): through PEFT's own
    merge on a single-process model; an FP8 base dequantized and merged per tensor in fp32 (engine/export/fp8.py)."""
    from moe_tune.engine.export.fp8 import is_fp8_base
    from moe_tune.engine.export.sources import DictSource, lora_scaling
    from moe_tune.engine.lora import inject_lora
    from moe_tune.engine.model.model import build_model

    if is_fp8_base(profile.model):
        from moe_tune.engine.export.zero import peft_state_source

        return peft_state_source(full_state, profile.model, lora_scaling(profile))
    model = inject_lora(build_model(profile.model), profile.lora)
    model.load_state_dict(full_state, strict=True)
    merged = model.merge_and_unload()
    return DictSource({name: t.contiguous() for name, t in merged.state_dict().items()})


def finetune(
    profile: JobProfile,
    resume: bool = False,
    show_progress: bool = True,
    stop_after: int | None = None,
    console=None,
    overwrite: bool = False,
) -> RunResult:
    """Train `profile` to train.steps (or to `stop_after` steps, checkpointing there), return what was written.
    `overwrite` replaces a previous run's outputs in output.dir, which is refused otherwise (run_dir.py)."""
    quiet_third_party_noise()
    from moe_tune.engine.families import resolve_job

    from .run_dir import claim_output_dir, run_reads

    profile = resolve_job(profile)  # model: {checkpoint: DIR} -> the architecture in DIR/config.json
    check_report_to(profile.output.report_to)
    # ZeRO-3's zero.Init replaces torch.nn.functional.linear for the rest of the process ("memory efficient
    # linear"): what runs after the run in this process gets torch's own back.
    functional_linear = torch.nn.functional.linear
    dist = init_distributed(profile.parallel.backend, profile.parallel.timeout_s)
    try:
        # Locked and checked before anything is read or written; released however the run ends.
        with claim_output_dir(profile.output.dir, dist, resume, overwrite, run_reads(profile)) as claim:
            if show_progress and dist.is_main:
                from rich.console import Console

                for note in claim.notes:
                    (console or Console()).print(note, markup=False, highlight=False)
            return _finetune(profile, dist, resume, show_progress, stop_after, console, claim)
    finally:
        torch.nn.functional.linear = functional_linear
        shutdown_distributed()


def quiet_third_party_noise() -> None:
    import logging
    import warnings

    # PEFT warns about every custom layer type; ours is registered on purpose.
    warnings.filterwarnings("ignore", message="Unsupported layer type", module="peft")
    # DeepSpeed 0.19.8 calls torch.distributed collectives that torch 2.13 deprecates.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _finetune(profile, dist: DistInfo, resume, show_progress, stop_after, console, claim) -> RunResult:
    run = _set_up(profile, dist, resume, stop_after)
    try:
        # Only now is a previous run that --overwrite replaces removed: a refusal before leaves it in place.
        claim.set_up()
        _train(run, show_progress, console)
        return _finish(run)
    finally:
        release_engine(run.engine)


def release_engine(engine) -> None:
    """Take the finished run's engine apart so the garbage collector can free it, its model and, through the
    model's parameters, the process groups with their gloo threads. ZeRO's gradient hooks sit on the parameters'
    C++ side, out of the collector's sight, and their closures hold the engine: without DeepSpeedEngine.destroy()
    (which removes them) the engine would live as long as the process."""
    destroy = getattr(engine, "destroy", None)
    if destroy is not None:
        destroy()


@dataclass
class TrainingRun:
    """What the set-up builds for the loop and the finish, and the RunResult they fill in."""

    profile: JobProfile
    dist: DistInfo
    engine: Any
    layout: ExpertLayout
    dataset: Any
    eval_data: Any  # None without eval data
    data_summary: Any
    # The run's optimizer steps (run_steps), and the step this invocation stops at (stop_after, or the last).
    total_steps: int
    end_step: int
    eval_every: int | None
    activation_memory: Any
    result: RunResult
    # The checkpoint --resume loaded; None for a fresh run.
    resumed_from: Path | None = None
    # The MoE blocks' CUDA graphs (train.cuda_graphs), or None.
    graphs: Any = None
    # The training micro-batches, each collated while the device runs the one before (MicroBatchesAhead).
    batches: Any = None

    @property
    def out(self) -> Path:
        return self.profile.output.dir

    @property
    def checkpoint_root(self) -> Path:
        return self.profile.output.dir / "checkpoints"


def _set_up(profile: JobProfile, dist: DistInfo, resume: bool, stop_after: int | None) -> TrainingRun:
    """Check the profile against the machine, read the tokenizer and the data, build the model inside DeepSpeed,
    load the checkpoint on --resume, write profile.yaml and deepspeed_config.json, capture the CUDA graphs.
    ProfileError for what cannot run here."""
    import deepspeed

    from moe_tune.engine.data.tokenizer import load_tokenizer
    from moe_tune.engine.memory import find_activation_memory

    from .graphs import check_cuda_graphs, maybe_graph_moe_blocks
    from .resources import check_memory_fits

    train, out = profile.train, profile.output.dir
    # Refused before anything is read or written.
    check_world(profile, dist.world_size)
    check_cuda_graphs(profile, dist.device.type, profile.parallel.expert_parallel)
    check_chunked_expert_adapters(profile)
    check_memory_fits(profile, dist.world_size, dist.device)
    torch.manual_seed(train.seed)
    tokenizer = load_tokenizer(profile.tokenizer)
    if tokenizer.vocab_size > profile.model.vocab_size:
        raise ProfileError(
            [f"model.vocab_size ({profile.model.vocab_size}) must be >= the tokenizer's ({tokenizer.vocab_size})"]
        )
    dataset, eval_data, data_summary, skipped = build_dataset(profile, tokenizer, out / "generated-data")

    context = create_context_layout(profile.parallel.context_parallel, dist.rank, dist.world_size,
                                    profile.parallel.timeout_s)  # fmt: skip
    # From here on the run reads its rows by context group (dist.data_rank, dist.data_size).
    dist = dataclasses.replace(dist, context=context)
    total_steps = run_steps(train, dataset, dist.data_size)
    eval_every = eval_interval(profile, eval_data)
    if eval_data is not None:
        check_eval_tokens(eval_data, train, dist.data_size)
    layout = create_expert_layout(profile.parallel.expert_parallel, dist.world_size)
    ds_config = deepspeed_config(profile, dist.world_size)
    # A checkpoint's weights overwrite the random init: its model is built where it trains, in the training dtype
    # (an 80B model's init on the CPU takes long; random-init runs draw on the CPU, so an export rebuilds them).
    on_gpu = profile.model.checkpoint is not None and dist.device.type == "cuda"
    model, _ = build_trainable_model(profile, layout, ds_config, dist.device if on_gpu else None)
    activation_memory = find_activation_memory(model)
    optimizer = build_optimizer(optimizer_groups(model, train.weight_decay), profile, dist.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train, total_steps))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
    )

    result = RunResult(output_dir=out, start_step=0, last_step=0, is_main=dist.is_main, skipped_records=skipped,
                       total_steps=total_steps, epochs=train.epochs)  # fmt: skip
    if eval_data is not None:
        result.eval_rows = eval_data.epoch_length(0)
    if profile.model.checkpoint is not None and dist.is_main:
        result.base_checkpoint = base_fingerprint(profile.model.checkpoint)
    run = TrainingRun(
        profile=profile, dist=dist, engine=engine, layout=layout, dataset=dataset, eval_data=eval_data,
        data_summary=data_summary, total_steps=total_steps,
        end_step=min(total_steps, stop_after) if stop_after is not None else total_steps,
        eval_every=eval_every, activation_memory=activation_memory, result=result,
    )  # fmt: skip
    run.batches = MicroBatchesAhead(dataset, train.micro_batch_size, dist.data_rank, dist.data_size,
                                    run.end_step * train.gradient_accumulation_steps)  # fmt: skip
    try:
        # A refused --resume leaves the run's settings as its checkpoints were trained with, and its summary.
        if resume:
            run.resumed_from = _resume(run)
            if result.start_step >= run.end_step:
                raise ProfileError([nothing_to_resume(result.start_step, run.end_step, total_steps)])
        if dist.is_main:
            _write_run_config(run, ds_config)
        # After loading: a graph replays the weights' addresses as captured.
        run.graphs = maybe_graph_moe_blocks(
            engine.module, profile, dist.device, layout.expert_parallel, train.micro_batch_size * profile.data.seq_len
        )
    except BaseException:
        # A run refused here (a checkpoint that does not load) has ended too.
        release_engine(engine)
        raise
    return run


def check_chunked_expert_adapters(profile: JobProfile) -> None:
    """ProfileError for expert adapters run in memory.sequence_chunk_tokens chunks under ZeRO-3: the expert adapter
    layer is a ZeRO-3 leaf module, whose gradients deepspeed 0.19.8 reduces at each of its runs, the same parameters
    twice in one bucket (it asserts at the first step)."""
    # A micro-batch's rows run as one packed row of micro_batch_size x seq_len tokens.
    chunk, row = profile.memory.sequence_chunk_tokens, profile.train.micro_batch_size * profile.data.seq_len
    lora = profile.lora
    experts = lora.enabled and lora.experts and any(layer.mlp == "moe" for layer in profile.model.layers)
    if chunk is not None and chunk < row and experts and profile.parallel.zero_stage == 3:
        raise ProfileError([
            f"memory.sequence_chunk_tokens ({chunk}) below a micro-batch's {row} tokens (train.micro_batch_size x "
            "data.seq_len) runs the expert adapters (lora.experts) once a chunk, whose gradients ZeRO-3 reduces at "
            "each run (deepspeed 0.19.8 refuses the parameters twice): use parallel.zero_stage 1 or 2 "
            "(bench-hybrid-1m does), or lora.experts false"])


def nothing_to_resume(start_step: int, end_step: int, total_steps: int) -> str:
    """The line refusing a --resume whose newest checkpoint is at or past the step the run would stop at."""
    if start_step == end_step == total_steps:
        return f"--resume: the newest checkpoint is already at the run's last step ({total_steps}); nothing to train"
    stop = "the run's last step" if end_step == total_steps else "the step to stop at"
    return f"--resume: the newest checkpoint is at step {start_step}, at or past {stop} ({end_step}); nothing to train"


def _write_run_config(run: TrainingRun, ds_config: dict) -> None:
    """out/deepspeed_config.json and out/profile.yaml (the resolved profile)."""
    run.out.mkdir(parents=True, exist_ok=True)
    run.result.deepspeed_config = run.out / "deepspeed_config.json"
    write_json_atomic(run.result.deepspeed_config, ds_config)
    write_text_atomic(run.out / "profile.yaml", yaml.safe_dump(resolved_profile_dump(run.profile), sort_keys=False))


def _resume(run: TrainingRun) -> Path:
    """Load the newest checkpoint that verifies (resume_checkpoint) with the RNG state, the selection biases and the
    evals it saved; the run starts at its step. Returns the checkpoint."""
    engine, dist, result = run.engine, run.dist, run.result
    signature = run_signature(run.profile, dist.world_size)
    bias_sizes = [block.selection_bias.numel() for block in _moe_blocks(engine)]
    resumed_from, state, result.resume_notes = resume_checkpoint(
        engine, run.checkpoint_root, signature, dist.device, bias_sizes
    )
    start_step = state["step"]
    if (changed := data_change_note(resumed_from, state.get("data"), run.data_summary.fingerprint, start_step)):
        result.resume_notes.append(changed)
    saved_base = state.get("base")
    if isinstance(saved_base, dict) and result.base_checkpoint is not None:
        from moe_tune.engine.families.checkpoint import changes_phrase, fingerprint_changes

        if changes := fingerprint_changes(saved_base.get("files"), result.base_checkpoint["files"]):
            result.resume_notes.append(
                f"note: model.checkpoint ({run.profile.model.checkpoint}) has changed since {resumed_from} was "
                f"trained ({changes_phrase(changes)}): the run goes on from the weights the checkpoint holds; export "
                "and generate of its final state refuse to merge into the folder's")
        result.base_checkpoint = saved_base
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    for block, bias in zip(_moe_blocks(engine), state.get("selection_bias", [])):
        block.selection_bias.copy_(torch.tensor(bias))
    _restore_eval_state(result, state, run.checkpoint_root)
    result.start_step = result.last_step = start_step
    apply_train_settings(engine, run.profile.train, start_step, run.total_steps)
    return resumed_from


class StopSignal:
    """SIGINT/SIGTERM ask the loop to checkpoint and exit after the current step; a second one does not wait for
    the step (KeyboardInterrupt, the step unsaved)."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None:
            self._restore()
            raise KeyboardInterrupt(f"{self.received}, then {name}")
        self.received = name

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc):
        self._restore()


def _train(run: TrainingRun, show_progress: bool, console) -> None:
    """Steps from the start step to run.end_step, one metrics record each; an eval every run.eval_every steps; a
    checkpoint every output.save_every steps, at run.end_step, and after the current step on SIGINT/SIGTERM.
    TrainingDiverged when a step leaves the loss, the gradient norm or a weight not finite, before it is saved."""
    from .loggers import open_trackers
    from .metrics import MetricsWriter, ProgressReporter

    profile, dist, result = run.profile, run.dist, run.result
    start_step = result.start_step
    result.metrics = run.out / "metrics.jsonl"
    writer = MetricsWriter(result.metrics, start_step, open_trackers(profile, start_step)) if dist.is_main else None
    is_shown = show_progress and dist.is_main
    reporter = ProgressReporter(run.total_steps, start_step, profile.train.log_every, is_shown, console)
    started = time.perf_counter()
    watched = watched_weights(run.engine.module)

    def finish(launched: LaunchedStep) -> bool:
        """Step `launched`'s record: written, checked, reported; whether the run stops after it."""
        values = launched.values.read()
        record = _step_record(run, launched, values, launched.values.seconds())
        if writer is not None:
            writer.write(record)
        # A resumed run that has not saved yet still has the checkpoint it resumed from.
        intact = result.checkpoint or run.resumed_from
        if launched.step == start_step and run.resumed_from is None and _not_finite(record):
            check_start_weights(run.engine.module, profile, dist)
        check_finite(record, intact)
        raise_if_nonfinite_weight(launched.step + 1, int(values["first_bad_weight"]), watched, intact)
        result.losses.append(record["loss"])
        result.last_step = launched.step + 1
        reporter.update(record)
        # Several ranks stop on their vote, taken as the step was queued, so that every rank stops after the same
        # step; one rank reads its own flag.
        return values["stop_votes"] > 0 if dist.world_size > 1 else stop.received is not None

    # Closed however the loop ends (a diverged step raises): the metrics of every finished step are on disk.
    try:
        with StopSignal() as stop, reporter:
            for line in _start_lines(run, writer):
                reporter.print(line)
            in_flight: LaunchedStep | None = None
            for step in range(start_step, run.end_step):
                behind = in_flight.values if in_flight is not None else None
                launched = launch_step(run, step, watched, stop.received is not None, behind)
                if in_flight is not None and finish(in_flight):
                    # The step queued behind the stopping one finishes and is saved with it.
                    finish(launched)
                    _evaluate_and_save(run, step + 1, True, writer, reporter)
                    result.interrupted_by = stop.received or "signal on another rank"
                    break
                in_flight = launched
                if _queues_the_next_step(run, step, dist, stop):
                    continue
                in_flight = None
                is_stopping = finish(launched)
                _evaluate_and_save(run, step + 1, is_stopping, writer, reporter)
                if is_stopping:
                    result.interrupted_by = stop.received or "signal on another rank"
                    break
    finally:
        if writer is not None:
            is_finished = result.last_step == run.end_step
            writer.close("interrupted" if result.interrupted_by else "finished" if is_finished else "failed")
    result.elapsed_s = time.perf_counter() - started


def _queues_the_next_step(run: TrainingRun, step: int, dist: DistInfo, stop: StopSignal) -> bool:
    """Whether step `step + 1` (0-based) is queued before step `step`'s values are read: not after the run's first
    step (check_start_weights looks at the weights it left), before an eval, a checkpoint or the run's end, or once
    this process was signalled (one rank: several ranks vote on it a step later)."""
    done = step + 1
    if step == run.result.start_step or done == run.end_step or _evaluates_after(run, done) or _saves_after(run, done):
        return False
    return dist.world_size > 1 or stop.received is None


def _start_lines(run: TrainingRun, writer) -> Iterator[str]:
    """The lines printed before the first step: the resume and its notes, records skipped, settings that do nothing
    in this run, the CUDA graphs, the start banner."""
    from .banner import start_banner

    profile, dist, result = run.profile, run.dist, run.result
    if run.resumed_from is not None:
        yield from result.resume_notes + (writer.notes if writer is not None else [])
        yield f"resumed from {run.resumed_from} at step {result.start_step}"
    if skipped := result.skipped_records:
        yield f"skipped {len(skipped)} records with bad images (data.bad_images: skip); first: {skipped[0]}"
    if note := zero_stage_note(profile, dist.world_size, dist.device.type):
        yield note
    if run.graphs is not None and dist.is_main:
        yield run.graphs.note()
    yield from eval_notes(profile, run.eval_data)
    yield from ignored_setting_notes(profile)
    trackers = [t.where for t in writer.trackers] if writer is not None else ()
    yield from start_banner(profile, run.out, dist.device, dist.world_size, run.total_steps, result.start_step,
                            run.data_summary, len(run.dataset.documents), profile.train.epochs, result.eval_rows,
                            trackers)  # fmt: skip


def ensure_training(engine) -> None:
    """engine.train() unless the engine's model is in training mode since an earlier call here. The switch writes an
    attribute of every module (571 in bench-qwen3-next: 6 ms of a step's 86 ms of host time under cProfile on the
    H200's host, at the start of the step while the device waits for its first work); eval() on the whole model
    (evaluate, document losses) is seen on its root and switches back."""
    if getattr(engine, _TRAIN_MODE_SET, False) and engine.module.training:
        return
    engine.train()
    setattr(engine, _TRAIN_MODE_SET, True)


# Set on an engine once ensure_training has put its whole model in training mode.
_TRAIN_MODE_SET = "_moe_tune_train_mode_set"


@dataclass
class LaunchedStep:
    """An optimizer step whose work is queued: its host-side counts and its device values on their way to the host
    (StepValues: loss, aux_loss, grad_norm, the MoE layers' loads, first_bad_weight; stop_votes, and the token counts
    summed over the ranks where several run)."""

    step: int
    tokens: int
    processed: int
    values: StepValues
    memory_metrics: dict | None


def launch_step(run, step: int, watched: list, is_signalled: bool, behind: StepValues | None,
                on_share: Callable[[Batch], None] | None = None) -> LaunchedStep:  # fmt: skip
    """Queue optimizer step `step` (0-based): its micro-batches forward and backward, the optimizer's step, the
    selection biases updated, and the copy of its values to the host; nothing here waits for the device.
    run: a TrainingRun, or what else holds its engine, dist, dataset, profile, batches and activation_memory (the
    benchmark's StepRunner, which times this very step). watched: watched_weights. is_signalled: this process received
    a stop signal (the ranks' vote, several ranks). behind: the values of the step still unread, which this one is
    queued behind. on_share(share) sees each micro-batch's share of this rank."""
    from .metrics import processed_tokens

    engine, dist, dataset, train = run.engine, run.dist, run.dataset, run.profile.train
    started = launch_clock(dist.device, behind)
    ensure_training(engine)
    lm_losses, aux_losses, tokens, processed = [], [], 0, 0
    accumulation = train.gradient_accumulation_steps
    # A row's ranks hold one row: its first rank counts its labels. One process's one micro-batch takes its own mean.
    counts_rows = dist.context is None or dist.context.rank == 0
    denominator = None
    if dist.world_size > 1 or accumulation > 1:
        step_tokens = run.batches.label_tokens(step * accumulation, accumulation) if counts_rows else 0
        denominator = loss_denominator(step_tokens, accumulation, dist)
    for micro in range(accumulation):
        index = step * accumulation + micro
        batch = run.batches.get(index)
        share = share_of_batch(batch, dist.context)
        if on_share is not None:
            on_share(share)
        output = micro_step(engine, share, dist, denominator)
        # The next micro-batch is collated on the host while the device runs this one.
        run.batches.prepare(index + 1)
        lm_losses.append(output.lm_loss.detach().float())
        aux_losses.append(output.aux_loss.detach().float())
        tokens += share.num_label_tokens
        if counts_rows:
            processed += processed_tokens(batch, dataset.seq_len, dataset.pad_id)
    moe_loads = update_moe_bias(engine, dist)
    values: dict[str, torch.Tensor | float] = {
        "loss": torch.stack(lm_losses).mean(),
        "aux_loss": torch.stack(aux_losses).mean(),
    }
    if dist.world_size > 1:
        counts = host_values([tokens, processed, float(is_signalled)], values["loss"].device)
        stats = torch.cat([torch.stack([values["loss"], values["aux_loss"]]), counts])
        torch.distributed.all_reduce(stats)
        values.update(loss=stats[0] / dist.world_size, aux_loss=stats[1] / dist.world_size, counts=stats[2:4],
                      stop_votes=stats[4])  # fmt: skip
    grad_norm = engine.get_global_grad_norm()
    values["grad_norm"] = math.nan if grad_norm is None else grad_norm
    values["has_grad_norm"] = float(grad_norm is not None)
    if moe_loads is not None:
        values["moe_loads"] = moe_loads
    values["first_bad_weight"] = first_nonfinite_weight(watched, dist)
    memory = run.activation_memory.step_metrics() if run.activation_memory is not None else None
    return LaunchedStep(step, tokens, processed, StepValues(values, started), memory)


# Parameter names that take no weight decay, as transformers' Trainer.get_decay_parameter_names (5.25) matches them
# (lower-cased full names): biases and normalisation weights.
NO_DECAY_NAME_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
# The key of an optimizer parameter group that says whether the group takes train.weight_decay (optimizer_groups).
DECAYS_KEY = "moe_tune_decays"


def is_decayed(name: str, module: torch.nn.Module) -> bool:
    """Whether parameter `name` (its full name) of `module` (the module holding it) takes weight decay: not a bias
    nor a normalisation weight, by transformers' Trainer rule (NO_DECAY_NAME_PATTERNS, or a LayerNorm's parameter),
    with our RMSNorm counted as a normalisation layer whatever its name."""
    from moe_tune.engine.model.blocks import RMSNorm

    if isinstance(module, (torch.nn.LayerNorm, RMSNorm)):
        return False
    return not any(re.search(pattern, name.lower()) for pattern in NO_DECAY_NAME_PATTERNS)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups of the model's trainable parameters: `weight_decay` on those is_decayed picks, none
    on biases and normalisation weights, as transformers' Trainer (and so Trainer + PEFT) groups them. The groups
    depend on the model alone, not on `weight_decay`, so that a run resumed with another train.weight_decay loads its
    checkpoint's optimizer state; each carries DECAYS_KEY (apply_train_settings reads it). A group left empty (a LoRA
    run trains neither biases nor norms) is left out."""
    decayed, spared, seen = [], [], set()
    for module_name, module in model.named_modules():
        for short_name, param in module.named_parameters(recurse=False):
            # A tied weight (one parameter held by two modules) joins one group once.
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{short_name}" if module_name else short_name
            (decayed if is_decayed(name, module) else spared).append(param)
    groups = [{"params": decayed, "weight_decay": weight_decay, DECAYS_KEY: True},
              {"params": spared, "weight_decay": 0.0, DECAYS_KEY: False}]  # fmt: skip
    return [group for group in groups if group["params"]]


def apply_train_settings(engine, train: TrainProfile, step: int, total_steps: int) -> None:
    """Put the profile's lr, betas and weight decay on the optimizer, and the lr of optimizer step `step` (0-based),
    after --resume: DeepSpeed loads the checkpoint's parameter groups (their lr, betas, weight decay) and the lr
    scheduler's base lr with the optimizer state, while train settings may change on resume (a note names each) and
    the run trains with, and logs, the profile's."""
    scheduler = engine.lr_scheduler
    for group in scheduler.optimizer.param_groups:
        group["betas"] = tuple(train.betas)
        # A group without DECAYS_KEY (a checkpoint's optimizer of one group over all trainable parameters) decays.
        group["weight_decay"] = train.weight_decay if group.get(DECAYS_KEY, True) else 0.0
        group["initial_lr"] = train.lr
        group["lr"] = train.lr * lr_factor(step, train, total_steps)
    scheduler.base_lrs = [train.lr] * len(scheduler.optimizer.param_groups)


def build_optimizer(trainable: list, profile: JobProfile, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (or their groups, optimizer_groups), the profile's lr, betas and weight
    decay (a group's own weight decay where it sets one). Training on CUDA with the optimizer state there, torch's
    fused kernel: one pass over DeepSpeed's flat fp32 partition, which torch's single-tensor form passes over eight
    times (mul_, lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_). On the CPU and with the state in host memory
    (parallel.offload_optimizer), the single-tensor form."""
    train = profile.train
    fused = device.type == "cuda" and not profile.parallel.offload_optimizer
    return torch.optim.AdamW(trainable, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay,
                             foreach=None if fused else False, fused=fused or None)  # fmt: skip


def host_values(numbers: list[float], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Host numbers as a tensor on `device` (float32 by default), copied from page-locked memory without waiting (a
    copy from pageable memory waits for the device's queued work)."""
    host = torch.tensor(numbers, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _step_record(run: TrainingRun, launched: LaunchedStep, values: dict, step_time: float) -> dict:
    """The metrics record of a finished step from its read values. ProfileError when no row of the step holds a
    token to train on."""
    dist, dataset, train = run.dist, run.dataset, run.profile.train
    step = launched.step
    tokens, processed = launched.tokens, launched.processed
    if dist.world_size > 1:
        tokens, processed = (int(round(count)) for count in values["counts"])
    if tokens == 0:
        raise ProfileError([untrained_step_message(step + 1, run.profile, dist.data_size)])
    expert_load, dropped_slots = moe_load_stats(values.get("moe_loads", []))
    rows_per_step = train.micro_batch_size * train.gradient_accumulation_steps * dist.data_size
    record = {
        "step": step + 1,
        "loss": values["loss"],
        "aux_loss": values["aux_loss"],
        "lr": train.lr * lr_factor(step, train, run.total_steps),
        "grad_norm": values["grad_norm"] if values["has_grad_norm"] else None,
        "tokens": tokens,
        "tokens_per_s": tokens / step_time,
        # Every token of the step's rows (all ranks) the model ran through, padding excluded.
        "processed_tokens": processed,
        "processed_tokens_per_s": processed / step_time,
        "step_time_s": step_time,
        "expert_load_max_over_mean": expert_load,
        "dropped_token_slots": dropped_slots,
        # Epochs of training rows done after this step (1.5: half-way through the second).
        "epoch": round(dataset.epoch_progress((step + 1) * rows_per_step), 6),
    }
    if launched.memory_metrics is not None:
        record.update(launched.memory_metrics)
    return record


def _evaluate_and_save(run: TrainingRun, step: int, is_stopping: bool, writer, reporter) -> None:
    """After step `step` (1-based): an eval every run.eval_every steps and at the run's last step, unless stopping; a
    checkpoint every output.save_every steps, at run.end_step and when stopping (the best one noted after an eval)."""
    profile, dist, result = run.profile, run.dist, run.result
    step_eval = None
    if not is_stopping and _evaluates_after(run, step):
        step_eval = _run_eval(run.engine, run.eval_data, profile.train, dist, step, result, writer, reporter)
    if is_stopping or _saves_after(run, step):
        result.checkpoint = _save(run.engine, profile, run.checkpoint_root, step, dist, step_eval, result,
                                  run.data_summary.fingerprint)  # fmt: skip
        if step_eval is not None and dist.is_main:
            best = best_checkpoint(run.checkpoint_root, step)
            result.best_checkpoint = best[0] if best is not None else None


def _evaluates_after(run: TrainingRun, step: int) -> bool:
    """Whether an eval runs after step `step` (1-based): every run.eval_every steps and at the run's last step."""
    return run.eval_every is not None and (step % run.eval_every == 0 or step == run.total_steps)


def _saves_after(run: TrainingRun, step: int) -> bool:
    """Whether a checkpoint is written after step `step` (1-based): every output.save_every steps and at run.end_step
    (a stop signal adds one)."""
    return step == run.end_step or step % run.profile.output.save_every == 0


def _finish(run: TrainingRun) -> RunResult:
    """A run that reached its last step or was interrupted exports its adapter or weights; summary.json is written
    either way."""
    result, dist = run.result, run.dist
    if result.last_step == run.total_steps or result.interrupted_by:
        result.adapter, result.weights = export_weights(run.engine, run.profile, run.out, dist.is_main, run.layout,
                                                        result, run.data_summary)  # fmt: skip
    if dist.is_main:
        write_json_atomic(run.out / "summary.json", result.summary())
    return result


def resolved_profile_dump(profile: JobProfile) -> dict:
    """The profile as the run uses it, for profile.yaml: its paths absolute (export, generate and --resume find the
    same files from any folder), a data.chat_template .jinja file replaced by its text, so that export and generate
    render prompts as training did, whatever becomes of the file."""
    from moe_tune.engine.data.chat import chat_options
    from moe_tune.profiles.schema import dump_with_absolute_paths, is_chat_template_path

    dumped = dump_with_absolute_paths(profile)
    if profile.data.chat_template is not None and is_chat_template_path(profile.data.chat_template):
        dumped["data"]["chat_template"] = chat_options(profile.data).template
    return dumped


def untrained_step_message(step: int, profile: JobProfile, world_size: int) -> str:
    """Why a step whose rows hold no trained token (every label masked) stops the run: its loss is 0 / 0.
    `world_size`: the data-parallel ranks (context groups under context parallelism)."""
    train, data = profile.train, profile.data
    rows = train.micro_batch_size * train.gradient_accumulation_steps * world_size
    first = (step - 1) * rows
    return (f"step {step}: none of its {rows} rows (rows {first}..{first + rows - 1} of the packed data, "
            f"data.seq_len {data.seq_len}) holds a token to train on: records without assistant tokens, or prompts "
            "cut into rows of data.seq_len, leave every label there masked; drop such records, or raise data.seq_len "
            f"or train.micro_batch_size (step {step} is not saved)")


class TrainingDiverged(RuntimeError):
    """A step's loss, gradient norm or updated weights are not finite: training stops before that step is
    checkpointed."""


def _not_finite(record: dict) -> list[str]:
    """`key value` of the step's loss and gradient norm (a metrics record) where inf or NaN."""
    return [f"{key} {record[key]}" for key in ("loss", "grad_norm")
            if record.get(key) is not None and not math.isfinite(record[key])]  # fmt: skip


def check_start_weights(module: torch.nn.Module, profile: JobProfile, dist: DistInfo) -> None:
    """ProfileError naming a frozen floating weight that is inf or NaN (this rank's ZeRO-3 partition of it): asked
    when a fresh run's first step is not finite, so that a damaged checkpoint is named as such rather than train.lr.
    Trained weights are not looked at: the step's update has changed them already."""
    bad = None
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.requires_grad:
                continue
            data = getattr(param, "ds_tensor", None)
            data = param.data if data is None else data
            if data.is_floating_point() and data.numel() and not bool(torch.isfinite(data).all()):
                bad = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
                break
    if not any_rank(bad is not None, dist.device):
        return
    checkpoint = profile.model.checkpoint
    where = f"model.checkpoint ({str(checkpoint)!r})" if checkpoint is not None else "the initial weights"
    raise ProfileError([f"{where}: weight {bad or '(on another rank)'} holds NaN or inf values before the first step: "
                        "training stopped, nothing saved"])  # fmt: skip


def check_finite(record: dict, last_checkpoint: Path | None) -> None:
    """Raise TrainingDiverged when the step's loss or gradient norm (a metrics record) is inf or NaN.

    bf16 runs without DeepSpeed's per-gradient overflow check (ds_config.py), so nothing skips such a step: its
    update is already applied, and stopping here keeps it out of every checkpoint."""
    bad = _not_finite(record)
    if bad:
        raise TrainingDiverged(
            f"step {record['step']}: {' and '.join(bad)} not finite: training stopped before saving it "
            f"({_kept(last_checkpoint)}); lower train.lr or set train.grad_clip"
        )


def _kept(last_checkpoint: Path | None) -> str:
    return f"the last checkpoint, {last_checkpoint}, is intact" if last_checkpoint else "no checkpoint was written"


def watched_weights(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, int]]:
    """The trainable parameters with the number of elements this rank updates: under ZeRO-3 the valid head of its
    partition `ds_tensor` (the tail is uninitialised padding), else the whole tensor."""
    watched = []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        part = getattr(param, "ds_tensor", None)
        if part is None:
            watched.append((name, param, param.numel()))
            continue
        size = part.numel()
        rank = torch.distributed.get_rank(group=param.ds_process_group) if torch.distributed.is_initialized() else 0
        watched.append((name, param, max(0, min(size, param.ds_numel - rank * size))))
    return watched


def check_finite_weights(step: int, watched: list, dist: DistInfo, last_checkpoint: Path | None) -> None:
    """Raise TrainingDiverged naming the first trainable parameter the step left inf or NaN (lr=inf does so with a
    finite loss and gradient norm): first_nonfinite_weight read at once."""
    raise_if_nonfinite_weight(step, int(first_nonfinite_weight(watched, dist).item()), watched, last_checkpoint)


def first_nonfinite_weight(watched: list, dist: DistInfo) -> torch.Tensor:
    """The index in `watched` of the first trainable parameter that is inf or NaN somewhere, len(watched) if none, as
    a device scalar (not read). Each rank reads only what it updates (watched_weights), without gathering: one fused
    max-abs reduction and, with several ranks, one all-reduce of the first bad index."""
    tensors, positions = [], []
    for index, (_, param, valid) in enumerate(watched):
        if valid:
            part = getattr(param, "ds_tensor", None)
            tensors.append(param.detach() if part is None else part.narrow(0, 0, valid))
            positions.append(index)
    first = torch.full((), len(watched), dtype=torch.long, device=dist.device)
    if tensors:
        with torch.no_grad():
            # inf-norm: inf or NaN exactly when an element is; an L2 norm would overflow on large finite weights.
            bad = ~torch.isfinite(torch.stack(torch._foreach_norm(tensors, float("inf"))).float())
            at = host_values(positions, bad.device).long()
            first = torch.where(bad, at, len(watched)).min().to(dist.device)
    if dist.world_size > 1:
        torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
    return first


def raise_if_nonfinite_weight(step: int, index: int, watched: list, last_checkpoint: Path | None) -> None:
    """TrainingDiverged naming watched[index] (first_nonfinite_weight's result) unless it is len(watched)."""
    if index < len(watched):
        raise TrainingDiverged(
            f"step {step}: parameter {watched[index][0]} is not finite after the optimizer step (loss and "
            f"gradient norm were): training stopped before saving it ({_kept(last_checkpoint)}); lower train.lr"
        )


def _moe_blocks(engine) -> list:
    """The model's MoE blocks, found once per engine (walking every module each step costs host time)."""
    from .graphs import moe_blocks

    blocks = getattr(engine, "_moe_tune_moe_blocks", None)
    if blocks is None:
        blocks = moe_blocks(engine.module)
        engine._moe_tune_moe_blocks = blocks
    return blocks


def build_dataset(profile: JobProfile, tokenizer, generated_dir: Path):
    """(train, eval, summary, skipped): the profile's packed training rows (shuffled per epoch; images included for
    models with a vision tower; the built-in shapes corpus written under `generated_dir`), the held-out eval rows
    packed once in their order (None without eval data), the data summary, and the records left out for bad
    images."""
    from moe_tune.engine.data import dataset as data

    vision = data.vision_input(profile.model, profile.data)
    skipped: list[str] = []
    splits = data.load_splits(profile.data, tokenizer, vision, skipped, generated_dir=generated_dir)
    settings = vision.settings if vision is not None else None
    seq_len, pad, seed = profile.data.seq_len, tokenizer.pad_id, profile.data.seed
    train = data.PackedDataset(splits.train, seq_len, pad, seed, settings)
    held_out = data.PackedDataset(splits.eval, seq_len, pad, seed, settings, shuffle=False) if splits.eval else None
    return train, held_out, splits.summary, skipped


def micro_step(engine, batch, dist: DistInfo, denominator: float | torch.Tensor | None):
    """Forward, backward and DeepSpeed's step on one micro-batch (the optimizer steps at the accumulation
    boundary), its summed cross-entropy divided by `denominator` (loss_denominator); returns the model's output.
    Under context parallelism `batch` is this rank's share of the row (share_of_batch)."""
    out = engine(**batch.model_inputs(dist.device), loss_denominator=denominator)
    engine.backward(out.loss)
    engine.step()
    return out


@dataclass
class RowShare(Batch):
    """A rank's share of a micro-batch's packed row under context parallelism: the fields hold its tokens, labels and
    document pieces, `context` where they sit in the row; the model takes both (model_inputs)."""

    context: ContextShard | None = None

    def model_inputs(self, device) -> dict:
        return {**super().model_inputs(device), "context": self.context}


def share_of_batch(batch: Batch, context: ContextLayout | None) -> Batch:
    """This rank's share of the micro-batch's packed row: under context parallelism the tokens [r T / N, (r + 1) T / N)
    of the row with their labels and document pieces (a RowShare); else the batch itself. Labels go with their
    tokens: each rank's loss sums the cross-entropy of the labels it holds."""
    shard = context.shard(batch.cu_seqlens) if context is not None else None
    if shard is None:
        return batch
    # The schema refuses models with a vision tower under context parallelism.
    assert batch.pixel_values is None, "a row with images cannot be shared by context-parallel ranks"
    return RowShare(input_ids=shard.local(batch.input_ids), labels=shard.local(batch.labels),
                    cu_seqlens=shard.local_cu_seqlens(), context=shard)  # fmt: skip


def evaluate(engine, eval_data, train: TrainProfile, dist: DistInfo) -> tuple[float, int, int]:
    """(mean next-token cross-entropy over every labelled eval token, those tokens, micro-batches run): the eval
    rows split over the ranks as training rows are, the first train.eval_batches micro-batches (all by default).
    Every rank runs the same micro-batches (empty rows past the end of the eval set), so the collectives of ZeRO-3
    and of expert parallelism match; the summed losses and token counts are reduced exactly over the ranks. Eval
    mode (no dropout, no expert loads counted, no aux loss) and no gradients; the training mode is restored."""
    rows = train.micro_batch_size
    num_batches = math.ceil(eval_data.epoch_length(0) / (rows * dist.data_size))
    if train.eval_batches is not None:
        num_batches = min(num_batches, train.eval_batches)
    total = torch.zeros(2, dtype=torch.float64, device=dist.device)  # [summed loss, labelled tokens]
    was_training = engine.module.training
    engine.eval()
    try:
        with torch.no_grad():
            for index in range(num_batches):
                batch = share_of_batch(eval_data.eval_micro_batch(index, rows, dist.data_rank, dist.data_size),
                                       dist.context)  # fmt: skip
                # A sum over this rank's labelled tokens (divided by 1); the logits stay chunked (return_logits).
                out = engine(**batch.model_inputs(dist.device), loss_denominator=1.0, return_logits=False)
                total[0] += out.lm_loss.double()
                total[1] += batch.num_label_tokens
    finally:
        engine.train(was_training)
    if dist.world_size > 1:
        torch.distributed.all_reduce(total)
    summed, tokens = total.tolist()
    return (summed / tokens if tokens else math.nan), int(tokens), num_batches


def loss_denominator(step_label_tokens: int, accumulation: int, dist: DistInfo) -> float | torch.Tensor | None:
    """What each micro-batch's summed cross-entropy is divided by, so that the step's gradient is that of the mean
    loss over every labelled token of the step (all its micro-batches on all ranks, as one large batch gives it):
    the step's labelled tokens over the world / (world size x accumulation), as DeepSpeed divides each micro-batch's
    loss by the accumulation steps and averages the ranks' gradients. A micro-batch or a rank holding fewer tokens
    weighs less; one holding none adds nothing. `step_label_tokens`: those this rank counts (under context
    parallelism the row's first rank alone), so the sum over the world counts each once. Several ranks: a float64
    device scalar, never read on the host (the step does not wait for the all-reduce); one process: a number, None
    when there is one micro-batch (the model's own mean)."""
    if dist.world_size == 1:
        return None if accumulation == 1 else max(step_label_tokens, 1) / accumulation
    count = host_values([float(step_label_tokens)], dist.device, torch.float64)
    torch.distributed.all_reduce(count)
    return count[0].clamp(min=1.0) / (dist.world_size * accumulation)


def update_moe_bias(engine, dist: DistInfo) -> torch.Tensor | None:
    """Reduce the step's expert loads (and capacity drops) over all ranks, update the selection biases; return per
    layer (mean load, max load, token-slots dropped for capacity) [L, 3] on the device (moe_load_stats reads them),
    None without MoE layers.

    All layers at once (their loads stacked, one all-reduce, foreach updates): a handful of launches at the step's
    end instead of about ten per layer; the same values as each layer's `MoEBlock.update_selection_bias`
    (tests/engine/test_train.py)."""
    blocks = _moe_blocks(engine)
    if not blocks:
        return None
    loads = [block.load_counts for block in blocks]
    dropped = [block.dropped_slots for block in blocks]
    with torch.no_grad():
        counts_LE = torch.stack(loads)
        dropped_L = torch.stack(dropped).to(counts_LE.dtype)
        if dist.world_size > 1:
            stats = torch.cat([counts_LE, dropped_L[:, None]], dim=1)
            torch.distributed.all_reduce(stats)
            counts_LE, dropped_L = stats[:, :-1], stats[:, -1]
        mean_L = counts_LE.mean(dim=1)
        # Every MoE layer takes the profile's one `model.moe`, so one rate.
        rate = blocks[0].spec.bias_update_rate
        if rate > 0:
            # MoEBlock.update_selection_bias for every layer: bias += rate * sign(mean - counts), the product
            # rounded to the counts' dtype as there.
            step_LE = torch.sign(mean_L[:, None] - counts_LE).mul_(rate)
            torch._foreach_add_([block.selection_bias for block in blocks], list(step_LE.unbind(0)))
        values_L3 = torch.stack([mean_L, counts_LE.amax(dim=1), dropped_L], dim=1)
        torch._foreach_zero_(loads + dropped)
    return values_L3


def moe_load_stats(rows: list[list[float]]) -> tuple[list[float], int]:
    """update_moe_bias's rows, read: max/mean load per layer (0 for a layer that counted no load) and the token-slots
    dropped in all layers."""
    imbalance = [round(peak / mean, 4) if mean > 0 else 0.0 for mean, peak, _ in rows]
    return imbalance, int(sum(dropped for _, _, dropped in rows))


def eval_interval(profile: JobProfile, eval_data) -> int | None:
    """Steps between evaluations: train.eval_every, by default output.save_every; None without eval data."""
    if eval_data is None:
        return None
    return profile.train.eval_every or profile.output.save_every


def eval_notes(profile: JobProfile, eval_data) -> list[str]:
    """Eval settings that do nothing in this run, and checkpoints that cannot be the best one, one line each."""
    train, notes = profile.train, []
    if eval_data is None:
        for name in ("eval_every", "eval_batches"):
            if getattr(train, name) is not None:
                notes.append(f"note: train.{name} ({getattr(train, name)}) is ignored: there is no eval data "
                             "(data.eval_path or data.eval_fraction)")
    elif train.eval_every is not None and profile.output.save_every % train.eval_every:
        notes.append(f"note: train.eval_every ({train.eval_every}) does not divide output.save_every "
                     f"({profile.output.save_every}): checkpoints at steps without an eval cannot be kept as the best")
    return notes


def check_eval_tokens(eval_data, train: TrainProfile, world_size: int) -> None:
    """ProfileError when the eval rows an evaluation reads hold no labelled token (its loss would be 0 / 0)."""
    rows = eval_data.rows_of_epoch(0)
    per_batch = train.micro_batch_size * world_size
    read = rows if train.eval_batches is None else rows[: train.eval_batches * per_batch]
    from moe_tune.engine.data.dataset import IGNORE_INDEX

    if not any(label != IGNORE_INDEX for row in read for label in row.labels):
        where = "" if len(read) == len(rows) else f" (the first {len(read)} rows, train.eval_batches {train.eval_batches})"
        raise ProfileError([f"data: the eval rows{where} hold no token to evaluate: every label is masked (records "
                            "without assistant tokens?)"])


def _run_eval(engine, eval_data, train: TrainProfile, dist: DistInfo, step: int, result: RunResult, writer,
              reporter) -> float:  # fmt: skip
    """Evaluate after `step`: a metrics record, a log line, the run's last and best eval; returns the loss."""
    started = time.perf_counter()
    loss, tokens, batches = evaluate(engine, eval_data, train, dist)
    record = {
        "step": step,
        "eval_loss": loss,
        "eval_perplexity": perplexity(loss),
        "eval_tokens": tokens,
        "eval_batches": batches,
        "eval_time_s": time.perf_counter() - started,
    }
    if writer is not None:
        writer.write(record)
    result.eval_loss, result.eval_step = loss, step
    if math.isfinite(loss) and (result.best_eval_loss is None or loss < result.best_eval_loss):
        result.best_eval_loss, result.best_eval_step = loss, step
    reporter.report_eval(record)
    return loss


def base_fingerprint(checkpoint: Path) -> dict:
    """The base checkpoint's folder and the fingerprint of its weight files (RunResult.base_checkpoint)."""
    from moe_tune.engine.families.checkpoint import CheckpointReader

    with CheckpointReader(checkpoint) as reader:
        return {"path": str(Path(checkpoint).absolute()), "files": reader.fingerprint()}


def data_change_note(checkpoint: Path, saved: Any, current: dict[str, Any], step: int) -> str | None:
    """A line when the documents read now (data_fingerprint) are not those the checkpoint trained on (its saved
    fingerprint; a checkpoint written before it was saved has none): the data file regenerated or edited, another
    tokenizer or chat template. The run goes on, on the documents it has."""
    if not isinstance(saved, dict) or saved == current:
        return None
    counts = "{documents} documents, {tokens} tokens, {eval_documents} evaluation documents"
    try:
        was = counts.format(**saved)
    except (KeyError, IndexError):
        was = "a fingerprint this version does not read"
    now = counts.format(**current)
    same = " (the same counts, other tokens or another order)" if was == now else ""
    return (f"note: {checkpoint} was trained on other documents than the data gives now ({was} then; {now} now"
            f"{same}): the rows from step {step} on are not those of an uninterrupted run")


def _restore_eval_state(result: RunResult, state: dict, root: Path) -> None:
    """A resumed run's last and best eval and its best checkpoint, as the checkpoint it resumed from knew them."""
    for key, loss_field, step_field in (("last_eval", "eval_loss", "eval_step"),
                                        ("best_eval", "best_eval_loss", "best_eval_step")):  # fmt: skip
        saved = state.get(key)
        if isinstance(saved, dict):
            setattr(result, loss_field, saved.get("loss"))
            setattr(result, step_field, saved.get("step"))
    best = best_checkpoint(root, state["step"])
    result.best_checkpoint = best[0] if best is not None else None


def _save(engine, profile: JobProfile, root: Path, step: int, dist: DistInfo, eval_loss: float | None = None,
          result: RunResult | None = None, data: dict[str, Any] | None = None) -> Path:  # fmt: skip
    evals = {}
    if result is not None:
        evals = {
            "last_eval": {"step": result.eval_step, "loss": result.eval_loss} if result.eval_step else None,
            "best_eval": {"step": result.best_eval_step, "loss": result.best_eval_loss} if result.best_eval_step
            else None,
        }  # fmt: skip
    state = {
        "step": step,
        "profile_name": profile.name,
        "torch_rng": torch.get_rng_state().tolist(),
        "selection_bias": [b.selection_bias.tolist() for b in _moe_blocks(engine)],
        # This step's eval loss (None: no eval at this step): pruning keeps the checkpoint with the lowest.
        "eval_loss": eval_loss,
        **evals,
        # Compared on --resume: a checkpoint of another architecture or layout is refused naming the fields.
        "signature": run_signature(profile, dist.world_size),
        # Compared on --resume too (data_change_note): the documents it trained on.
        "data": data,
        # The base weights the run trained on (RunResult.base_checkpoint), carried over --resume.
        "base": result.base_checkpoint if result is not None else None,
    }
    return save_checkpoint(engine, root, step, state, profile.output.keep_last, dist.is_main)
