"""Chat records the assistant opens (no user turn before its first turn), rendered by templates whose generation
prompt is not what they render before that turn: what the template renders before the turn (a default system prompt)
is never trained, nor the turn's header but with data.train_on_assistant_header; the labels equal transformers' own
assistant mask of the same template with {% generation %} blocks, for templates with and without them.

The tiny tokenizers are test_chat.py's, with the templates below.
"""

import pytest

from moe_tune.engine.data.dataset import IGNORE_INDEX
from moe_tune.engine.data.tokenizer import ByteTokenizer, load_tokenizer, render_template_text
from moe_tune.profiles import ProfileError
from test_chat import END_GEN, GEN, document, expected_document, save_tokenizer, trained_runs

QWEN_SYSTEM = ("{%- if messages[0].role != 'system' %}"
               "{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}")
KIMI_SYSTEM = ("{%- if messages[0].role != 'system' %}"
               "{{- '<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>' }}{%- endif %}")
# Qwen3's template as enable_thinking=False renders it: the generation prompt ends in an empty think block, which the
# last assistant turn after a user turn renders too, and an assistant turn with no user turn before it does not (the
# last user turn is looked for from the last message: none found, it is the last message).
QWEN3_NO_THINK = (
    "{%- set ns = namespace(last_query=messages|length - 1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "@GEN{{- m.content + '<|im_end|>' }}@END{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
KIMI_TURNS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '@OPEN' }}@GEN{{- m.content + '<|im_end|>' }}@END"
    "{%- else %}{{- '<|im_' + m.role + '|>' + m.role + '<|im_middle|>' + m.content + '<|im_end|>' }}{%- endif %}"
    "{%- endfor %}"
)
# name: (tokenizer family, template); each rendered before an opening assistant turn otherwise than its generation
# prompt says.
TEMPLATES = {
    "qwen3_no_think": ("qwen3", QWEN3_NO_THINK),
    # The same with a default system turn before the first message.
    "qwen3_no_think_system": ("qwen3", QWEN_SYSTEM + QWEN3_NO_THINK),
    # A default system turn and no generation prompt at all.
    "no_generation_prompt": ("kimi", KIMI_SYSTEM + KIMI_TURNS.replace("@OPEN",
                                                                      "<|im_assistant|>assistant<|im_middle|>")),
    # A default system turn; the generation prompt opens with a token the turns do not.
    "other_opening": ("kimi", KIMI_SYSTEM + KIMI_TURNS.replace("@OPEN", "<|im_middle|>")
                      + "{%- if add_generation_prompt %}{{- '<|im_assistant|>' }}{%- endif %}"),
}  # fmt: skip
# Contents of the opening turn: plain, starting with a character another rendering could share, blank-led.
CONTENTS = {"plain": "hello there", "x_first": "x marks it", "y_first": "yes", "blank_first": "\n\nspaced"}
QUESTION = {"role": "user", "content": "and?"}
LATER = {"role": "assistant", "content": "done"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(template name, marked?) -> (our tokenizer, transformers' own, the directory)."""
    made = {}
    for name, (family, template) in TEMPLATES.items():
        for marked in (True, False):
            directory = tmp_path_factory.mktemp(f"{name}-{'marked' if marked else 'plain'}")
            raw = save_tokenizer(directory, family, True)
            raw.chat_template = template.replace("@GEN", GEN * marked).replace("@END", END_GEN * marked)
            raw.save_pretrained(directory)
            made[name, marked] = (load_tokenizer(str(directory)), raw, directory)
    return made


def conversations(name: str, content: str) -> list[list[dict]]:
    """The opening turn alone, and (where the template renders a turn after a user turn as its generation prompt
    says, so that turn too is trained as the marked template marks it) followed by a user and an assistant turn."""
    first = {"role": "assistant", "content": content}
    return [[first], [first, QUESTION, LATER]] if name.startswith("qwen3") else [[first]]


@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("is_marked", [True, False])
@pytest.mark.parametrize("name", TEMPLATES)
def test_an_opening_assistant_turn_trains_what_the_generation_blocks_mark(tmp_path, tokenizers, name, is_marked,
                                                                         content):
    tok, _, directory = tokenizers[name, is_marked]
    for messages in conversations(name, CONTENTS[content]):
        doc = document(tmp_path, tok, messages, str(directory))
        assert (doc.input_ids, doc.labels) == expected_document(tokenizers[name, True][1], messages)


@pytest.mark.parametrize("is_marked", [True, False])
@pytest.mark.parametrize("name", ["qwen3_no_think", "qwen3_no_think_system"])
def test_an_opening_assistant_turn_trains_its_header_with_the_option(tmp_path, tokenizers, name, is_marked):
    """The header is the part of the generation prompt rendered right before the turn's content; a later turn's is
    the whole generation prompt, rendered there."""
    tok, _, directory = tokenizers[name, is_marked]
    first = {"role": "assistant", "content": "hello there"}
    # A document's first token is no token's label: without a default system turn, the header's <|im_start|>.
    opening = "assistant\n" if name == "qwen3_no_think" else "<|im_start|>assistant\n"
    doc = document(tmp_path, tok, [first], str(directory), train_on_assistant_header=True)
    assert trained_runs(doc, tok) == [opening + "hello there<|im_end|>"]
    doc = document(tmp_path, tok, [first, QUESTION, LATER], str(directory), train_on_assistant_header=True)
    assert trained_runs(doc, tok) == [opening + "hello there<|im_end|>",
                                      "<|im_start|>assistant\n<think>\n\n</think>\n\ndone<|im_end|>"]


@pytest.mark.parametrize("is_marked, line", [
    (False, "data.train_on_assistant_header (true) needs the assistant header before turn 1 (assistant), which "
            "opens the conversation, but the chat template renders no part of its generation prompt there; set "
            "data.train_on_assistant_header: false"),
    (True, "data.train_on_assistant_header (true) needs the assistant header before the tokens the chat template "
           "marks with {% generation %}, but its generation prompt is not rendered there; set "
           "data.train_on_assistant_header: false"),
])  # fmt: skip
@pytest.mark.parametrize("name", ["no_generation_prompt", "other_opening"])
def test_an_opening_header_the_template_does_not_render_is_refused_with_the_option(tmp_path, tokenizers, name,
                                                                                   is_marked, line):
    tok, _, directory = tokenizers[name, is_marked]
    with pytest.raises(ProfileError) as err:
        document(tmp_path, tok, [{"role": "assistant", "content": "hello there"}], str(directory),
                 train_on_assistant_header=True)
    assert err.value.problems == [f"{tmp_path / 'chat.jsonl'}:1: {line}"]


@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("name", TEMPLATES)
def test_the_byte_tokenizer_trains_an_opening_turn_from_its_content(tmp_path, name, content):
    """data.chat_template with the byte tokenizer (special tokens are text there, so no token closes a turn): nothing
    the template renders before the turn's content is trained, everything after it is, and the <eos> appended."""
    byte = ByteTokenizer()
    template = TEMPLATES[name][1].replace("@GEN", "").replace("@END", "")
    messages = [{"role": "assistant", "content": CONTENTS[content]}]
    doc = document(tmp_path, byte, messages, chat_template=template)
    text, _ = render_template_text(template, messages, False, False, "test")
    opening = text[: text.index(CONTENTS[content])]
    ids = [byte.bos_id, *byte.encode(text), byte.eos_id]
    # Label t is token t + 1: the first trained label is the content's first byte.
    labels = [IGNORE_INDEX] * len(byte.encode(opening)) + ids[len(byte.encode(opening)) + 1 :]
    assert (doc.input_ids, doc.labels) == (ids[:-1], labels)


def test_an_opening_turn_the_template_renders_with_no_other_content_is_refused(tmp_path):
    """Neither the generation prompt nor a rendering of the turn with another content says where the turn begins:
    refused rather than trained from the template's first token."""
    directory = tmp_path / "tok"
    raw = save_tokenizer(directory, "kimi", True)
    raw.chat_template = ("{%- for m in messages %}{%- if m.content|length < 3 %}{{ raise_exception('too short') }}"
                         "{%- endif %}{%- endfor %}" + TEMPLATES["other_opening"][1].replace("@GEN", "")
                         .replace("@END", ""))  # fmt: skip
    raw.save_pretrained(directory)
    with pytest.raises(ProfileError) as err:
        document(tmp_path, load_tokenizer(str(directory)), [{"role": "assistant", "content": "hello"}], str(directory))
    assert err.value.problems == [
        f"{tmp_path / 'chat.jsonl'}:1: turn 1 (assistant) opens the conversation, and the chat template renders "
        "neither its generation prompt before it nor the turn with another content: what it renders before the turn "
        "cannot be told from the turn; use a chat template that marks the assistant's tokens with {% generation %} ... "
        "{% endgeneration %}"]
