"""`moe-tune generate RUN_DIR|PROFILE`: the run's final weights load (LoRA merged, full fine-tune), the prompt is
rendered as training renders a conversation up to the assistant's reply, the reply streams as it is generated (never
half a character, never a piece of a word twice), a chat keeps its history, and bad input is one line, exit 2, no
traceback. (Token parity with transformers: tests/engine/families/test_generate_parity.py.)"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import yaml
from test_export_cli import finetunes_start_before, rewrite
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.data.chat import ChatOptions, chat_tokens
from moe_tune.engine.data.tokenizer import ByteTokenizer, load_tokenizer
from moe_tune.engine.generate.session import TextStream, load_session, prompt_ids, resolve_target, stop_ids
from moe_tune.profiles import load_profile

runner = CliRunner()
CPU = torch.device("cpu")
SPEED_LINE = re.compile(r"^\d+ tokens in \d+\.\d\d s \(\d+\.\d tokens/s after the first")


def tiny_job(out, lora: bool = True):
    overrides = ["train.steps=2", "train.warmup_steps=1", "data.seq_len=32", f"output.dir={out}"]
    return load_profile("tiny", overrides + ([] if lora else ["lora.enabled=false"]))


def write_run(out, lora: bool = True):
    """A finished run of the tiny profile written without training (training costs ~20 s): profile.yaml,
    summary.json and the final weights as the trainer saves them, the adapters' B factors random (LoRA, the LM head
    trained in full as the profile says) or every weight perturbed (full fine-tune). Returns (profile, the model with
    those weights, unmerged)."""
    from safetensors.torch import save_file

    from moe_tune.engine.lora import inject_lora
    from moe_tune.engine.model.model import build_model

    job = tiny_job(out, lora)
    out.mkdir(parents=True)
    (out / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    (out / "summary.json").write_text(json.dumps({"last_step": 2, "interrupted_by": None}) + "\n")
    model = build_model(job.model)
    gen = torch.Generator().manual_seed(1)
    if not lora:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(out / "model.safetensors"))
        return job, model.eval()
    model = inject_lora(model, job.lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
            elif "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    model.save_pretrained(str(out / "adapter"), safe_serialization=True)
    return job, model.eval()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("generate") / "run"
    job, model = write_run(out)
    return out, model


@pytest.fixture(scope="module")
def session(lora_run):
    return load_session(str(lora_run[0]), device=CPU)


def logits_of(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.tensor([0, len(ids)], dtype=torch.int32)).logits[0]


def test_the_runs_final_weights_are_loaded(lora_run, session, tmp_path):
    run, trained = lora_run
    ids = list(b"The final weights")
    assert session.note.startswith(f"model: the run in {run} (LoRA adapters merged, step 2); on cpu, float32")
    torch.testing.assert_close(logits_of(session.model, ids), logits_of(trained, ids), rtol=0, atol=1e-4)
    _, full = write_run(tmp_path / "full", lora=False)
    full_session = load_session(str(tmp_path / "full"), device=CPU)
    assert "(full fine-tune, step 2)" in full_session.note
    torch.testing.assert_close(logits_of(full_session.model, ids), logits_of(full, ids), rtol=0, atol=1e-5)


def test_prompt_streams_the_reply_and_prints_the_speed(lora_run, session):
    run, _ = lora_run
    result = runner.invoke(app, ["generate", str(run), "--prompt", "Once upon a time", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"model: the run in {run}") and SPEED_LINE.match(lines[-1]), lines
    assert "Traceback" not in result.output
    # The same greedy reply as the engine gives, controls escaped; the pieces arrive one by one.
    pieces = []
    expected = session.generate(session.prompt(messages=[{"role": "user", "content": "Once upon a time"}]), 8,
                                on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == expected.text
    from moe_tune.cli.generate import write

    assert f"{len(expected.ids)} tokens in" in lines[-1]
    with pytest.MonkeyPatch.context() as patch:
        written = []
        patch.setattr("sys.stdout.write", written.append)
        write(expected.text)
    assert result.stdout == written[0] + "\n"


def test_chat_keeps_the_history_and_ends_on_an_empty_line(lora_run, monkeypatch):
    from moe_tune.engine.generate.session import Session

    run, _ = lora_run
    asked = []
    original = Session.prompt
    monkeypatch.setattr(Session, "prompt", lambda self, messages=None, text=None, **images: asked.append(
        [dict(m) for m in messages]) or original(self, messages, text, **images))
    result = runner.invoke(app, ["generate", str(run), "--chat", "--max-new-tokens", "3", "--system", "Be brief."],
                           input="first\nsecond\n\nnever read\n")
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[1:3] == ["decoding: greedy; stop ids: 257",
                          "chat: type a message and press Enter; an empty line or end of input (Ctrl-D) ends"]
    assert sum(bool(SPEED_LINE.match(line)) for line in lines) == 2
    roles = [[m["role"] for m in turn] for turn in asked]
    assert roles == [["system", "user"], ["system", "user", "assistant", "user"]]
    assert asked[1][:2] == asked[0] and asked[1][3]["content"] == "second"


@pytest.mark.parametrize("stdin, line", [
    (b"fine\n\xff\xfe hi\n", "error: stdin line 2: not UTF-8 text (byte 0xff at byte 1)"),
    (b"caf\xe9\n", "error: stdin line 1: not UTF-8 text (byte 0xe9 at byte 4)"),
])  # fmt: skip
def test_a_chat_line_that_is_not_utf8_ends_the_chat_in_one_line(lora_run, stdin, line):
    run, _ = lora_run
    result = runner.invoke(app, ["generate", str(run), "--chat", "--max-new-tokens", "2"], input=stdin)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == line and "Traceback" not in result.output


def test_a_chat_line_past_its_bound_ends_the_chat_in_one_line(lora_run, monkeypatch):
    """A line is read up to MAX_LINE_BYTES, never whole: /dev/zero on stdin (no newline ever) would fill memory."""
    import moe_tune.cli.generate as generate

    monkeypatch.setattr(generate, "MAX_LINE_BYTES", 8)
    result = runner.invoke(app, ["generate", str(lora_run[0]), "--chat", "--max-new-tokens", "2"],
                           input=b"ok\n" + b"\0" * 9)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == "error: stdin line 2: longer than 8 bytes, the most a --chat " \
                                                     "turn may be"


def test_ctrl_c_ends_the_reply_without_a_traceback(lora_run, monkeypatch):
    from moe_tune.engine.generate.session import Session

    def interrupted(self, ids, max_new_tokens, on_text=None, **options):
        on_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "generate", interrupted)
    result = runner.invoke(app, ["generate", str(lora_run[0]), "--prompt", "x"])
    assert result.exit_code == 130 and result.stdout == "partial\n" and "Traceback" not in result.output


def stream_all(decode, ids) -> list[str]:
    stream = TextStream(decode)
    return [stream.push(i) for i in ids] + [stream.flush()]


@pytest.mark.parametrize("text", ["plain ascii", "é漢字🙂 mixed", "🙂", "a\u202eb\n\tc"],
                         ids=["ascii", "multibyte", "emoji", "controls"])
def test_stream_never_prints_half_a_character(text):
    tok = ByteTokenizer()
    pieces = stream_all(tok.decode, tok.encode(text))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_stream_prints_each_word_piece_once_with_its_space():
    # A SentencePiece-like decoder: "▁" is a space, dropped at the start of the decoded text only.
    vocab = ["▁Hello", "▁wor", "ld", "!", "▁again"]

    def decode(ids):
        return "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")

    pieces = stream_all(decode, [0, 1, 2, 3, 4])
    assert pieces[:5] == ["Hello", " wor", "ld", "!", " again"] and "".join(pieces) == "Hello world! again"


def test_stream_holds_invalid_bytes_until_the_end():
    tok = ByteTokenizer()
    assert "".join(stream_all(tok.decode, [0xE6, 0xBC, ord("a")])) == "\ufffda"
    assert stream_all(tok.decode, [0xE6, 0xBC]) == ["", "", "\ufffd"]


QWEN_LIKE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
REPLY = {"role": "assistant", "content": "Hello!"}


def char_tokenizer(directory, eos: str, bos: str | None = None):
    """A character-level tokenizer with <|im_start|> / <|im_end|> and a Qwen-like chat template, saved offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    core = Tokenizer(models.WordLevel({"<unk>": 0} | {c: i + 1 for i, c in enumerate(chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token=eos, bos_token=bos)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tok.chat_template = QWEN_LIKE
    tok.save_pretrained(directory)
    return load_tokenizer(str(directory)), tok


def assert_prompt_opens_the_training_document(tok, options=ChatOptions()):
    """The prompt is the training document of the conversation with the reply, up to the reply's content."""
    prompt = prompt_ids(tok, CONVERSATION, options=options)
    document, _ = chat_tokens(tok.render_chat(CONVERSATION + [REPLY], "record", options), tok, True, options)
    assert document[: len(prompt)] == prompt and tok.decode(document[len(prompt):]).startswith("Hello!")
    return prompt


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"], ids=["chat-eos", "base-eos"])
def test_the_prompt_is_the_templates_with_the_generation_prompt(tmp_path, eos):
    tok, raw = char_tokenizer(tmp_path, eos)
    prompt = assert_prompt_opens_the_training_document(tok)
    assert prompt == raw.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    job = tiny_job(tmp_path / "out")
    ends = stop_ids(tok, job)
    assert set(ends) == {raw.convert_tokens_to_ids("<|im_end|>"), raw.convert_tokens_to_ids(eos)}


def test_the_prompt_of_the_built_in_format_and_of_a_profile_template():
    tok = ByteTokenizer()
    prompt = assert_prompt_opens_the_training_document(tok)
    assert prompt[0] == tok.bos_id
    assert tok.decode(prompt) == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    assert_prompt_opens_the_training_document(tok, ChatOptions(template=QWEN_LIKE))
    assert prompt_ids(tok, text="raw text") == [tok.bos_id, *b"raw text"]
    assert stop_ids(tok, tiny_job("unused")) == (tok.eos_id,)


def test_a_profile_means_its_finished_run_else_its_base_model(lora_run, tmp_path):
    run, _ = lora_run
    base = (f"model: the base model of {{profile}} (its seeded random init, model.seed 0, untrained); output.dir "
            f"{tmp_path / 'none'} holds no run")
    for out, expected in [(run, f"model: the run in output.dir {run} (LoRA adapters merged, step 2)"),
                          (tmp_path / "none", base)]:
        profile = tmp_path / "p.yaml"
        profile.write_text(yaml.safe_dump(tiny_job(out).model_dump(mode="json")))
        loaded = resolve_target(str(profile))
        assert loaded.note == expected.format(profile=profile)
        assert loaded.run_dir == (run if out == run else None)


@pytest.mark.parametrize(("changes", "shown"), [
    ({}, None),
    # What generate does not read: the training, the data, the outputs (output.dir spelled otherwise found the run).
    ({"train.lr": 0.001, "data.seq_len": 64, "output.save_every": 1, "output.dir": "ABSOLUTE", "name": "other"}, None),
    ({"lora.r": 8, "data.seq_len": 64}, "lora.r 16 ({profile} says 8)"),
    ({"train.precision": "bf16"}, 'train.precision "fp32" ({profile} says "bf16")'),
    ({"lora.r": 8, "lora.alpha": 4, "model.seed": 3, "lora.experts": False, "train.precision": "bf16", "train.lr": 0.1},
     "model.seed 0, lora.r 16, lora.alpha 32.0, lora.experts true and 1 more ({profile} says 3, 8, 4.0, false)"),
])  # fmt: skip
def test_a_profile_that_differs_from_its_run_names_the_settings_and_builds_the_runs(lora_run, tmp_path, changes,
                                                                                      shown):  # fmt: skip
    """generate PROFILE takes the run in output.dir as it was trained: a line names the settings (the first four and
    how many more) the PROFILE now gives otherwise, none when it gives the run's."""
    run, _ = lora_run
    settings = tiny_job(run).model_dump(mode="json")
    for key, value in changes.items():
        value = str(run.resolve()) if value == "ABSOLUTE" else value
        if "." in key:
            section, name = key.split(".")
            settings[section][name] = value
        else:
            settings[key] = value
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(settings))
    loaded = resolve_target(str(profile))
    expected = f"note: the run was trained with {(shown or '').format(profile=profile)}; generate builds the model as "
    expected += "the run did"
    assert loaded.notes == (() if shown is None else (expected,))
    assert loaded.profile.lora.r == 16 and loaded.profile.data.seq_len == 32 and loaded.run_dir == run
    result = runner.invoke(app, ["generate", str(profile), "--prompt", "hi", "--max-new-tokens", "1"])
    assert result.exit_code == 0, result.output
    assert (expected in result.stderr.splitlines()) == (shown is not None)


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/none", "--prompt", "x"], "{tmp}/none: no such run folder or profile file, nor a shipped profile"),
        (["{tmp}", "--prompt", "x"], "{tmp}: no run here (no profile.yaml; RUN_DIR must be a finetune output.dir)"),
        (["{unfinished}", "--prompt", "x"], "{unfinished}: no final weights (no adapter/adapter_model.safetensors): "
         "the run did not finish; finish it with `moe-tune finetune PROFILE --resume`, or write checkpoint step 2 for "
         "transformers with `moe-tune export {unfinished} --step 2`"),
        (["{locked}", "--prompt", "x"], "{locked}: a run holds this folder (.lock); generate from it once the run has ended"),
        (["{tmp}/bad.yaml", "--prompt", "x"], "model: required field is missing"),
        (["{run}", "--prompt", "x", "--chat"], "give --prompt TEXT or --chat (one of them)"),
        (["{run}"], "give --prompt TEXT or --chat (one of them)"),
        (["{run}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens (0) must be >= 1"),
        (["{run}", "--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens (-3) must be >= 1"),
        (["{run}", "--prompt", "x", "--temperature", "-0.5"], "--temperature (-0.5) must be a finite number >= 0"),
        (["{run}", "--prompt", "x", "--temperature", "nan"], "--temperature (nan) must be a finite number >= 0"),
        (["{run}", "--prompt", "x", "--temperature", "inf"], "--temperature (inf) must be a finite number >= 0"),
        (["{run}", "--prompt", "x", "--top-p", "0"], "--top-p (0.0) must be a number in (0, 1] (1: no nucleus filter)"),
        (["{run}", "--prompt", "x", "--top-p", "1.01"], "--top-p (1.01) must be a number in (0, 1] (1: no nucleus filter)"),
        (["{run}", "--prompt", "x", "--top-p", "nan"], "--top-p (nan) must be a number in (0, 1] (1: no nucleus filter)"),
        (["{run}", "--prompt", "x", "--seed", "-1"], "--seed (-1) must be in [0, 2**64)"),
        (["{run}", "--prompt", "x", "--seed", str(2**64)], f"--seed ({2**64}) must be in [0, 2**64)"),
        (["{run}", "--prompt", "x", "--seed", "99999999999999999999999"],
         "--seed (99999999999999999999999) must be in [0, 2**64)"),
        (["{run}", "--chat", "--raw"], "--raw sends one prompt as it is; --chat renders turns"),
        (["{run}", "--prompt", "x", "--raw", "--system", "s"], "--system needs the chat template"),
        (["{run}", "--prompt", "caf\udce9"], "--prompt: not UTF-8 text (the command line's byte 0xe9 at character 4)"),
        (["{run}", "--prompt", "\udcff", "--raw"], "--prompt: not UTF-8 text (the command line's byte 0xff at "),
        (["{run}", "--chat", "--system", "\udc80 be brief"], "--system: not UTF-8 text (the command line's byte 0x80"),
        (["{run}", "--prompt", ""], "--prompt ('') is empty or only whitespace (an unset shell variable?)"),
        (["{run}", "--prompt", " \n\t", "--raw"], "--prompt (' \\n\\t') is empty or only whitespace"),
    ],
    ids=["no-folder", "no-run", "unfinished", "locked", "bad-profile", "prompt-and-chat", "neither", "max-new-0",
         "max-new-negative", "temperature-negative", "temperature-nan", "temperature-inf", "top-p-0", "top-p-above-1",
         "top-p-nan", "seed-negative", "seed-2**64", "seed-huge", "raw-chat", "raw-system", "prompt-not-utf8",
         "raw-prompt-not-utf8", "system-not-utf8", "prompt-empty", "raw-prompt-blank"],
)
def test_bad_input_exits_2_in_one_line(lora_run, tmp_path, args, message):
    run, _ = lora_run
    unfinished, locked = tmp_path / "unfinished", tmp_path / "locked"
    for folder in (unfinished, locked):
        folder.mkdir()
        shutil.copy(run / "profile.yaml", folder)
    (unfinished / "checkpoints" / "step-0000002").mkdir(parents=True)
    shutil.copytree(run / "adapter", locked / "adapter")
    (locked / ".lock").write_text("{}")
    (tmp_path / "bad.yaml").write_text("name: bad\nbogus: 1\n")
    fill = {"tmp": tmp_path, "run": run, "unfinished": unfinished, "locked": locked}
    result = runner.invoke(app, ["generate", *(a.format(**fill) for a in args)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: " + message.format(**fill)), lines
    assert all(line.startswith("error: ") for line in lines) and (len(lines) == 1 or "bad.yaml" in args[0]), lines
    assert "Traceback" not in result.output and result.stdout == ""


def test_a_run_killed_on_this_host_answers(lora_run, tmp_path):
    """A run stopped with SIGKILL leaves its lock, naming a pid that is gone: no run holds the folder."""
    import socket
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(lora_run[0], run)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run / ".lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "started": "2026-01-01"}))
    result = runner.invoke(app, ["generate", str(run), "--prompt", "x", "--max-new-tokens", "1"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == f"model: the run in {run} (LoRA adapters merged, step 2); on cpu, float32"


@pytest.mark.parametrize("given", ["run", "profile"])
def test_a_finetune_into_the_run_is_refused_while_generate_loads_it(lora_run, tmp_path, monkeypatch, given):
    """generate marks the run whose weights it takes (RUN_DIR, or a profile's output.dir) until the model is loaded,
    as export does: a finetune --overwrite or --resume starting meanwhile is refused, and the mark goes with the
    load."""
    import moe_tune.engine.generate.session as session_module

    run = tmp_path / "run"
    shutil.copytree(lora_run[0], run)
    target = run
    if given == "profile":
        target = tmp_path / "p.yaml"
        target.write_text(yaml.safe_dump(tiny_job(run).model_dump(mode="json")))
    refusals, expected = [], []
    monkeypatch.setattr(session_module, "load_model",
                        finetunes_start_before(session_module.load_model, run, "generate", refusals, expected))
    result = runner.invoke(app, ["generate", str(target), "--prompt", "x", "--max-new-tokens", "1"])
    assert result.exit_code == 0, result.output
    assert refusals == expected * 2 and len(refusals) == 2
    assert not list(run.glob(".lock.reader-*"))


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, 10**23], ids=["-1", "-2**63", "2**64", "10**23"])
def test_a_seed_torch_cannot_take_is_refused_before_the_model_loads(lora_run, monkeypatch, seed):
    def no_load(target, device=None):
        raise AssertionError("the model loaded")

    monkeypatch.setattr("moe_tune.engine.generate.session.load_session", no_load)
    result = runner.invoke(app, ["generate", str(lora_run[0]), "--prompt", "x", "--temperature", "1", "--seed",
                                 str(seed)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: --seed ({seed}) must be in [0, 2**64) (the sampling "
                                                  "generator's seeds)"]


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1], ids=["0", "2**63", "2**64-1"])
def test_every_seed_below_2_to_the_64_samples(session, seed):
    ids = session.prompt(text="seed")
    first = session.generate(ids, 4, temperature=1.0, seed=seed, stop=False).ids
    assert len(first) == 4 and session.generate(ids, 4, temperature=1.0, seed=seed, stop=False).ids == first


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_the_engine_refuses_a_seed_torch_cannot_take(session, seed):
    from moe_tune.profiles import ProfileError

    with pytest.raises(ProfileError, match=re.escape(f"seed ({seed}) must be in [0, 2**64)")):
        session.generate(session.prompt(text="seed"), 2, temperature=1.0, seed=seed)


@pytest.mark.parametrize(
    "temperature",
    [1e-300, 5e-324, 1e-45, 1e-40],
    ids=["1e-300", "fp64-smallest", "below-fp32-smallest", "fp32-subnormal"],
)
def test_a_tiny_temperature_samples_the_greedy_tokens(session, temperature):
    ids = session.prompt(text="Once upon a time")
    greedy = session.generate(ids, 6).ids
    for seed in range(3):
        assert session.generate(ids, 6, temperature=temperature, seed=seed).ids == greedy


def test_a_tiny_temperature_on_the_command_line_is_greedy(lora_run):
    run, _ = lora_run
    args = ["generate", str(run), "--prompt", "Once upon a time", "--max-new-tokens", "6"]
    greedy = runner.invoke(app, args)
    tiny = runner.invoke(app, [*args, "--temperature", "1e-300", "--seed", "5"])
    assert greedy.exit_code == 0 and tiny.exit_code == 0, tiny.output
    assert tiny.stdout == greedy.stdout and "Traceback" not in tiny.output


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30])
def test_a_tiny_temperature_draws_among_the_tied_maxima_only(temperature):
    from moe_tune.engine.generate.decode import choose_token

    logits_V = torch.tensor([0.0, 3.0, -2.0, 3.0, 2.9999998, -float("inf")])
    drawn = {choose_token(logits_V, temperature, 1.0, torch.Generator().manual_seed(s)) for s in range(64)}
    assert drawn == {1, 3}


def damage_final_weights(run, damage):
    """Apply `damage(path)` to the run's final weights file (adapter or model.safetensors); returns its path."""
    path = run / ("adapter/adapter_model.safetensors" if (run / "adapter").is_dir() else "model.safetensors")
    damage(path)
    return path


def truncated_to(keep):
    def damage(path):
        data = path.read_bytes()
        path.write_bytes(data[: keep(len(data), 8 + int.from_bytes(data[:8], "little"))])
    return damage


A_FACTOR = "base_model.model.layers.0.self_attn.q_proj.lora_A.weight"


def poisoned(tensors):
    tensors[A_FACTOR].view(-1)[0] = float("nan")


def grown(tensors):
    tensors[A_FACTOR] = torch.cat([tensors[A_FACTOR], tensors[A_FACTOR][:1]])


@pytest.mark.parametrize(
    "lora, damage, message",
    [
        (True, truncated_to(lambda size, header: 100), "not a readable safetensors file ("),
        (True, truncated_to(lambda size, header: header // 2), "not a readable safetensors file ("),
        (True, truncated_to(lambda size, header: size - 1), "not a readable safetensors file ("),
        (True, rewrite(poisoned), f"tensor {A_FACTOR} holds non-finite values"),
        (True, rewrite(grown), f"tensor {A_FACTOR} has shape ({{rank_plus_1}}, {{width}}), expected ({{rank}}, "
         "{width}) ("),
        (False, truncated_to(lambda size, header: 100), "not a readable safetensors file ("),
        (False, truncated_to(lambda size, header: size - 1), "not a readable safetensors file ("),
    ],
    ids=["adapter-cut-at-100", "adapter-cut-in-header", "adapter-cut-in-data", "adapter-nan", "adapter-shape",
         "weights-cut-at-100", "weights-cut-in-data"],
)
def test_damaged_final_weights_are_named_in_one_line(lora_run, tmp_path, lora, damage, message):
    if lora:
        run = tmp_path / "run"
        shutil.copytree(lora_run[0], run)
    else:
        run = tmp_path / "full"
        write_run(run, lora=False)
    job = tiny_job(run)
    fill = {"rank": job.lora.r, "rank_plus_1": job.lora.r + 1, "width": job.model.hidden_size}
    path = damage_final_weights(run, damage)
    result = runner.invoke(app, ["generate", str(run), "--prompt", "x", "--max-new-tokens", "2"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {message.format(**fill)}"), lines
    assert "Traceback" not in result.output and result.stdout == ""


# The tiny profile with an FP8 base (its linear layers 128 wide, the FP8 block), LoRA on attention and the MLPs.
FP8_TINY = [
    "model.hidden_size=128", "model.layers=[{attention: full, mlp: dense}, {attention: full, mlp: moe}]",
    "model.intermediate_size=128", "model.head_dim=32", "model.partial_rotary_factor=1.0",
    "model.attention_output_gate=false", "model.moe.num_experts=4", "model.moe.expert_intermediate_size=160",
    "model.moe.shared_expert_intermediate_size=0", "model.base_precision=fp8", "lora.modules_to_save=[]",
    "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
]


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """A finished LoRA run on an FP8 base (generate keeps the base FP8 and loads adapter/ through PEFT), written
    without training."""
    from moe_tune.engine.lora import inject_lora
    from moe_tune.engine.model.model import build_model

    out = tmp_path_factory.mktemp("generate-fp8") / "run"
    job = load_profile("tiny", ["train.steps=2", "train.warmup_steps=1", "data.seq_len=32", f"output.dir={out}",
                                *FP8_TINY])
    out.mkdir(parents=True)
    (out / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    (out / "summary.json").write_text(json.dumps({"last_step": 2, "interrupted_by": None}) + "\n")
    inject_lora(build_model(job.model), job.lora).save_pretrained(str(out / "adapter"), safe_serialization=True)
    return out


FP8_FACTOR = "base_model.model.layers.1.self_attn.o_proj.lora_B.weight"


@pytest.mark.parametrize(
    "damage, message",
    [
        (None, None),
        (truncated_to(lambda size, header: 100), "not a readable safetensors file ("),
        (truncated_to(lambda size, header: size - 1), "not a readable safetensors file ("),
        (rewrite(lambda t: t[FP8_FACTOR].view(-1).__setitem__(0, float("inf"))),
         f"tensor {FP8_FACTOR} holds non-finite values"),
        (rewrite(lambda t: t.update({FP8_FACTOR: t[FP8_FACTOR][:, :-1].clone()})),
         f"tensor {FP8_FACTOR} has shape (128, {{rank_minus_1}}), expected (128, {{rank}}) ("),
    ],
    ids=["intact", "cut-at-100", "cut-in-data", "inf", "shape"],
)
def test_an_fp8_base_runs_adapter_is_checked_as_export_checks_it(fp8_run, tmp_path, damage, message):
    run = tmp_path / "run"
    shutil.copytree(fp8_run, run)
    path = damage_final_weights(run, damage) if damage is not None else None
    result = runner.invoke(app, ["generate", str(run), "--prompt", "x", "--max-new-tokens", "2"])
    if damage is None:
        assert result.exit_code == 0 and "FP8 base with its LoRA adapters beside it" in result.stderr, result.output
        return
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    rank = load_profile(str(run / "profile.yaml")).lora.r
    message = message.format(rank=rank, rank_minus_1=rank - 1)
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {message}"), lines
    assert "Traceback" not in result.output and result.stdout == ""


@pytest.mark.parametrize("linked", ["adapter", "adapter/adapter_model.safetensors", "profile.yaml"])
@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_run_file_leading_out_of_the_run_folder_is_refused(lora_run, tmp_path, linked, command):
    """A run's files are read only inside its folder: a link in it to another run's adapter (or profile) is one line
    naming it, exit 2, for generate and export alike."""
    source, _ = lora_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    elsewhere = tmp_path / "elsewhere" / linked
    elsewhere.parent.mkdir(parents=True)
    (run / linked).rename(elsewhere)
    (run / linked).symlink_to(elsewhere, target_is_directory=elsewhere.is_dir())
    args = ["generate", str(run), "--prompt", "Ada"] if command == "generate" else ["export", str(run)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: {run / linked}: leads to {str(elsewhere)!r}, outside the run folder; a run's files are read and "
        "written only inside it"]


def test_a_run_whose_data_file_is_gone_or_named_from_elsewhere_still_generates(lora_run, tmp_path):
    """generate and export read no data: a run's profile.yaml naming a data file since moved, or named relative to
    the folder it trained from, is taken as it is (it refused, and generate PROFILE fell back to the base model)."""
    import shutil

    run, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    settings = yaml.safe_load((copy / "profile.yaml").read_text())
    settings["data"]["path"] = "gone/d.jsonl"
    settings["output"]["dir"] = str(copy)
    (copy / "profile.yaml").write_text(yaml.safe_dump(settings))
    loaded = resolve_target(str(copy))
    assert loaded.run_dir == copy and str(loaded.profile.data.path) == "gone/d.jsonl"
    from moe_tune.engine.export.sources import read_run

    assert read_run(copy, need_final=False).profile == loaded.profile


def test_a_profile_whose_output_dir_holds_an_unfinished_run_is_refused(lora_run, tmp_path):
    """Not the base model in its place: the run is what the profile names."""
    import shutil

    run, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "adapter" / "adapter_model.safetensors").unlink()
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(tiny_job(copy).model_dump(mode="json")))
    result = runner.invoke(app, ["generate", str(profile), "--prompt", "hi", "--max-new-tokens", "1"])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {copy}: no final weights (no adapter/adapter_model.safetensors): the run did not "
                           "finish")
