"""`moe-tune generate` on a checkpoint model chooses tokens as transformers' generate does on it: the checkpoint's
generation_config.json gives the defaults (do_sample, temperature, top_p, top_k, repetition_penalty) that the
options replace one by one, and its eos_token_id list stops a reply (config.json's where the checkpoint has no
generation_config.json); settings generate does not apply are named, values it cannot use refused in one line each;
a line says how tokens are chosen, another when the prompt passes the checkpoint's positions. A --chat turn's prompt
is the template's rendering of the whole conversation, the earlier replies as the template renders them."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch
import yaml
from typer.testing import CliRunner

from hf_tiny import THINKING_TEMPLATE, save_tiny_checkpoint, tiny_mixtral
from moe_tune.cli import app
from moe_tune.engine.generate.session import load_session

runner = CliRunner()
CPU = torch.device("cpu")
QWEN3_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
                  "eos_token_id": [5, 7]}
PROMPT = "Once upon a time"
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    """A tiny mixtral checkpoint (config.json: eos_token_id 2, max_position_embeddings 128) without
    generation_config.json."""
    checkpoint = save_tiny_checkpoint(tiny_mixtral(), tmp_path_factory.mktemp("generate-config") / "checkpoint")
    (checkpoint / "generation_config.json").unlink()
    return checkpoint


def profile_with(tmp_path, base_checkpoint, generation_config: dict | str | None) -> str:
    """A profile of the checkpoint's base model (its output.dir holds no run) whose checkpoint folder has
    `generation_config` as its generation_config.json (text as it is; None: no such file)."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(base_checkpoint, checkpoint)
    if generation_config is not None:
        text = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
        (checkpoint / "generation_config.json").write_text(text)
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "generate-config", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(tmp_path / "data.jsonl"), "tokenizer": "byte", "seq_len": 16},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-4}, "output": {"dir": str(tmp_path / "out")},
    }))
    return str(profile)


def shown(text: str) -> str:
    """`text` as the command prints it (terminal controls escaped)."""
    from moe_tune.cli.generate import write

    with contextlib.redirect_stdout(io.StringIO()) as out:
        write(text)
    return out.getvalue()


def generate(profile: str, *options: str):
    result = runner.invoke(app, ["generate", profile, "--prompt", PROMPT, "--max-new-tokens", str(NUM_TOKENS),
                                 *options])
    assert result.exit_code == 0, result.output
    return result


def test_generation_config_gives_the_defaults_the_options_replace(tmp_path, base_checkpoint):
    from moe_tune.engine.generate.session import Sampling

    profile = profile_with(tmp_path, base_checkpoint, QWEN3_DEFAULTS)
    checkpoint = tmp_path / "checkpoint"
    session = load_session(profile, device=CPU)
    assert session.generation.defaults == Sampling(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1)
    assert session.stop_ids == (257, 5, 7)
    ids = session.prompt(messages=[{"role": "user", "content": PROMPT}])

    def reply(**options) -> str:
        return shown(session.generate(ids, NUM_TOKENS, **options).text) + "\n"

    result = generate(profile)
    assert result.stderr.splitlines()[1] == (
        "decoding: sampled at temperature 0.6, top_p 0.95, top_k 20, seed 0; repetition_penalty 1.1; do_sample, "
        f"temperature, top_p, top_k, repetition_penalty from {checkpoint}/generation_config.json; stop ids: 257, 5, 7")
    sampled = reply(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1)
    assert result.stdout == sampled and sampled != reply(temperature=0, repetition_penalty=1)
    greedy = generate(profile, "--temperature", "0")
    assert greedy.stderr.splitlines()[1] == ("decoding: greedy; repetition_penalty 1.1; repetition_penalty from "
                                             f"{checkpoint}/generation_config.json; stop ids: 257, 5, 7")
    assert greedy.stdout == reply(temperature=0, repetition_penalty=1.1) != reply(temperature=0, repetition_penalty=1)
    plain = generate(profile, "--temperature", "1", "--top-p", "1", "--top-k", "0", "--repetition-penalty", "1")
    assert plain.stderr.splitlines()[1] == ("decoding: sampled at temperature 1, no top_p, no top_k, seed 0; stop "
                                            "ids: 257, 5, 7")
    assert plain.stdout == reply(temperature=1, top_p=1, top_k=0, repetition_penalty=1)


@pytest.mark.parametrize(
    "generation_config, line",
    [({"temperature": 0.6, "top_p": 0.9}, "decoding: greedy; stop ids: 257"),
     ({"do_sample": True}, "decoding: sampled at temperature 1, no top_p, no top_k, seed 0; do_sample from "
      "{checkpoint}/generation_config.json; stop ids: 257")],
    ids=["without-do-sample-greedy", "do-sample-at-temperature-1"],
)
def test_do_sample_decides_between_greedy_and_sampling_as_in_transformers(tmp_path, base_checkpoint,
                                                                           generation_config, line):
    """generation_config.json's do_sample (false when unset) decides, as transformers' generate reads it: its
    temperature alone samples nothing; do_sample alone samples at temperature 1. A file without eos_token_id stops
    at none (transformers reads config.json only where there is no generation_config.json)."""
    result = generate(profile_with(tmp_path, base_checkpoint, generation_config))
    assert result.stderr.splitlines()[1] == line.format(checkpoint=tmp_path / "checkpoint")


def test_config_json_eos_stops_where_there_is_no_generation_config(tmp_path, base_checkpoint):
    from moe_tune.engine.generate.session import Sampling

    session = load_session(profile_with(tmp_path, base_checkpoint, None), device=CPU)
    assert session.stop_ids == (257, 2) and session.generation.defaults == Sampling()


def test_settings_generate_does_not_apply_are_named(tmp_path, base_checkpoint):
    profile = profile_with(tmp_path, base_checkpoint, {"do_sample": True, "min_p": 0.05, "num_beams": 4,
                                                        "typical_p": 1.0, "no_repeat_ngram_size": 0})
    path = tmp_path / "checkpoint" / "generation_config.json"
    assert generate(profile).stderr.splitlines()[1:3] == [
        f"{path}: min_p (0.05) is not applied here (transformers' generate applies it)",
        f"{path}: num_beams (4) is not applied here (transformers' generate applies it)"]


@pytest.mark.parametrize(
    "generation_config, lines",
    [('{"top_p": 0.9,', ["{path}:1:15: not valid JSON (Expecting property name enclosed in double quotes)"]),
     ("[1]", ["{path}: must hold a JSON object, got list"]),
     ({"do_sample": "yes", "temperature": -1, "top_p": 0, "top_k": 2.5, "repetition_penalty": 0},
      ['{path}: do_sample ("yes") must be true or false', "{path}: temperature (-1) must be a finite number >= 0 (0: greedy)",
       "{path}: top_p (0) must be a number in (0, 1] (1: no nucleus filter)",
       "{path}: top_k (2.5) must be an integer >= 0 (0: no top-k filter)",
       "{path}: repetition_penalty (0) must be a finite number > 0 (1: none)"]),
     ({"eos_token_id": [2, 300]}, ["{path}: eos_token_id 300 must be in [0, 300) (the model's vocabulary)"]),
     ({"eos_token_id": "</s>"}, ['{path}: eos_token_id ("</s>") must be a token id or a list of token ids'])],
    ids=["not-json", "not-an-object", "bad-values", "eos-outside-vocabulary", "eos-not-an-id"],
)
def test_a_generation_config_generate_cannot_use_is_refused_in_one_line_each(tmp_path, base_checkpoint,
                                                                             generation_config, lines):
    profile = profile_with(tmp_path, base_checkpoint, generation_config)
    result = runner.invoke(app, ["generate", profile, "--prompt", PROMPT])
    assert result.exit_code == 2, result.output
    path = tmp_path / "checkpoint" / "generation_config.json"
    assert result.stderr.strip().splitlines() == [f"error: {line.format(path=path)}" for line in lines]
    assert "Traceback" not in result.output and result.stdout == ""


@pytest.mark.parametrize("option, value, message", [
    ("--top-k", "-1", "--top-k (-1) must be an integer >= 0 (0: no top-k filter)"),
    ("--repetition-penalty", "0", "--repetition-penalty (0.0) must be a finite number > 0 (1: none)"),
    ("--repetition-penalty", "nan", "--repetition-penalty (nan) must be a finite number > 0 (1: none)"),
])  # fmt: skip
def test_bad_top_k_and_repetition_penalty_exit_2_before_the_model_loads(tmp_path, base_checkpoint, option, value,
                                                                        message):
    result = runner.invoke(app, ["generate", str(tmp_path / "none"), "--prompt", PROMPT, option, value])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [f"error: {message}"], result.output


def test_a_prompt_past_the_checkpoints_positions_is_named_and_decoded(tmp_path, base_checkpoint):
    """A prompt and reply past config.json's max_position_embeddings (128) decode, as transformers' generate decodes
    them, with a line saying so before the reply."""
    profile = profile_with(tmp_path, base_checkpoint, None)
    result = runner.invoke(app, ["generate", profile, "--raw", "--prompt", "x" * 120, "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[2] == (
        "note: the prompt (121 tokens) and up to 8 new tokens pass the checkpoint's max_position_embeddings (128); "
        "positions beyond it run as transformers runs them, untrained")
    short = runner.invoke(app, ["generate", profile, "--raw", "--prompt", "x" * 119, "--max-new-tokens", "8"])
    assert short.exit_code == 0 and "max_position_embeddings" not in short.stderr




def test_a_chat_turn_is_the_whole_conversation_rendered_by_the_template(tmp_path, monkeypatch):
    """Each --chat turn renders the whole conversation (the system message, every turn, the earlier replies as
    decoded without their stop token) with the generation prompt: apply_chat_template's ids, the earlier reply's
    think block dropped as the template drops it; each turn prefills from an empty cache."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import moe_tune.engine.generate.session as session_module
    from moe_tune.profiles import load_profile

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    core = Tokenizer(models.WordLevel({"<unk>": 0} | {c: i + 1 for i, c in enumerate(chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    raw = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>")
    raw.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    raw.chat_template = THINKING_TEMPLATE
    raw.save_pretrained(str(tmp_path / "tokenizer"))
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    job = load_profile("tiny", [f"data.path={tmp_path / 'data.jsonl'}", f"data.tokenizer={tmp_path / 'tokenizer'}",
                                f"output.dir={tmp_path / 'out'}"])
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json")))
    answer = "<think>\nrouting\n</think>\n\nThe router."
    prompts = []

    def scripted(model, prompt_ids, max_new_tokens, stop_ids=(), on_token=None, **options):
        prompts.append(list(prompt_ids))
        out = raw.encode(answer, add_special_tokens=False) + [raw.eos_token_id]
        for token in out:
            on_token(token)
        return out

    monkeypatch.setattr(session_module, "generate_ids", scripted)
    result = runner.invoke(app, ["generate", str(tmp_path / "profile.yaml"), "--chat", "--system", "Be brief."],
                           input="Who routes?\nAnd then?\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{answer}\n{answer}\n"
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who routes?"}]
    second = conversation + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    assert prompts == [raw.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"] for turns in (conversation, second)]
    assert "routing" not in raw.decode(prompts[1]) and "The router." in raw.decode(prompts[1])
