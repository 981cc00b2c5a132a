"""`moe-tune generate RUN_DIR|PROFILE`: try a fine-tuned model; the reply streams to stdout as it is generated, the
model note and the speed go to stderr."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from moe_tune.profiles import escape_controls, not_utf8

from . import INTERRUPTED_EXIT
from ._common import err_console, fail, user_errors

if TYPE_CHECKING:
    from moe_tune.engine.generate.decode import PromptImages

app = typer.Typer()

# A --chat turn read from stdin is at most this long (a pasted document fits; /dev/zero on stdin would fill memory).
MAX_LINE_BYTES = 16 * 2**20


@app.command()
def generate(
    target: Annotated[
        str, typer.Argument(help="a finetune output.dir, or a profile (YAML path or shipped name): the run in its "
                            "output.dir when finished, else its base model")
    ],
    prompt: Annotated[str | None, typer.Option("--prompt", help="one prompt; the reply is printed")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="talk on stdin, turn by turn, history kept")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="tokens generated at most per reply")] = 256,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", help="0: greedy; > 0 samples from softmax(logits / T), any T > 0 (tending to greedy as T "
        "tends to 0). Default: the checkpoint's generation_config.json (do_sample, temperature), else 0")] = None,
    top_p: Annotated[float | None, typer.Option(
        "--top-p", help="sample from the smallest set of tokens holding this probability mass, in (0, 1]. Default: "
        "generation_config.json's top_p, else 1")] = None,
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="sample from the k likeliest tokens (0: all). Default: generation_config.json's top_k, else "
        "0")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(
        "--repetition-penalty", help="divide the positive logits of tokens already in the sequence by this (multiply "
        "the negative ones), greedy or sampled; 1: none. Default: generation_config.json's, else 1")] = None,
    seed: Annotated[int, typer.Option("--seed", help="the sampling generator's seed, in [0, 2**64)")] = 0,
    system: Annotated[str | None, typer.Option("--system", help="a system message before the conversation")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="the prompt as it is after <bos>, no chat template (for models "
                                      "trained on plain text)")] = False,
    image: Annotated[list[Path] | None, typer.Option(
        "--image", help="an image file the model sees before the text of the (first) user message; repeat for "
        "several. For models with a vision tower")] = None,
) -> None:
    """Generate from a run's final weights (LoRA adapters merged) with the chat template applied; cached decoding
    (key/value caches, recurrent states). Tokens are chosen as transformers' generate chooses them: the checkpoint's
    generation_config.json gives the defaults, each option given replaces one; greedy without either."""
    from moe_tune.engine.generate.session import option_problems

    problems = []
    if (prompt is None) == (not chat):
        problems.append("give --prompt TEXT or --chat (one of them)")
    if prompt is not None and not prompt.strip():
        problems.append(f"--prompt ({prompt!r}) is empty or only whitespace (an unset shell variable?): give the text "
                        "to answer or, with --raw, to continue")
    if chat and raw:
        problems.append("--raw sends one prompt as it is; --chat renders turns through the chat template: give one")
    if raw and system is not None:
        problems.append("--system needs the chat template; --raw sends the prompt as it is: give one")
    if raw and image:
        problems.append("--image places images in a user message of the chat template; --raw sends the prompt as it "
                        "is: give one")
    problems += option_problems(max_new_tokens, temperature, top_p, seed, top_k, repetition_penalty)
    problems += [f"{name}: not UTF-8 text ({what})" for name, text in (("--prompt", prompt), ("--system", system))
                 if text is not None and (what := not_utf8(text)) is not None]  # fmt: skip
    if problems:
        fail(problems)

    from moe_tune.engine.generate.session import load_session, read_prompt_images

    with user_errors():
        session = load_session(target)
        images = read_prompt_images(image, session.profile) if image else None
    options = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty}
    sampling = session.sampling(**options)
    given = tuple(name for name, value in options.items() if value is not None)
    lines = [session.note, *session.notes, *session.generation.unapplied, session.decoding_note(sampling, seed, given)]
    if images is not None:
        lines.append(session.images_note(images))
    for line in lines:
        err_console.print(escape_controls(line), markup=False, highlight=False)
    base = [{"role": "system", "content": system}] if system is not None else []
    options = dict(max_new_tokens=max_new_tokens, seed=seed, **vars(sampling))
    try:
        if chat:
            converse(session, base, options, images)
        else:
            with user_errors():
                messages = base + [user_message(prompt, images)]
                ids = session.prompt(text=prompt) if raw else session.prompt(messages=messages, images=images)
            reply(session, ids, stop=True, images=images, **options)
    except KeyboardInterrupt:
        # Ctrl-C stops the reply or the chat: no traceback, the shell's code for SIGINT.
        write("\n")
        raise typer.Exit(code=INTERRUPTED_EXIT) from None


def user_message(text: str, images: PromptImages | None) -> dict:
    """A user turn; with images, their parts before the text (as transformers' chat examples place them)."""
    if images is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"}] * len(images.grids) + [{"type": "text", "text": text}]}


def converse(session, history: list[dict], options: dict, images: PromptImages | None = None) -> None:
    """The --chat loop: each line from stdin is a user turn answered with the whole conversation as the prompt;
    the images join the first turn."""
    err_console.print("chat: type a message and press Enter; an empty line or end of input (Ctrl-D) ends",
                      markup=False, highlight=False)
    history = list(history)
    number = 0
    while True:
        if sys.stdin.isatty():
            err_console.print("> ", end="", markup=False, highlight=False)
        number += 1
        line = read_line(number)
        if not line.strip():
            return
        history.append(user_message(line.rstrip("\n"), images if number == 1 else None))
        with user_errors():
            ids = session.prompt(messages=history, images=images)
        text = reply(session, ids, stop=True, images=images, **options)
        history.append({"role": "assistant", "content": text})


def read_line(number: int) -> str:
    """Line `number` of stdin ('' at its end), read as bytes and decoded here: one that is not UTF-8, or longer than
    MAX_LINE_BYTES, is one line naming it (and its first such byte), exit 2."""
    raw = sys.stdin.buffer.readline(MAX_LINE_BYTES + 1)
    if len(raw) > MAX_LINE_BYTES:
        fail([f"stdin line {number}: longer than {MAX_LINE_BYTES} bytes, the most a --chat turn may be"])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        fail([f"stdin line {number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1})"])


def reply(session, ids: list[int], stop: bool, images: PromptImages | None = None, **options) -> str:
    """Generate after `ids` (holding the tokens of `images`), streaming the text to stdout; the speed line on stderr
    (and before the reply a line when it may pass the checkpoint's max_position_embeddings). Returns the text."""
    if (note := session.context_note(len(ids), options["max_new_tokens"])) is not None:
        err_console.print(note, markup=False, highlight=False)
    with user_errors():
        result = session.generate(ids, stop=stop, on_text=write, images=images, **options)
    write("\n")
    ended = "a stop token" if result.stopped else f"--max-new-tokens ({options['max_new_tokens']})"
    err_console.print(
        f"{len(result.ids)} tokens in {result.elapsed_s:.2f} s ({result.tokens_per_s:.1f} tokens/s after the first, "
        f"first after {result.first_token_s:.2f} s; prompt {result.prompt_tokens} tokens); ended by {ended}",
        markup=False, highlight=False,
    )
    return result.text


# Terminal controls a model may emit (escape sequences, bidirectional overrides): shown escaped, never obeyed.
_KEEP = re.compile(r"([\n\t])")


def write(text: str) -> None:
    sys.stdout.write("".join(p if _KEEP.fullmatch(p) else escape_controls(p) for p in _KEEP.split(text)))
    sys.stdout.flush()
