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

How tokens are chosen: as transformers' generate chooses them on the checkpoint, whose generation_config.json gives
the defaults (do_sample, temperature, top_p, top_k, repetition_penalty; read_generation_config) that each option given
replaces; without one, greedy decoding.

Images (a model with a vision tower): read and cut into patches as training reads them (the checkpoint's
preprocessor_config.json, data.image_min/max_pixels; read_prompt_images), placed in the first user message as image
parts before its text and rendered as training renders image records (image_prompt_ids).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from moe_tune.engine.data.chat import DEFAULT_CHAT_OPTIONS, ChatOptions, closing_token
from moe_tune.engine.data.multimodal import VisionTokens
from moe_tune.engine.data.tokenizer import CHAT_TEMPLATE, Tokenizer
from moe_tune.engine.export.fp8 import is_fp8_base
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

from .decode import SAMPLING_RULES, SEED_LIMIT, PromptImages, generate_ids, sampling_rule_broken

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The settings a PROFILE that differs from its run's profile.yaml names (settings_differences), then how many more.
SHOWN_DIFFERENCES = 4


@dataclass
class Loaded:
    """What `load_session` resolved: the profile the model is built from, the run whose weights it takes (None:
    the base model), a one-line note saying which, and the lines after it (a PROFILE that differs from its run's)."""

    profile: JobProfile
    run_dir: Path | None
    note: str
    notes: tuple[str, ...] = ()


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


def option_problems(max_new_tokens: int, temperature: float | None, top_p: float | None, seed: int = 0,
                    top_k: int | None = None, repetition_penalty: float | None = None) -> list[str]:
    """The sampling options' problems, one line each (empty when all are valid); None: not given."""
    problems = []
    if max_new_tokens < 1:
        problems.append(f"--max-new-tokens ({max_new_tokens}) must be >= 1")
    settings = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty}
    for key, value in settings.items():
        if value is not None and (rule := sampling_rule_broken(key, value)) is not None:
            problems.append(f"--{key.replace('_', '-')} ({value}) must be {rule}")
    if not 0 <= seed < SEED_LIMIT:
        problems.append(f"--seed ({seed}) must be in [0, 2**64) (the sampling generator's seeds)")
    return problems


@dataclass(frozen=True)
class Sampling:
    """How each token is chosen (decode.generate_ids): greedy at temperature 0, else drawn from softmax(logits /
    temperature) cut to the top_k (0: all) and the top_p nucleus; repetition_penalty 1: none."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0


GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys that set the Sampling field of their name (do_sample decides between sampling at
# temperature and greedy decoding).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# Keys transformers' generate applies that generate does not, with the values at which they do nothing.
UNAPPLIED_KEYS = {
    "min_p": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "top_h": (None,), "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "sequence_bias": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "min_new_tokens": (None, 0), "min_length": (None, 0), "num_beams": (None, 1),
    "penalty_alpha": (None,), "guidance_scale": (None, 1.0), "exponential_decay_length_penalty": (None,),
    "dola_layers": (None,), "watermarking_config": (None,),
}


@dataclass
class GenerationSettings:
    """What a checkpoint sets for generation, as transformers' from_pretrained reads it: its generation_config.json
    (`path`), else config.json's eos_token_id (its text_config's for a vision-language checkpoint)."""

    path: Path | None = None
    eos_ids: tuple[int, ...] = ()
    defaults: Sampling = Sampling()
    # The generation_config.json keys that set `defaults`, in file order.
    set_keys: tuple[str, ...] = ()
    # One line per key transformers' generate would apply and generate does not.
    unapplied: tuple[str, ...] = ()


def _eos_problems(eos, where: str, vocab_size: int) -> tuple[list[int], list[str]]:
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return [], [f"{where}: eos_token_id ({json.dumps(eos)}) must be a token id or a list of token ids"]
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        return [], [f"{where}: eos_token_id {outside[0]} must be in [0, {vocab_size}) (the model's vocabulary)"]
    return ids, []


def read_generation_config(checkpoint: Path | None, vocab_size: int) -> GenerationSettings:
    """The checkpoint's generation settings (an empty GenerationSettings for a profile-built model). Sampling
    defaults as transformers' generate takes them: do_sample true samples at `temperature` (1 when unset), else
    greedy decoding; top_p, top_k and repetition_penalty where set. ProfileError one line per value generate cannot
    use (not JSON, a value of the wrong type or range, an eos id outside the vocabulary)."""
    from moe_tune.engine.families.checkpoint import MAX_CONFIG_BYTES, read_json_file

    if checkpoint is None:
        return GenerationSettings()
    path = checkpoint / GENERATION_CONFIG
    if not path.exists():
        config = read_json_file(checkpoint / "config.json", MAX_CONFIG_BYTES)
        config = config if isinstance(config, dict) else {}
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        eos = config.get("eos_token_id") if config.get("eos_token_id") is not None else text.get("eos_token_id")
        ids, problems = _eos_problems(eos, str(checkpoint / "config.json"), vocab_size)
        if problems:
            raise ProfileError(problems)
        return GenerationSettings(eos_ids=tuple(ids))
    data = read_json_file(path, MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise ProfileError([f"{path}: must hold a JSON object, got {type(data).__name__}"])
    eos_ids, problems = _eos_problems(data.get("eos_token_id"), str(path), vocab_size)
    do_sample = data.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        problems.append(f"{path}: do_sample ({json.dumps(do_sample)}) must be true or false")
    values = {}
    for key in SAMPLING_RULES:
        value = data.get(key)
        if value is None:
            continue
        if (rule := sampling_rule_broken(key, value)) is None:
            values[key] = value
        else:
            problems.append(f"{path}: {key} ({json.dumps(value)}) must be {rule}")
    if problems:
        raise ProfileError(problems)
    sampled_at = values.pop("temperature", 1.0)
    temperature = sampled_at if do_sample else 0.0
    set_keys = [k for k in data if k in SAMPLING_KEYS and data[k] is not None and (do_sample or k != "temperature")]
    set_keys = (["do_sample"] if do_sample else []) + set_keys
    unapplied = [f"{path}: {key} ({json.dumps(data[key])}) is not applied here (transformers' generate applies it)"
                 for key, neutral in UNAPPLIED_KEYS.items() if key in data and data[key] not in neutral]
    return GenerationSettings(path, tuple(eos_ids), Sampling(temperature=temperature, **values), tuple(set_keys),
                            tuple(unapplied))


def resolve_target(target: str, marks: ExitStack | None = None) -> Loaded:
    """RUN_DIR (an existing folder) or PROFILE (a YAML path or a shipped profile's name: the run in its output.dir, or
    its base model when output.dir holds no run); ProfileError one line per problem when it is neither, the profile
    is invalid, a run holds the run folder, or it has no final weights. The run folder whose weights are taken is
    marked as read (run_dir.reading_run) while it is read, and with `marks` until that stack closes: a finetune into
    it (--overwrite, --resume) is refused while the model loads."""
    from moe_tune.engine.families import resolve_job
    from moe_tune.engine.train.run_dir import moved_run_profile_problem, reading_run
    from moe_tune.profiles import load_profile, resolve_profile_path, shipped_profiles

    def read_marked(run_dir: Path) -> tuple[JobProfile, str]:
        with ExitStack() as mark:
            mark.enter_context(reading_run(run_dir, "generate from", "generate"))
            found = read_finished_run(run_dir)
            if marks is not None:
                marks.push(mark.pop_all())
            return found

    path = Path(target)
    if path.is_dir():
        profile, note = read_marked(path)
        return Loaded(profile, path, f"model: the run in {path} ({note})")
    try:
        resolve_profile_path(target)
    except ProfileError:
        raise ProfileError([f"{target}: no such run folder or profile file, nor a shipped profile (RUN_DIR is a "
                            f"finetune output.dir, PROFILE a YAML file or one of {', '.join(shipped_profiles())})"
                            ]) from None
    profile = resolve_job(load_profile(target))
    out = profile.output.dir
    if (moved := moved_run_profile_problem(resolve_profile_path(target), out, "give the run's folder ({folder})")):
        raise ProfileError([moved])
    if (out / "profile.yaml").is_file():
        # A run it cannot take (unfinished, held, damaged) is refused as RUN_DIR is: never the base model instead.
        run_profile, note = read_marked(out)
        differences = settings_differences(target, profile, run_profile)
        return Loaded(run_profile, out, f"model: the run in output.dir {out} ({note})", differences)
    return Loaded(profile, None, f"model: the base model of {target} ({base_kind(profile)}); output.dir {out} holds "
                                 "no run")


def settings_differences(target: str, given: JobProfile, run: JobProfile) -> tuple[str, ...]:
    """A line naming the settings that build the model or render the prompt (generation_settings) in which the
    PROFILE `target` (`given`) differs from the profile.yaml of the run in its output.dir (`run`), which the model is
    built from; none when they agree."""
    from moe_tune.engine.train.checkpoint import signature_differences

    differences = signature_differences(generation_settings(run), generation_settings(given))
    if not differences:
        return ()
    shown = differences[:SHOWN_DIFFERENCES]
    more = len(differences) - len(shown)
    was = ", ".join(f"{key} {value}" for key, value, _ in shown) + (f" and {more} more" if more else "")
    says = ", ".join(value for _, _, value in shown)
    return (f"note: the run was trained with {was} ({target} says {says}); generate builds the model as the run "
            "did",)


def generation_settings(profile: JobProfile) -> dict:
    """The settings of a profile that generate reads: the model (its checkpoint named by what it holds, not by its
    path), the adapters, the tokenizer (its folder resolved: another spelling of one folder is the same), the chat
    template's text and train.precision (the parameters' dtype on a GPU)."""
    from moe_tune.engine.data.chat import chat_options

    model = profile.model.model_dump(mode="json", exclude={"checkpoint"})
    tokenizer = profile.data.tokenizer
    if tokenizer not in (None, "byte"):
        tokenizer = os.path.realpath(tokenizer)
    # The template's text: profile.yaml holds the text of a .jinja file the run's profile named.
    template = chat_options(profile.data).template if profile.data.chat_template is not None else None
    return {"model": model, "lora": profile.lora.model_dump(mode="json"),
            "data": {"tokenizer": tokenizer, "chat_template": template},
            "train": {"precision": profile.train.precision}}  # fmt: skip


def base_kind(profile: JobProfile) -> str:
    if profile.model.checkpoint is not None:
        return f"the weights of {profile.model.checkpoint}"
    return f"its seeded random init, model.seed {profile.model.seed}, untrained"


def read_finished_run(run_dir: Path) -> tuple[JobProfile, str]:
    """The resolved profile of the run in `run_dir` and a note on its weights; ProfileError when it has no final
    weights (naming the file, and how to get them). Read inside run_dir.reading_run (resolve_target)."""
    from moe_tune.engine.export.sources import ADAPTER_FILE, WEIGHTS_FILE, read_run, read_summary

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
    if summary is None:
        raise ProfileError([f"{run_dir}: no summary.json: the run did not finish (killed before it wrote one?); "
                            "finish it with `moe-tune finetune PROFILE --resume`"])
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


def read_prompt_images(paths: list[Path], profile: JobProfile) -> PromptImages:
    """The images given for a prompt (files named on the command line, any folder), read and cut into patches as
    training reads a record's images (engine/data/images.py, with the profile's image settings). ProfileError naming
    the option and the file: a model without a vision tower, image settings it lacks, a file that is not a readable
    image."""
    from moe_tune.engine.data.dataset import vision_input
    from moe_tune.engine.data.images import ImageError, read_image_patches

    vision = vision_input(profile.model, profile.data)
    if vision is None:
        raise ProfileError(["--image: the model has no vision tower (model.vision) to read images with"])
    if vision.settings is None:
        raise ProfileError([f"--image: {vision.problem}"])
    patches, grids = [], []
    for path in paths:
        try:
            pixels, grid = read_image_patches(path, vision.settings)
        except ImageError as err:  # its line names the file
            raise ProfileError([f"--image: {err}"]) from None
        patches.append(pixels)
        grids.append(grid)
    return PromptImages(torch.cat(patches), torch.tensor(grids))


def image_prompt_ids(tok: Tokenizer, messages: list[dict], counts: list[int], tokens: VisionTokens,
                     options: ChatOptions = DEFAULT_CHAT_OPTIONS) -> list[int]:
    """prompt_ids of `messages` whose content may be a list of parts ({"type": "image"}, {"type": "text", "text":
    str}), the images `counts` tokens long, as training renders image records (engine/data/multimodal.py): the chat
    template writes each image part as one image token, widened to its count; the built-in format writes
    vision-start, the image's tokens and vision-end, each piece encoded alone. ProfileError when a text encodes to
    the image token or the template does not render one per image."""
    parts = [part for m in messages for part in _content_parts(m["content"])]
    if any(tokens.image in tok.encode(part["text"]) for part in parts if part["type"] == "text"):
        raise ProfileError([f"prompt: the text holds the image token id ({tokens.image}) outside the images; remove "
                            "it from the text"])
    ids = render_template(tok, options, messages, add_generation_prompt=True)
    if ids is None:
        prefix, suffix = CHAT_TEMPLATE.split("{content}")
        widths = iter(counts)
        ids = []
        for m in messages:
            ids += tok.encode(prefix.format(role=m["role"]))
            for part in _content_parts(m["content"]):
                ids += (tok.encode(part["text"]) if part["type"] == "text"
                        else [tokens.start] + [tokens.image] * next(widths) + [tokens.end])  # fmt: skip
            ids += tok.encode(suffix.format(role=m["role"]))
        return tok.document_start(options) + ids + tok.encode(prefix.format(role="assistant"))
    if ids.count(tokens.image) != len(counts):
        source = "data.chat_template" if options.template is not None else "the tokenizer's chat template"
        raise ProfileError([f"--image: {source} renders {ids.count(tokens.image)} image tokens ({tokens.image}) for "
                            f"{len(counts)} images: it must render each image part as one"])
    widths = iter(counts)
    widened = [token for t in ids for token in ([t] * next(widths) if t == tokens.image else [t])]
    return tok.document_start(options) + widened


def _content_parts(content: str | list[dict]) -> list[dict]:
    """A message's content as parts: a string is one text part."""
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def stop_ids(tok: Tokenizer, profile: JobProfile, options: ChatOptions = DEFAULT_CHAT_OPTIONS,
             generation: GenerationSettings | None = None) -> tuple[int, ...]:
    """Tokens that end a reply: the tokenizer's <eos>, the special token the chat template closes an assistant turn
    with (<|im_end|>), and the checkpoint's eos_token_id(s) (read_generation_config; `generation` when read)."""
    stops = [tok.eos_id] if tok.eos_id is not None else []
    try:
        turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        ids = render_template(tok, options, turn, add_generation_prompt=False) or []
    except ProfileError:
        ids = []
    closing = closing_token(ids, tok)
    if closing is not None:
        stops.append(closing)
    if generation is None:
        generation = read_generation_config(profile.model.checkpoint, profile.model.vocab_size)
    stops += generation.eos_ids
    return tuple(dict.fromkeys(stops))


def max_positions(profile: JobProfile) -> int | None:
    """The checkpoint's config.json max_position_embeddings (its text_config's for a vision-language checkpoint);
    None for a profile-built model or where it is not a positive integer."""
    from moe_tune.engine.families.checkpoint import read_config

    if profile.model.checkpoint is None:
        return None
    config = read_config(profile.model.checkpoint)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class Session:
    """A loaded model with its tokenizer, stop tokens and the checkpoint's generation settings."""

    model: nn.Module
    tok: Tokenizer
    profile: JobProfile
    device: torch.device
    note: str
    stop_ids: tuple[int, ...] = field(default=())
    options: ChatOptions = DEFAULT_CHAT_OPTIONS
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    # config.json's max_position_embeddings (None: not known).
    max_positions: int | None = None
    # Lines printed after `note` (Loaded.notes).
    notes: tuple[str, ...] = ()

    def prompt(self, messages: list[dict] | None = None, text: str | None = None,
               images: PromptImages | None = None) -> list[int]:
        """prompt_ids for this tokenizer, or with `images` (read_prompt_images) the image_prompt_ids of `messages`
        holding one image part each; ProfileError when it renders to no token."""
        if images is not None:
            spec = self.profile.model.vision
            tokens = VisionTokens(spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id)
            counts = images.token_counts(spec.spatial_merge_size)
            return image_prompt_ids(self.tok, messages, counts, tokens, self.options)
        ids = prompt_ids(self.tok, messages, text, self.options)
        if not ids:
            raise ProfileError(["--prompt: the text encodes to no token (and the tokenizer puts none before a text); "
                                "give some text"])
        return ids

    def images_note(self, images: PromptImages) -> str:
        """The line saying how many images the prompt holds and the image tokens each becomes."""
        counts = images.token_counts(self.profile.model.vision.spatial_merge_size)
        return f"images: {len(counts)} ({', '.join(map(str, counts))} image tokens)"

    def sampling(self, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 repetition_penalty: float | None = None) -> Sampling:
        """The checkpoint's defaults (generation.defaults) with each option given (not None) in place of its own."""
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty}
        return replace(self.generation.defaults, **{k: v for k, v in given.items() if v is not None})

    def decoding_note(self, sampling: Sampling, seed: int, given: tuple[str, ...] = ()) -> str:
        """One line saying how tokens are chosen and which ids stop a reply; `given`: the options set on the command
        line (the others came from the checkpoint's generation_config.json, or are generate's defaults)."""
        is_greedy = sampling.temperature == 0
        if is_greedy:
            how = "greedy"
            if "top_p" in given or "top_k" in given:
                how += " (--top-p and --top-k apply only when sampling, at --temperature > 0)"
        else:
            how = ", ".join([f"sampled at temperature {sampling.temperature:g}",
                             f"top_p {sampling.top_p:g}" if sampling.top_p < 1 else "no top_p",
                             f"top_k {sampling.top_k}" if sampling.top_k > 0 else "no top_k", f"seed {seed}"])
        if sampling.repetition_penalty != 1:
            how += f"; repetition_penalty {sampling.repetition_penalty:g}"
        # --temperature decides between sampling and greedy decoding, as do_sample does; greedy decoding reads no
        # top_p or top_k.
        replaced = set(given) | ({"do_sample"} if "temperature" in given else set())
        replaced |= {"top_p", "top_k"} if is_greedy else set()
        taken = [k for k in self.generation.set_keys if k not in replaced]
        if taken:
            how += f"; {', '.join(taken)} from {self.generation.path}"
        stops = ", ".join(str(t) for t in self.stop_ids) or "none"
        return f"decoding: {how}; stop ids: {stops}"

    def context_note(self, num_prompt_tokens: int, max_new_tokens: int) -> str | None:
        """A line when the prompt and the reply may pass config.json's max_position_embeddings (None otherwise):
        generate runs those positions, as transformers' generate does, though the model was not trained on them."""
        if self.max_positions is None or num_prompt_tokens + max_new_tokens <= self.max_positions:
            return None
        return (f"note: the prompt ({num_prompt_tokens} tokens) and up to {max_new_tokens} new tokens pass the "
                f"checkpoint's max_position_embeddings ({self.max_positions}); positions beyond it run as transformers "
                "runs them, untrained")

    def generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop: bool = True,
        on_text: Callable[[str], None] | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        images: PromptImages | None = None,
    ) -> Generated:
        """Up to `max_new_tokens` tokens after `ids` (a stop token ends early when `stop`); `on_text(piece)` as the
        text grows; `images`: those whose tokens `ids` holds (read_prompt_images). Options left None take the
        checkpoint's defaults (Session.sampling)."""
        sampling = self.sampling(temperature, top_p, top_k, repetition_penalty)
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
            out = generate_ids(self.model, ids, max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                               stop_ids=stops, seed=seed, on_token=on_token, top_k=sampling.top_k,
                               repetition_penalty=sampling.repetition_penalty, images=images)
        elapsed = time.perf_counter() - started
        stopped = bool(out) and out[-1] in stops
        out = out[:-1] if stopped else out
        if on_text is not None and (rest := stream.flush()):
            on_text(rest)
        return Generated(list(out), self.tok.decode(list(out)), stopped, len(ids), elapsed, first[0] if first else 0.0)


def load_session(target: str, device: torch.device | None = None) -> Session:
    """Resolve `target` (RUN_DIR or PROFILE), load its model and tokenizer; the run folder read is marked as read
    (run_dir.reading_run) until they are loaded."""
    from moe_tune.engine.data.chat import chat_options
    from moe_tune.engine.data.tokenizer import load_tokenizer

    with ExitStack() as marks:
        loaded = resolve_target(target, marks)
        options = chat_options(loaded.profile.data)
        device = device or pick_device()
        tok = load_tokenizer(loaded.profile.tokenizer)
        if tok.vocab_size > loaded.profile.model.vocab_size:
            raise ProfileError([f"model.vocab_size ({loaded.profile.model.vocab_size}) must be >= the tokenizer's "
                                f"({tok.vocab_size})"])
        generation = read_generation_config(loaded.profile.model.checkpoint, loaded.profile.model.vocab_size)
        model = load_model(loaded, device)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    return Session(model, tok, loaded.profile, device, f"{loaded.note}; on {device.type}, {dtype}",
                   stop_ids(tok, loaded.profile, options, generation), options, generation,
                   max_positions(loaded.profile), loaded.notes)
