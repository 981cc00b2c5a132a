"""`moe-tune onboard DIR`: the adaptation loop on one checkpoint folder, in one report.

Stages, each reporting its own outcome: read config.json and map it (engine/families); load the weights into our
model and trace one forward pass to see which op runs every module and on which path (Triton kernel, pure-PyTorch
reference, or a torch path, and why); plan the data x expert layouts for N devices (engine/plan.py); time a
few LoRA training steps on the device present (engine/bench/steps.py); align against transformers
(engine/align/compare.py). Anything the families cannot map is listed, one line each, and the later stages are
skipped: nothing runs on a model that is only partly ours.

Exit codes (OnboardReport.exit_code): 0 everything maps, runs and aligns; 1 alignment fails or a stage that runs the
model failed; 2 something is not supported.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Tokens per row of the timed training steps: long enough for every attention path, short enough for a CPU.
PROFILE_SEQ_LEN = 64
# Documents of the generated corpus those steps draw from (a few rows' worth).
PROFILE_DOCUMENTS = 32
# Tokens per row the layout plan assumes: a usual fine-tuning row, so activations weigh as they will in training.
PLAN_SEQ_LEN = 4096
# Device memory planned for when no GPU is present: one H200 (what `moe-tune plan` assumes by default).
DEFAULT_DEVICE_MEMORY = 141 * 10**9
# config.json keys that describe the file or generation, not the architecture: never listed as unmapped.
BOOKKEEPING_KEYS = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "output_attentions", "output_hidden_states", "return_dict", "_name_or_path",
    "model_type", "tokenizer_class", "is_encoder_decoder", "id2label", "label2id", "chunk_size_feed_forward",
    "problem_type", "tie_encoder_decoder", "pruned_heads", "torchscript", "task_specific_params",
}  # fmt: skip
# Config keys listed at most for a model type no family maps (the key patterns are capped the same way).
MAX_LISTED_KEYS = 40
PATHS = ("kernel", "reference", "torch")
_LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)(?:\.|$)")


@dataclass
class OpUse:
    """One call of a dispatching op during the traced forward: the module it ran in, the path it took and why."""

    module: str
    op: str
    path: str  # one of PATHS
    reason: str


@dataclass
class LayerMap:
    index: int
    attention: str  # the profile's attention kind (linear, full, sparse, ...)
    token_mixer: str  # our block class
    mlp: str  # moe or dense
    channel_mixer: str
    ops: list[OpUse] = field(default_factory=list)


@dataclass
class Stage:
    """One stage's outcome: ok, failed (with problems, one line each) or skipped (with the reason)."""

    status: str = "skipped"
    problems: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class OnboardReport:
    checkpoint: str
    model_type: str | None = None
    family: str | None = None
    device: str = "cpu"
    unsupported: list[str] = field(default_factory=list)
    mapping: Stage = field(default_factory=Stage)
    layers: list[LayerMap] = field(default_factory=list)
    model_ops: list[OpUse] = field(default_factory=list)  # ops outside the decoder layers (head, loss, vision)
    plan: Stage = field(default_factory=Stage)
    profile: Stage = field(default_factory=Stage)
    align: Stage = field(default_factory=Stage)

    @property
    def exit_code(self) -> int:
        if self.unsupported:
            return 2
        stages = (self.mapping, self.plan, self.profile, self.align)
        if any(stage.status == "failed" for stage in stages) or self.align.status != "ok":
            return 1
        return 0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["exit_code"] = self.exit_code
        return data

    def write_json(self, path: Path) -> None:
        """Written atomically: a temporary file beside `path`, then renamed over it."""
        from moe_tune.engine.atomic_write import write_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(self.to_json(), indent=2, default=str) + "\n")


def unmapped_config_keys(config: dict[str, Any]) -> list[str]:
    """For a model type no family maps: every architecture key of config.json with its value, one line each
    (bookkeeping keys left out, at most MAX_LISTED_KEYS)."""
    from moe_tune.engine.families.base import show

    keys = [k for k in config if k not in BOOKKEEPING_KEYS]
    lines = [f"config.json: {k} ({show(config[k])}) is not mapped" for k in keys[:MAX_LISTED_KEYS]]
    if len(keys) > MAX_LISTED_KEYS:
        lines.append(f"config.json: ... and {len(keys) - MAX_LISTED_KEYS} more keys")
    return lines


def check_supported(directory: Path) -> list[str]:
    """Every problem that stops moe-tune from mapping the checkpoint (empty when it maps): the families' lines (the
    model type, config values, weight files) and, for a model type no family maps, its config keys with values."""
    from moe_tune.engine.families import UnsupportedModel, check_checkpoint, supported_model_types
    from moe_tune.engine.families.checkpoint import read_config

    try:
        check_checkpoint(directory)
        return []
    except UnsupportedModel as err:
        problems = list(err.problems)
    try:
        config = read_config(directory)
    except UnsupportedModel:
        return problems
    if config.get("model_type") not in supported_model_types():
        problems += unmapped_config_keys(config)
    return problems


def kernel_reason(choice: bool, has_kernel: bool, on_cuda: bool, mode: str) -> str:
    """Why ops/common/dispatch.use_kernel chose what it chose (its rules, in words)."""
    if mode == "reference":
        return "MOE_TUNE_KERNELS=reference"
    if mode == "triton":
        return "MOE_TUNE_KERNELS=triton" + ("" if on_cuda else " (Triton interpreter)")
    if choice:
        return "CUDA"
    if not has_kernel:
        return "no kernel for these inputs (dtype, size or options)"
    return "no CUDA device"


def _module_stack(model: nn.Module) -> tuple[list[str], list]:
    """Forward pre- and post-hooks keeping the name of the innermost module running on a stack."""
    stack = [""]

    def enter(module: nn.Module, _args) -> None:
        stack.append(names[module])

    def leave(_module: nn.Module, _args, _output) -> None:
        stack.pop()

    names = {module: name for name, module in model.named_modules()}
    handles = []
    for module in names:
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return stack, handles


@contextlib.contextmanager
def traced_dispatch(model: nn.Module) -> Iterator[list[OpUse]]:
    """Within: every dispatch decision the model's forward makes, in order, as OpUse. The dispatch points are
    observed, not predicted: ops/common/dispatch.use_kernel as each op module bound it, the cross entropy of the
    head (which dispatches on its own) and the torch attention of full and MLA layers."""
    from moe_tune.engine.model import attention, mla
    from moe_tune.engine.model import model as model_module
    from moe_tune.engine.model.varlen import flash_varlen_applies
    from moe_tune.ops.common import dispatch

    uses: list[OpUse] = []
    stack, handles = _module_stack(model)
    original_use_kernel = dispatch.use_kernel

    def use_kernel(op_name: str, *tensors: torch.Tensor, has_kernel: bool) -> bool:
        choice = original_use_kernel(op_name, *tensors, has_kernel=has_kernel)
        on_cuda = all(t.is_cuda for t in tensors if t is not None)
        reason = kernel_reason(choice, has_kernel, on_cuda, dispatch.kernel_mode())
        uses.append(OpUse(stack[-1], op_name, "kernel" if choice else "reference", reason))
        return choice

    def observing_attention(original):
        def packed_causal_attention(q, k, v, *args, **kwargs):
            flash = flash_varlen_applies(q, k, v)
            why = "flash variable-length (CUDA, 16-bit)" if flash else "SDPA per bucket of documents"
            uses.append(OpUse(stack[-1], "packed_causal_attention", "torch", why))
            return original(q, k, v, *args, **kwargs)

        return packed_causal_attention

    original_ce = model_module.linear_cross_entropy

    def linear_cross_entropy(hidden, *args, **kwargs):
        # The head's own rules (ops/cross_entropy): the kernel for 16/32-bit floats on CUDA or the interpreter,
        # PyTorch passes over chunks elsewhere, the reference when forced.
        mode, where = dispatch.kernel_mode(), stack[-1] or "lm_head"
        takes_kernel = hidden.dtype in (torch.float16, torch.bfloat16, torch.float32) and (
            hidden.is_cuda or (mode == "triton" and dispatch.triton_interpreting()))
        if mode == "reference":
            use = OpUse(where, "linear_cross_entropy", "reference", "MOE_TUNE_KERNELS=reference")
        elif takes_kernel:
            use = OpUse(where, "linear_cross_entropy", "kernel", kernel_reason(True, True, hidden.is_cuda, mode))
        else:
            why = "no kernel for this dtype" if hidden.is_cuda else "no CUDA device"
            use = OpUse(where, "linear_cross_entropy", "torch", f"chunked PyTorch: {why}")
        uses.append(use)
        return original_ce(hidden, *args, **kwargs)

    patched: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if name.startswith("moe_tune.ops.") and getattr(module, "use_kernel", None) is original_use_kernel:
            patched.append((module, "use_kernel", use_kernel))
    for module in (attention, mla):
        patched.append((module, "packed_causal_attention", observing_attention(module.packed_causal_attention)))
    patched.append((model_module, "linear_cross_entropy", linear_cross_entropy))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    try:
        for module, name, value in patched:
            setattr(module, name, value)
        yield uses
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for handle in handles:
            handle.remove()


def training_device() -> tuple[torch.device, torch.dtype]:
    """Where and in which dtype the training steps run: the first GPU in bf16, else the CPU in fp32."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0), torch.bfloat16
    return torch.device("cpu"), torch.float32


def map_layers(
    cfg, family, device: torch.device, dtype: torch.dtype, documents=None
) -> tuple[list[LayerMap], list[OpUse]]:
    """Our model loaded from the checkpoint (UnsupportedModel naming every tensor that does not map), run forward
    once on `device` in `dtype` over packed documents with labels: each decoder layer's blocks and the ops they ran."""
    from moe_tune.engine.align.compare import default_documents, load_ours, pack_documents

    # Training mode: the loss goes through the fused head (linear_cross_entropy) as it does in training.
    model = load_ours(cfg).to(device=device, dtype=dtype).train()
    docs = documents if documents is not None else default_documents(cfg)
    ids, cu, labels, images = pack_documents(docs)
    images = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in images.items()}
    with traced_dispatch(model) as uses, torch.no_grad():
        model(ids.to(device), cu.to(device), labels.to(device), **images)
    layers = []
    for index, (spec, layer) in enumerate(zip(cfg.layers, model.layers)):
        layers.append(LayerMap(index, str(spec.attention), type(layer.self_attn).__name__, str(spec.mlp),
                               type(layer.mlp).__name__))
    outside = []
    for use in uses:
        match = _LAYER.match(use.module)
        if match is not None and int(match.group(1)) < len(layers) and not use.module.startswith("vision"):
            layers[int(match.group(1))].ops.append(use)
        else:
            outside.append(use)
    for layer in layers:
        for block in ("self_attn", "mlp"):
            prefix = f"layers.{layer.index}.{block}"
            if not any(use.module == prefix or use.module.startswith(prefix + ".") for use in layer.ops):
                # A block of plain PyTorch modules (a dense SwiGLU MLP): no fused op, nothing to dispatch.
                kind = type(getattr(model.layers[layer.index], block)).__name__
                layer.ops.append(OpUse(prefix, kind, "torch", "PyTorch modules, no fused op"))
    return [_dedupe(layer) for layer in layers], _unique(outside)


def _unique(uses: list[OpUse]) -> list[OpUse]:
    """One entry per (module, op, path, reason): a module called twice (several documents, images) is listed once."""
    return list({(u.module, u.op, u.path, u.reason): u for u in uses}.values())


def _dedupe(layer: LayerMap) -> LayerMap:
    layer.ops = _unique(layer.ops)
    return layer


def lora_targets(cfg) -> list[str]:
    """LoRA's default target_modules when the model has them all; else (MLA names its projections q_a_proj, kv_b_proj
    ...) every linear layer the token mixers hold directly."""
    from moe_tune.engine.plan import model_parameters
    from moe_tune.profiles.schema import LoraProfile

    defaults = LoraProfile().target_modules
    linear = [p.module for p in model_parameters(cfg) if p.is_linear]
    if set(defaults) <= {m.rsplit(".", 1)[-1] for m in linear}:
        return defaults
    return sorted({m.rsplit(".", 1)[-1] for m in linear if re.fullmatch(r"layers\.\d+\.self_attn\.[^.]+", m)})


def onboarding_profile(directory: Path, seq_len: int, precision: str, out_dir: Path):
    """The job onboard plans and profiles: the checkpoint with moe-tune's LoRA defaults (lora_targets), the
    generated corpus (byte tokenizer), one row per micro-batch."""
    from moe_tune.engine.families import model_profile_from_checkpoint, resolve_job
    from moe_tune.profiles import validate_profile

    _, _, cfg = model_profile_from_checkpoint(directory)
    raw = {
        "name": f"onboard-{Path(directory).name}",
        "model": {"checkpoint": str(directory)},
        "data": {"tokenizer": "byte", "seq_len": seq_len, "corpus_documents": PROFILE_DOCUMENTS},
        "lora": {"target_modules": lora_targets(cfg)},
        "train": {"steps": 1_000, "micro_batch_size": 1, "lr": 1e-4, "precision": precision},
        "output": {"dir": str(out_dir)},
    }
    return resolve_job(validate_profile(raw))


def run_plan(directory: Path, devices: int, device_memory: int, out_dir: Path) -> Stage:
    from moe_tune.engine.plan import plan_layouts
    from moe_tune.profiles import ProfileError

    try:
        job = onboarding_profile(directory, PLAN_SEQ_LEN, "bf16", out_dir)
        result = plan_layouts(job, devices, device_memory)
    except ProfileError as err:
        return Stage("failed", list(err.problems))
    data = result.as_dict()
    fitting = [lay for lay in result.layouts if lay.fits]
    if fitting:
        best = fitting[0]
        data["suggested"] = {"data_parallel": best.data_parallel, "expert_parallel": best.expert_parallel,
                             "experts_per_device": best.experts_per_device, "total_bytes": best.total}
    else:
        data["suggested"] = None
    data["seq_len"] = PLAN_SEQ_LEN
    data["lora_target_modules"] = list(job.lora.target_modules)
    return Stage("ok", result=data)


def run_profile(directory: Path, steps: int, warmup: int, out_dir: Path, precision: str) -> Stage:
    """`steps` timed LoRA training steps (after `warmup`) of the onboarding job on this process's device."""
    from moe_tune.engine.bench.machine import peak_host_memory
    from moe_tune.engine.bench.steps import StepRunner
    from moe_tune.profiles import ProfileError

    try:
        job = onboarding_profile(directory, PROFILE_SEQ_LEN, precision, out_dir)
    except ProfileError as err:
        return Stage("failed", list(err.problems))
    runner = StepRunner(job)
    records = []
    try:
        for index in range(warmup + steps):
            if index == warmup and runner.is_cuda:
                torch.cuda.reset_peak_memory_stats()
            records.append(runner.step())
        is_cuda = runner.is_cuda
        peak = torch.cuda.max_memory_allocated() if is_cuda else peak_host_memory()
    finally:
        runner.close()
    timed = records[warmup:]
    return Stage("ok", result={
        "device": "cuda" if is_cuda else "cpu",
        "precision": precision,
        "seq_len": PROFILE_SEQ_LEN,
        "micro_batch_size": 1,
        "lora": {"r": job.lora.r, "target_modules": job.lora.target_modules, "experts": job.lora.experts},
        "warmup_steps": warmup,
        "steps": len(timed),
        "step_times_s": [r["step_time_s"] for r in timed],
        "tokens_per_s": [r["tokens_per_s"] for r in timed],
        "losses": [r["loss"] for r in timed],
        "peak_memory_bytes": peak,
        "peak_memory_kind": "CUDA allocated (timed steps)" if is_cuda else "process peak resident memory",
    })


def run_align(directory: Path, documents=None) -> Stage:
    from moe_tune.engine.align.compare import align_checkpoint
    from moe_tune.engine.align.reference import pure_torch_paths

    from moe_tune.engine.families.base import is_fp8_checkpoint
    from moe_tune.engine.families.checkpoint import read_config

    # An FP8 checkpoint runs ours with quantized activations, which flips nearly tied experts: its experts are
    # pinned to the reference's (the sparse attention selections are not, so a wrong indexer still shows).
    is_fp8 = is_fp8_checkpoint(read_config(directory))
    # align_checkpoint builds the reference under pure_torch_paths itself; held here too, it costs nothing.
    with pure_torch_paths():
        report = align_checkpoint(directory, documents, pin_routing=is_fp8, pin_selection=False)
    data = report.to_json()
    return Stage("ok" if report.passed else "failed", list(report.failures), data)


def _stage_error(err: BaseException) -> list[str]:
    from moe_tune.engine.families import UnsupportedModel
    from moe_tune.profiles import ProfileError

    if isinstance(err, (UnsupportedModel, ProfileError)):
        return list(err.problems)
    text = str(err).strip().splitlines()
    return [f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")]


def onboard(
    directory: Path,
    devices: int | None = None,
    device_memory: int | None = None,
    profile_steps: int = 2,
    warmup_steps: int = 1,
    documents=None,
    on_stage: Callable[[str], None] = lambda name: None,
) -> OnboardReport:
    """Run every stage on the checkpoint folder `directory` (see the module docstring). `devices`: the plan's device
    count (default: the GPUs present, 1 without); `device_memory`: bytes per device (default: the first GPU's,
    else DEFAULT_DEVICE_MEMORY); `documents`: align's documents (default: align's three random ones).
    `on_stage(name)` is called as each stage starts."""
    from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint

    directory = Path(directory)
    device, dtype = training_device()
    report = OnboardReport(checkpoint=str(directory), device=str(device))
    on_stage("mapping")
    report.unsupported = check_supported(directory)
    if report.unsupported:
        reason = "the checkpoint is not supported"
        report.mapping = Stage("failed", list(report.unsupported))
        report.plan = report.profile = report.align = Stage("skipped", [reason])
        with contextlib.suppress(UnsupportedModel):
            from moe_tune.engine.families.checkpoint import read_config

            report.model_type = str(read_config(directory).get("model_type"))
        return report
    family, config, cfg = model_profile_from_checkpoint(directory)
    report.model_type, report.family = str(config.get("model_type")), type(family).__name__
    try:
        report.layers, report.model_ops = map_layers(cfg, family, device, dtype)
        report.mapping = Stage("ok", result={"precision": str(dtype).removeprefix("torch.")})
    except UnsupportedModel as err:
        report.unsupported = list(err.problems)
        report.mapping = Stage("failed", list(err.problems))
        report.plan = report.profile = report.align = Stage("skipped", ["the checkpoint is not supported"])
        return report
    except (RuntimeError, ValueError) as err:  # an op refusing its inputs, or a forced path that cannot run
        report.mapping = Stage("failed", _stage_error(err))

    num_devices = devices if devices is not None else max(torch.cuda.device_count(), 1)
    memory = device_memory
    if memory is None:
        on_gpu = torch.cuda.is_available()
        memory = torch.cuda.get_device_properties(0).total_memory if on_gpu else DEFAULT_DEVICE_MEMORY
    with tempfile.TemporaryDirectory(prefix="moe-tune-onboard-") as scratch:
        on_stage("plan")
        report.plan = run_plan(directory, num_devices, memory, Path(scratch) / "out")
        on_stage("profile")
        precision = "bf16" if dtype == torch.bfloat16 else "fp32"
        try:
            if profile_steps > 0:
                report.profile = run_profile(directory, profile_steps, warmup_steps, Path(scratch) / "out", precision)
            else:
                report.profile = Stage("skipped", ["not requested (0 training steps)"])
        except Exception as err:  # noqa: BLE001 - a step that cannot run is this stage's outcome, not the command's
            report.profile = Stage("failed", _stage_error(err))
    on_stage("align")
    try:
        report.align = run_align(directory, documents)
    except Exception as err:  # noqa: BLE001 - as above: reported in the align section
        report.align = Stage("failed", _stage_error(err))
    return report


def path_summary(report: OnboardReport) -> dict[str, int]:
    """How many traced op calls took each path."""
    counts = {path: 0 for path in PATHS}
    for use in [u for layer in report.layers for u in layer.ops] + report.model_ops:
        counts[use.path] += 1
    return counts


__all__ = ["OnboardReport", "OpUse", "LayerMap", "Stage", "onboard", "check_supported", "traced_dispatch"]
