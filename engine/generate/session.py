"""`moe-tune generate`: a run's final weights (or the base model a profile describes) loaded for decoding, prompts
rendered through the chat template with the generation prompt, tokens chosen by the cached decode loop
(decode.generate_ids) and turned into text as they come. Nothing here prints.

What loads:
- RUN_DIR, a finetune output.dir: the model of its profile.yaml with its final weights; LoRA adapters merged in per
  tensor (W + alpha / r * B @ A, engine/export/sources.FinalState, the same weights `moe-tune export --merge`
  writes), or model.safetensors of a full fine-tune. Read with safetensors only. An FP8-base run
  (`model.base_precision: fp8`) keeps its base FP8 and its adapters unmerged beside it: the trained model itself, in
  the memory it trained in.
- PROFILE: the run in its output.dir when that has final weights, else the base model the profile describes (the
  checkpoint's weights, or the seeded init of a profile-built model).
On a GPU the model runs on cuda with parameters in train.precision and buffers in fp32, as DeepSpeed trains it; on a
CPU in fp32.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moe_tune.engine.data.chat import DEFAULT_CHAT_OPTIONS, ChatOptions, closing_token
from moe_tune.engine.data.tokenizer import CHAT_TEMPLATE, Tokenizer
from moe_tune.engine.export.fp8 import is_fp8_base
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

from .decode import SEED_LIMIT, generate_ids

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Loaded:
    """What `load_session` resolved: the profile the model is built from, the run whose weights it takes (None:
    the base model) and a one-line note saying which."""

    profile: JobProfile
    run_dir: Path | None
    note: str


@dataclass
class Generated:
    """One generation: the chosen token ids (a closing stop token excluded), their text, whether a stop token ended
    it, the prompt's length and the timings."""

    ids: list[int]
    text: str
    stopped: bool
    prompt_tokens: int
    elapsed_s: float
    first_token_s: float

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed: tokens after the first over the time after it (the first includes the prefill)."""
        count = len(self.ids) + self.stopped
        decode_s = self.elapsed_s - self.first_token_s
        return (count - 1) / decode_s if count > 1 and decode_s > 0 else 0.0


def option_problems(max_new_tokens: int, temperature: float, top_p: float, seed: int = 0) -> list[str]:
    """The sampling options' problems, one line each (empty when all are valid)."""
    problems = []
    if max_new_tokens < 1:
        problems.append(f"--max-new-tokens ({max_new_tokens}) must be >= 1")
    if not temperature >= 0 or temperature == float("inf"):
        problems.append(f"--temperature ({temperature}) must be a finite number >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        problems.append(f"--top-p ({top_p}) must be in (0, 1]")
    if not 0 <= seed < SEED_LIMIT:
        problems.append(f"--seed ({seed}) must be in [0, 2**64) (the sampling generator's seeds)")
    return problems


def resolve_target(target: str) -> Loaded:
    """RUN_DIR (an existing folder) or PROFILE (a YAML path or a shipped profile's name); ProfileError one line per
    problem when it is neither, the profile is invalid, or a run folder has no final weights."""
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import load_profile, resolve_profile_path, shipped_profiles

    path = Path(target)
    if path.is_dir():
        profile, note = read_finished_run(path)
        return Loaded(profile, path, f"model: the run in {path} ({note})")
    try:
        resolve_profile_path(target)
    except ProfileError:
        raise ProfileError([f"{target}: no such run folder or profile file, nor a shipped profile (RUN_DIR is a "
                            f"finetune output.dir, PROFILE a YAML file or one of {', '.join(shipped_profiles())})"
                            ]) from None
    profile = resolve_job(load_profile(target))
    out = profile.output.dir
    if (out / "profile.yaml").is_file():
        try:
            run_profile, note = read_finished_run(out)
            return Loaded(run_profile, out, f"model: the run in output.dir {out} ({note})")
        except ProfileError as err:
            why = err.problems[0]
            return Loaded(profile, None, f"model: the base model of {target} ({base_kind(profile)}), not the run in "
                                         f"output.dir: {why}")
    return Loaded(profile, None, f"model: the base model of {target} ({base_kind(profile)}); output.dir {out} holds "
                                 "no run")


def base_kind(profile: JobProfile) -> str:
    if profile.model.checkpoint is not None:
        return f"the weights of {profile.model.checkpoint}"
    return f"its seeded random init, model.seed {profile.model.seed}, untrained"


def read_finished_run(run_dir: Path) -> tuple[JobProfile, str]:
    """The resolved profile of the run in `run_dir` and a note on its weights; ProfileError when a run holds the
    folder or it has no final weights (naming the file, and how to get them)."""
    from moe_tune.engine.export.sources import ADAPTER_FILE, WEIGHTS_FILE, read_run
    from moe_tune.engine.train.run_dir import LOCK_NAME, is_held

    if is_held(run_dir) and (run_dir / "profile.yaml").is_file():
        raise ProfileError([f"{run_dir}: a run holds this folder ({LOCK_NAME}); try it once the run has ended"])
    run = read_run(run_dir, need_final=False)
    profile = run.profile
    final = ADAPTER_FILE if profile.lora.enabled else WEIGHTS_FILE
    if not (run_dir / final).is_file():
        step = newest_checkpoint_step(run_dir)
        hint = "finish it with `moe-tune finetune PROFILE --resume`"
        if step is not None:
            hint += f", or write checkpoint step {step} for transformers with `moe-tune export {run_dir} --step {step}`"
        raise ProfileError([f"{run_dir}: no final weights (no {final}): the run did not finish; {hint}"])
    summary = read_summary(run_dir / "summary.json")
    last, stopped_by = summary.get("last_step"), summary.get("interrupted_by")
    kind = "LoRA adapters merged" if profile.lora.enabled else "full fine-tune"
    if profile.lora.enabled and is_fp8_base(profile.model):
        kind = "FP8 base with its LoRA adapters beside it, unmerged"
    at = f"step {last}" if isinstance(last, int) and not isinstance(last, bool) else "its final step"
    if stopped_by:
        return profile, f"{kind}; stopped by {stopped_by} at {at}: its weights there"
    return profile, f"{kind}, {at}"


def newest_checkpoint_step(run_dir: Path) -> int | None:
    steps = [int(m[1]) for p in (run_dir / "checkpoints").glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name))]
    return max(steps, default=None)


def read_summary(path: Path) -> dict:
    """summary.json's fields ({} when it is missing or unreadable: the weights decide what loads)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(loaded: Loaded, device: torch.device) -> nn.Module:
    """The model of `loaded` in eval mode on `device`: parameters in train.precision on cuda (fp32 on a CPU),
    floating buffers in fp32, every persistent tensor filled from the run's final state or the base model."""
    from moe_tune.engine.model.model import MoECausalLM, build_model

    profile, cfg = loaded.profile, loaded.profile.model
    dtype = DTYPES[profile.train.precision] if device.type == "cuda" else torch.float32
    if loaded.run_dir is None and cfg.checkpoint is None and device.type == "cpu" and dtype == torch.float32:
        return build_model(cfg).eval()
    # Built on the device in its dtype (PyTorch's default init, overwritten below): no fp32 copy of a bf16 model.
    with torch.device(device), default_dtype(dtype):
        model = MoECausalLM(cfg)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.float()
    if loaded.run_dir is not None and profile.lora.enabled and is_fp8_base(cfg):
        return fp8_base_with_adapter(model, loaded, dtype).eval()
    if loaded.run_dir is not None:
        from moe_tune.engine.export.sources import FinalState, RunInfo

        with FinalState(RunInfo(loaded.run_dir, profile), merged=True) as source:
            copy_state(model, source.names(), source.read)
    elif cfg.checkpoint is not None:
        from moe_tune.engine.families import load_checkpoint_weights

        load_checkpoint_weights(model, cfg)
    else:
        # The seeded init is drawn on the CPU (as training builds it): the CUDA generator gives other values.
        init = build_model(cfg).state_dict()
        copy_state(model, list(init), init.__getitem__)
    return model.eval()


def fp8_base_with_adapter(model: nn.Module, loaded: Loaded, dtype: torch.dtype) -> nn.Module:
    """An FP8-base LoRA run as it trained: `model` (built FP8) filled with the base as the run loaded it (the
    checkpoint, quantized at load where stored in floating point, or the seeded init quantized), and adapter/ on it
    unmerged, so the frozen weights stay FP8 (half the bytes of a merged bf16 copy) and every forward is the trained
    model's."""
    from moe_tune.engine.export.sources import RunInfo, read_adapter, read_selection_biases
    from moe_tune.engine.lora import load_adapter

    # PEFT loads the adapter unchecked: it is read and checked as export reads it (a truncated file, a factor of the
    # wrong shape, NaN: one line each), before the base loads.
    run = RunInfo(loaded.run_dir, loaded.profile)
    read_adapter(run)
    biases = read_selection_biases(run, {name: tuple(t.shape) for name, t in model.state_dict().items()})
    cfg = loaded.profile.model
    if cfg.checkpoint is not None:
        from moe_tune.engine.families import load_checkpoint_weights

        load_checkpoint_weights(model, cfg)
    else:
        from moe_tune.engine.model.model import build_model

        # The seeded init is drawn on the CPU (as training builds it) and quantized there.
        init = build_model(cfg).state_dict()
        copy_state(model, list(init), init.__getitem__)
    # The routing biases the run trained (model.moe.bias_update_rate), which the adapter does not hold.
    state = model.state_dict()
    with torch.no_grad():
        for name, bias in biases.items():
            state[name].copy_(bias)
    # The adapters in the model's dtype, as the trainer's mixed precision holds them.
    with default_dtype(dtype):
        return load_adapter(model, loaded.run_dir / "adapter")


def copy_state(model: nn.Module, names: list[str], read: Callable[[str], torch.Tensor]) -> None:
    state = model.state_dict()
    assert set(names) == set(state), f"state names differ: {sorted(set(names) ^ set(state))[:5]}"
    with torch.no_grad():
        for name in names:
            state[name].copy_(read(name))


class TextStream:
    """Incremental detokenization: `push(id)` returns the text the new token completes, never half a UTF-8
    character nor a word piece whose text may still change; `flush()` the rest. Each call decodes a window of a few
    tokens: the text from `prefix` to `read` was returned, the tokens after `read` not yet."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd") or not text.startswith(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        done = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :] if text.startswith(done) else text


def render_template(tok: Tokenizer, options: ChatOptions, messages: list[dict],
                    add_generation_prompt: bool) -> list[int] | None:
    """`messages` rendered by the chat template tokenization uses (data.chat_template, else the tokenizer's own), as
    data/tokenizer.py renders training records; None when neither exists (the built-in plain format)."""
    return tok.render_ids(messages, options, add_generation_prompt, "the prompt")


def prompt_ids(tok: Tokenizer, messages: list[dict] | None = None, text: str | None = None,
               options: ChatOptions = DEFAULT_CHAT_OPTIONS) -> list[int]:
    """The tokens the model continues: `messages` rendered by the chat template with the generation prompt (the
    built-in format's `<|assistant|>` header for tokenizers without a template), or `text` as it is; after the
    tokenizer's document start, as training documents begin (Tokenizer.document_start)."""
    if text is not None:
        return tok.document_start(None) + tok.encode(text)
    ids = render_template(tok, options, messages, add_generation_prompt=True)
    if ids is None:
        header = CHAT_TEMPLATE.split("{content}")[0].format(role="assistant")
        rendered = "".join(CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + header
        ids = tok.encode(rendered)
    return tok.document_start(options) + ids


def stop_ids(tok: Tokenizer, profile: JobProfile, options: ChatOptions = DEFAULT_CHAT_OPTIONS) -> tuple[int, ...]:
    """Tokens that end a reply: the tokenizer's <eos>, the special token the chat template closes an assistant turn
    with (<|im_end|>), and a checkpoint's generation_config.json eos_token_id(s)."""
    stops = [tok.eos_id] if tok.eos_id is not None else []
    try:
        turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        ids = render_template(tok, options, turn, add_generation_prompt=False) or []
    except ProfileError:
        ids = []
    closing = closing_token(ids, tok)
    if closing is not None:
        stops.append(closing)
    checkpoint = profile.model.checkpoint
    if checkpoint is not None and (checkpoint / "generation_config.json").is_file():
        try:
            eos = json.loads((checkpoint / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            eos = None
        for token in eos if isinstance(eos, list) else [eos]:
            if isinstance(token, int) and not isinstance(token, bool) and 0 <= token < profile.model.vocab_size:
                stops.append(token)
    return tuple(dict.fromkeys(stops))


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class Session:
    """A loaded model with its tokenizer and stop tokens."""

    model: nn.Module
    tok: Tokenizer
    profile: JobProfile
    device: torch.device
    note: str
    stop_ids: tuple[int, ...] = field(default=())
    options: ChatOptions = DEFAULT_CHAT_OPTIONS

    def prompt(self, messages: list[dict] | None = None, text: str | None = None) -> list[int]:
        """prompt_ids for this tokenizer; ProfileError when it renders to no token."""
        ids = prompt_ids(self.tok, messages, text, self.options)
        if not ids:
            raise ProfileError(["--prompt: the text encodes to no token (and the tokenizer puts none before a text); "
                                "give some text"])
        return ids

    def generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: bool = True,
        on_text: Callable[[str], None] | None = None,
    ) -> Generated:
        """Up to `max_new_tokens` tokens after `ids` (a stop token ends early when `stop`); `on_text(piece)` as the
        text grows."""
        stream = TextStream(self.tok.decode)
        stops = self.stop_ids if stop else ()
        first: list[float] = []
        started = time.perf_counter()

        def on_token(token: int) -> None:
            if not first:
                first.append(time.perf_counter() - started)
            if token not in stops and on_text is not None and (piece := stream.push(token)):
                on_text(piece)

        with torch.inference_mode():
            out = generate_ids(self.model, ids, max_new_tokens, temperature=temperature, top_p=top_p,
                               stop_ids=stops, seed=seed, on_token=on_token)
        elapsed = time.perf_counter() - started
        stopped = bool(out) and out[-1] in stops
        out = out[:-1] if stopped else out
        if on_text is not None and (rest := stream.flush()):
            on_text(rest)
        return Generated(list(out), self.tok.decode(list(out)), stopped, len(ids), elapsed, first[0] if first else 0.0)


def load_session(target: str, device: torch.device | None = None) -> Session:
    """Resolve `target` (RUN_DIR or PROFILE), load its model and tokenizer."""
    from moe_tune.engine.data.chat import chat_options
    from moe_tune.engine.data.tokenizer import load_tokenizer

    loaded = resolve_target(target)
    options = chat_options(loaded.profile.data)
    device = device or pick_device()
    tok = load_tokenizer(loaded.profile.tokenizer)
    if tok.vocab_size > loaded.profile.model.vocab_size:
        raise ProfileError([f"model.vocab_size ({loaded.profile.model.vocab_size}) must be >= the tokenizer's "
                            f"({tok.vocab_size})"])
    model = load_model(loaded, device)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    return Session(model, tok, loaded.profile, device, f"{loaded.note}; on {device.type}, {dtype}",
                   stop_ids(tok, loaded.profile, options), options)
