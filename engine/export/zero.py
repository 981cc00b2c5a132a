"""A run's `checkpoints/step-N` folder read as a state source (engine/export/__init__.py): every tensor assembled
from DeepSpeed's per-rank files into the single-process model's names, one tensor at a time, no rank and no process
ever holding the whole model.

The layout (deepspeed 0.19.8, as engine/train/checkpoint.py saves it; its zero_to_fp32 cannot read expert-parallel
checkpoints):

- ZeRO-3, per rank r: `zero_pp_rank_{r}_mp_rank_00_model_states.pt` holds `param_shapes` (per optimizer sub-group,
  the trainable parameters' names and shapes in flat order), `frozen_param_shapes` / `frozen_param_fragments`
  (frozen parameters: shape, and this rank's slice), `shared_params` (tied names) and the module's buffers whole;
  `zero_pp_rank_{r}_mp_rank_00_optim_states.pt` holds `fp32_flat_groups` (per sub-group, this rank's slices of its
  parameters, concatenated in `param_shapes` order) and `ds_zero_partition_groups` (which ranks each sub-group is
  partitioned over).
- A tensor of n elements partitioned P ways is padded to a multiple of P; partition i holds elements
  [i * ceil(n / P), (i + 1) * ceil(n / P)) of the flattened tensor.
- Routed experts under expert parallel ep: rank r sits at position k = r % ep and holds experts
  [k * E / ep, (k + 1) * E / ep) as an [E / ep, ...] tensor, partitioned over its expert-data-parallel group
  {k, k + ep, ...} (partition index r // ep); the full [E, ...] tensor is the positions' tensors concatenated along
  dim 0, i.e. their flat elements one after another.
- ZeRO-1/2 (no expert parallel there): `mp_rank_00_model_states.pt`'s module holds every tensor whole.

Trainable tensors are read from the fp32 master partitions and returned in the dtype the model trained in (the
module's own tensors' dtype), as the run's final state holds them; frozen tensors and buffers as saved. Every file
is opened with torch.load(mmap=True, weights_only=True): a tensor's bytes are read only when its slices are copied
into its output, which is the one full-size allocation per read (`ZeroCheckpoint.live_bytes` counts them).

LoRA runs: the checkpoint holds the frozen base weights too, so the source needs nothing but the step folder:
read(name) is the base weight (merged=True: with its adapter merged in, engine/export/sources.py merged_weight), a
module trained in full (modules_to_save) as trained; adapter_state() the adapter in PEFT's saved names. An FP8-base
run's step reads as its bf16-base model (engine/export/fp8.py): the FP8 bits and scales dequantized, then merged.
"""

from __future__ import annotations

import math
import pickle
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_tune.profiles import ProfileError

PEFT_PREFIX = "base_model.model."
_ADAPTER_PART = re.compile(r"\.(lora_A|lora_B)\.default\.")
_RANK_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_(model|optim)_states\.pt$")
EXPERT_FAMILY = "autoep_expert"


def _load(path: Path):
    """A DeepSpeed file through the trainer's weights-only loader (nothing but tensor data and DeepSpeed's own
    state classes is unpickled), memory-mapped: the tensors stay in the file until read."""
    from moe_tune.engine.train.checkpoint import weights_only_load

    try:
        return weights_only_load(str(path), map_location="cpu", mmap=True)
    except pickle.UnpicklingError as err:
        shown = next((line for line in str(err).splitlines() if "GLOBAL" in line), str(err).splitlines()[0])
        raise ProfileError([f"{path}: refused, it holds pickled objects other than tensor data ({shown.strip()})"]) \
            from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise ProfileError([f"{path}: not readable as a DeepSpeed checkpoint file ({_first_line(err)})"]) from None


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass
class _Slice:
    """One rank's slice of a tensor: `numel` elements of `flat` from `offset`, partition `index` of `count` at
    expert-parallel position `position` (0 for a tensor every rank shares)."""

    flat: torch.Tensor
    offset: int
    index: int
    count: int
    position: int


@dataclass
class _Entry:
    """Where a saved tensor's slices are: its shape on one rank (experts: [E / ep, ...]), how many expert-parallel
    positions hold a part of it, and the slices."""

    local_shape: torch.Size
    dtype: torch.dtype
    positions: int = 1
    slices: list[_Slice] = field(default_factory=list)
    whole: torch.Tensor | None = None


class ZeroCheckpoint:
    """One step folder's DeepSpeed files, tensor by tensor, in DeepSpeed's saved names (the PeftModel's names for
    LoRA runs). `world` and `ep` as the run was laid out; `is_expert(saved_name)` says which tensors are routed
    experts (held E / ep per rank)."""

    def __init__(self, folder: Path, world: int, ep: int, is_expert):
        self.folder = Path(folder)
        self.world, self.ep = world, ep
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.entries: dict[str, _Entry] = {}
        self.shared: dict[str, str] = {}
        if not self._rank_files("model") and (self.folder / "mp_rank_00_model_states.pt").is_file():
            self._read_stage_1_2()
        else:
            self._read_stage_3(is_expert)

    def _rank_files(self, kind: str) -> dict[int, Path]:
        found = {}
        for path in self.folder.iterdir():
            match = _RANK_FILE.match(path.name)
            if match and match.group(2) == kind:
                found[int(match.group(1))] = path
        return found

    def _read_stage_1_2(self) -> None:
        state = _load(self.folder / "mp_rank_00_model_states.pt")
        module = state.get("module") if isinstance(state, dict) else None
        if not isinstance(module, dict):
            raise ProfileError([f"{self.folder / 'mp_rank_00_model_states.pt'}: no module state in it"])
        for name, tensor in module.items():
            self.entries[name] = _Entry(tensor.shape, tensor.dtype, whole=tensor)
        self.shared = dict(state.get("shared_params") or {})

    def _read_stage_3(self, is_expert) -> None:
        models, optims = self._rank_files("model"), self._rank_files("optim")
        missing = sorted(set(range(self.world)) - (set(models) & set(optims)))
        extra = sorted((set(models) | set(optims)) - set(range(self.world)))
        if missing or extra:
            what = f"the states of ranks {missing} are missing" if missing else f"it holds states of ranks {extra}"
            raise ProfileError([f"{self.folder}: {what} (the run had {self.world} ranks)"])
        for rank in range(self.world):
            model, optim = _load(models[rank]), _load(optims[rank])
            try:
                self._add_rank(rank, model, optim["optimizer_state_dict"], is_expert)
            except (KeyError, TypeError, IndexError) as err:
                raise ProfileError([f"{optims[rank]}: not the ZeRO-3 layout export reads (no {err})"]) from None
        self._check_complete()

    def _add_rank(self, rank: int, model: dict, optim: dict, is_expert) -> None:
        self.shared = dict(model.get("shared_params") or {})
        module = model["module"]
        buffers = set(model.get("buffer_names") or [])
        for name in buffers:
            self.entries.setdefault(name, _Entry(module[name].shape, module[name].dtype, whole=module[name]))
        edp = self.world // self.ep
        position = rank % self.ep
        groups = optim.get("ds_zero_partition_groups")
        counts = optim["partition_count"]
        for g, (shapes, flat) in enumerate(zip(model["param_shapes"], optim["fp32_flat_groups"], strict=True)):
            if groups is not None:
                meta = groups[g]
                count, index = meta["partition_count"], meta["partition_rank"]
                experts = EXPERT_FAMILY in meta["families"]
                if experts and min(meta["partition_ranks"]) != position:
                    raise ProfileError([f"{self.folder}: rank {rank}'s experts are partitioned over ranks "
                                        f"{meta['partition_ranks']}, not the expert-data-parallel group of position "
                                        f"{position} (expert_parallel {self.ep})"])  # fmt: skip
            else:
                count = counts[g] if isinstance(counts, list) else counts
                index, experts = rank, False
            offset = 0
            for name, shape in shapes.items():
                dtype = module[name].dtype if name in module else flat.dtype
                size = math.ceil(math.prod(shape) / count)
                self._add_slice(name, shape, dtype, experts, _Slice(flat, offset, index, count,
                                                                    position if experts else 0))
                offset += size
            if offset != flat.numel():
                raise ProfileError([f"{self.folder}: rank {rank}'s sub-group {g} holds {flat.numel()} elements, its "
                                    f"parameters' slices {offset}"])  # fmt: skip
        for name, shape in (model.get("frozen_param_shapes") or {}).items():
            fragment = model["frozen_param_fragments"][name]
            experts = is_expert(name) and self.ep > 1
            count, index = (edp, rank // self.ep) if experts else (self.world, rank)
            if fragment.numel() != math.ceil(math.prod(shape) / count):
                raise ProfileError([f"{self.folder}: rank {rank}'s slice of {name} has {fragment.numel()} elements, "
                                    f"not 1/{count} of {tuple(shape)}"])  # fmt: skip
            self._add_slice(name, shape, fragment.dtype, experts,
                            _Slice(fragment, 0, index, count, position if experts else 0))

    def _add_slice(self, name: str, shape, dtype, experts: bool, piece: _Slice) -> None:
        entry = self.entries.setdefault(name, _Entry(torch.Size(shape), dtype, self.ep if experts else 1))
        if entry.local_shape != torch.Size(shape) or entry.positions != (self.ep if experts else 1):
            raise ProfileError([f"{self.folder}: the ranks disagree on {name} (shape {tuple(entry.local_shape)} and "
                                f"{tuple(shape)})"])  # fmt: skip
        entry.slices.append(piece)

    def _check_complete(self) -> None:
        for name, entry in self.entries.items():
            if entry.whole is not None:
                continue
            have = {(s.position, s.index) for s in entry.slices}
            counts = {s.count for s in entry.slices}
            need = {(p, i) for p in range(entry.positions) for i in range(next(iter(counts)))}
            if len(counts) != 1 or have != need:
                raise ProfileError([f"{self.folder}: the ranks' slices of {name} do not cover it "
                                    f"(missing {sorted(need - have)[:4]})"])  # fmt: skip

    def names(self) -> list[str]:
        return list(self.entries) + [n for n in self.shared if n not in self.entries]

    def shape(self, name: str) -> torch.Size:
        entry = self.entries[name if name in self.entries else self.shared[name]]
        if entry.positions == 1:
            return entry.local_shape
        return torch.Size([entry.local_shape[0] * entry.positions, *entry.local_shape[1:]])

    def read(self, name: str) -> torch.Tensor:
        """The saved tensor `name`, whole (experts: every position's experts, [E, ...]), in its trained dtype."""
        if name not in self.entries and name in self.shared:
            name = self.shared[name]
        entry = self.entries[name]
        if entry.whole is not None:
            out = self._new(entry.whole.shape, entry.dtype)
            return out.copy_(entry.whole)
        local = math.prod(entry.local_shape)
        out = self._new(self.shape(name), entry.dtype)
        flat = out.view(-1)
        for piece in entry.slices:
            size = math.ceil(local / piece.count)
            start = piece.index * size
            length = min(size, local - start)
            if length > 0:
                base = piece.position * local + start
                # copy_ casts the fp32 master slice to the trained dtype as DeepSpeed's own copy does.
                flat[base:base + length].copy_(piece.flat[piece.offset:piece.offset + length])
        return out

    def read_rows(self, name: str, first: int, count: int) -> torch.Tensor:
        """Rows [first, first + count) of the saved tensor's first dim (one expert of [E, ...]), copied from only the
        slices that hold them."""
        if name not in self.entries and name in self.shared:
            name = self.shared[name]
        entry = self.entries[name]
        shape = tuple(self.shape(name))
        if entry.whole is not None:
            out = self._new((count, *shape[1:]), entry.dtype)
            return out.copy_(entry.whole[first : first + count])
        row = math.prod(shape[1:])
        lo, hi = first * row, (first + count) * row
        local = math.prod(entry.local_shape)
        out = self._new((count, *shape[1:]), entry.dtype)
        flat = out.view(-1)
        for piece in entry.slices:
            size = math.ceil(local / piece.count)
            start = piece.index * size
            length = min(size, local - start)
            begin = piece.position * local + start  # where this slice's elements sit in the whole tensor
            a, b = max(begin, lo), min(begin + length, hi)
            if length > 0 and a < b:
                flat[a - lo : b - lo].copy_(piece.flat[piece.offset + a - begin : piece.offset + b - begin])
        return out

    def _new(self, shape, dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        size = out.numel() * out.element_size()
        self.live_bytes += size
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(out, self._freed, size)
        return out

    def _freed(self, size: int) -> None:
        self.live_bytes -= size

    def close(self) -> None:
        self.entries.clear()


def _map_name(saved: str) -> tuple[str, str]:
    """(kind, name) of a saved tensor in the single-process model: ("weight", our name) for a base or fully trained
    tensor, ("adapter", PEFT's saved key) for a LoRA factor, ("trained", our name) for a module trained in full
    under LoRA (modules_to_save), ("original", our name) for that module's untrained copy."""
    if not saved.startswith(PEFT_PREFIX):
        return "weight", saved
    rest = saved[len(PEFT_PREFIX):]
    if _ADAPTER_PART.search(rest):
        return "adapter", PEFT_PREFIX + _ADAPTER_PART.sub(r".\1.", rest)
    if ".modules_to_save.default." in rest:
        return "trained", rest.replace(".modules_to_save.default.", ".")
    if ".original_module." in rest:
        return "original", rest.replace(".original_module.", ".")
    return "weight", rest.replace(".base_layer.", ".")


def _expert_names(model: torch.nn.Module) -> set[str]:
    """Module paths of the routed experts (GroupedExperts) in our model."""
    from moe_tune.engine.model.moe import GroupedExperts

    return {path for path, module in model.named_modules() if isinstance(module, GroupedExperts)}


class StepState:
    """The state source of `checkpoints/step-N` of a run (engine/export/__init__.py): open_step builds it."""

    def __init__(self, run, folder: Path, merged: bool, world: int, ep: int):
        from .sources import lora_scaling, meta_model

        self.run, self.merged = run, merged
        self.lora = run.profile.lora.enabled
        self.scaling = lora_scaling(run.profile) if self.lora else 1.0
        model = meta_model(run.cfg)
        self._names = list(model.state_dict())
        experts = _expert_names(model)

        def is_expert(saved: str) -> bool:
            kind, name = _map_name(saved)
            if kind == "adapter":
                name = name[len(PEFT_PREFIX):]
            return name.rpartition(".")[0].removesuffix(".lora_A").removesuffix(".lora_B") in experts

        self.checkpoint = ZeroCheckpoint(folder, world, ep, is_expert)
        self._weights: dict[str, str] = {}
        self._adapter_keys: dict[str, str] = {}
        for saved in self.checkpoint.names():
            kind, name = _map_name(saved)
            if kind == "adapter":
                self._adapter_keys[name] = saved
            elif kind == "trained":
                self._adapter_keys[PEFT_PREFIX + name] = saved
                self._weights[name] = saved
            elif kind == "weight" or name not in self._weights:
                self._weights[name] = saved
        # Tied names the checkpoint stores once: read under the name it has.
        for name, target in _tied(model).items():
            if name not in self._weights and target in self._weights:
                self._weights[name] = self._weights[target]
        missing = [n for n in self._names if n not in self._weights]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ProfileError([f"{folder}: holds no {', '.join(missing[:3])}{more} of the run's model"])
        self._adapter: dict[str, torch.Tensor] | None = None

    def names(self) -> list[str]:
        return list(self._names)

    def read(self, name: str) -> torch.Tensor:
        from .sources import merged_weight

        weight = self.checkpoint.read(self._weights[name])
        kind, _ = _map_name(self._weights[name])
        if not (self.lora and self.merged) or kind == "trained":
            return weight
        return merged_weight(name, weight, self.adapter_state(), self.scaling)

    def read_expert(self, name: str, expert: int) -> torch.Tensor:
        from .sources import merged_weight

        saved = self._weights[name]
        weight = self.checkpoint.read_rows(saved, expert, 1)
        kind, _ = _map_name(saved)
        if not (self.lora and self.merged) or kind == "trained":
            return weight
        return merged_weight(name, weight, self.adapter_state(), self.scaling, expert)

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        if not self.lora:
            return None
        if self._adapter is None:
            self._adapter = {key: self.checkpoint.read(saved) for key, saved in self._adapter_keys.items()}
        return self._adapter

    def close(self) -> None:
        self.checkpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _tied(model: torch.nn.Module) -> dict[str, str]:
    """name -> the first name of the same parameter, for every parameter listed under several names."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def peft_state_source(state: dict[str, torch.Tensor], cfg, scaling: float):
    """A PeftModel's full state in its saved names (the trainer's gathered parameters and buffers) as the merged
    state source of an FP8-base run: our names, FP8 weights dequantized, adapters merged per tensor
    (fp8.DequantizedSource)."""
    from .sources import DequantizedSource, DictSource, meta_model

    ours: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for saved, tensor in state.items():
        kind, name = _map_name(saved)
        if kind == "adapter":
            adapter[name] = tensor
        elif kind == "trained":
            adapter[PEFT_PREFIX + name] = tensor
            ours[name] = tensor
        elif kind == "weight" or name not in ours:
            ours[name] = tensor
    for name, target in _tied(meta_model(cfg)).items():
        if name not in ours and target in ours:
            ours[name] = ours[target]
    return DequantizedSource(DictSource(ours, adapter), cfg, True, scaling)


def step_folder_problems(run, step: int) -> list[str]:
    """Lines saying why checkpoints/step-`step` of `run` (sources.RunInfo) is not there to read: no such folder
    (the steps there listed), or the checkpoints folder a link leading outside the run; [] when it is there."""
    from moe_tune.engine.train.checkpoint import checkpoint_dirs, checkpoint_name, checkpoint_step, misnamed_checkpoints
    from moe_tune.engine.train.run_dir import links_out_of

    root = Path(run.run_dir) / "checkpoints"
    escaping = links_out_of(Path(run.run_dir), ("checkpoints",))
    if escaping:
        return [f"--step {step}: {line}" for line in escaping]
    folder = root / checkpoint_name(step)
    if folder.is_dir():
        return []
    have = [str(checkpoint_step(p)) for p in checkpoint_dirs(root)]
    listed = f"the checkpoints there are steps {', '.join(have)}" if have else "there are none"
    # A folder named for the step otherwise (step-3): not a checkpoint name, which the line says.
    renamed = [name for name, named in misnamed_checkpoints(root).items() if named == step]
    if renamed:
        listed += f"; {', '.join(renamed)} is not named as the trainer names checkpoints ({folder.name})"
    return [f"--step {step}: no checkpoint {folder} ({listed})"]


def open_step(run, step: int, merged: bool):
    """The state of `run` (sources.RunInfo) at checkpoints/step-`step`, after verifying it against its manifest: a
    StepState, or for an FP8-base run its bf16-base view (fp8.DequantizedSource). ProfileError, one line per problem:
    no such checkpoint, one that does not verify, a layout it cannot read."""
    from moe_tune.engine.train.checkpoint import checkpoint_name, verify_checkpoint

    from .fp8 import is_fp8_base
    from .sources import DequantizedSource

    missing = step_folder_problems(run, step)
    if missing:
        raise ProfileError(missing)
    folder = Path(run.run_dir) / "checkpoints" / checkpoint_name(step)
    verdict = verify_checkpoint(folder)
    if verdict.problem is not None:
        raise ProfileError([f"--step {step}: {folder} does not verify: {verdict.problem}"])
    fixed = (verdict.state.get("signature") or {}).get("fixed") or {}
    world = fixed.get("world_size", 1)
    ep = (fixed.get("parallel") or {}).get("expert_parallel", run.profile.parallel.expert_parallel)
    if not (isinstance(world, int) and isinstance(ep, int) and 0 < ep <= world and world % ep == 0):
        raise ProfileError([f"--step {step}: {folder}: world size {world!r} and expert_parallel {ep!r} are not a "
                            "layout export can read"])  # fmt: skip
    if is_fp8_base(run.cfg):
        # FP8 base weights are stored as their bits: read raw, then dequantized and merged as a bf16 base's.
        from .sources import lora_scaling

        return DequantizedSource(StepState(run, folder, False, world, ep), run.cfg, merged, lora_scaling(run.profile))
    return StepState(run, folder, merged, world, ep)
