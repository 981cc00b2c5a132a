"""Chat options: data.train_on (assistant | all), data.train_on_assistant_header and data.chat_template, on every
rendering path (the built-in format of the byte tokenizer, templates with {% generation %} blocks, templates rendered
by growing prefixes, image chats), each trained-token mask compared with one computed by hand or by transformers'
return_assistant_tokens_mask; and the profile's template: read, checked, sandboxed.

The tiny tokenizers and templates are test_chat.py's.
"""

import json
import re

import pytest

from moe_tune.engine.data.chat import ChatOptions, chat_options, chat_tokens, ends_trained
from moe_tune.engine.data.dataset import IGNORE_INDEX, load_documents
from moe_tune.engine.data.tokenizer import ByteTokenizer, load_tokenizer
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import DataProfile
from test_chat import END_GEN, FAMILIES, GEN, KIMI, MULTI_TURN, QWEN3, save_tokenizer, save_tokenizers

BYTE = ByteTokenizer()
GEN_BLOCK_EMPTY = "{% generation %}{% endgeneration %}"
# What each family's generation prompt adds: the assistant header.
HEADERS = {"qwen3": "<|im_start|>assistant\n", "qwen3_base": "<|im_start|>assistant\n", "deepseek_v3": "<｜Assistant｜>",
           "kimi": "<|im_assistant|>assistant<|im_middle|>"}  # fmt: skip
CAFE = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "caf\u00e9?"},
        {"role": "assistant", "content": "cr\u00e8me br\u00fbl\u00e9e"}, {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "th\u00e9"}]  # fmt: skip


def marked(template: str) -> str:
    return template.replace("@GEN", GEN).replace("@END", END_GEN)


def plain(template: str) -> str:
    return template.replace("@GEN", "").replace("@END", "")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(family, marked) -> (our tokenizer, transformers' own), and 'bare': kimi's tokens without a chat template."""
    made = {key: (tok, raw) for key, (tok, raw, _) in save_tokenizers(tmp_path_factory).items()}
    directory = tmp_path_factory.mktemp("bare")
    raw = save_tokenizer(directory, "kimi", True)
    raw.chat_template = None
    raw.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    made["bare"] = (load_tokenizer(str(directory)), raw)
    return made


def rendered(tok, messages, **options) -> tuple[list[int], list[bool]]:
    """(token ids, trained?) of a conversation as a document holds them: the tokenizer's document start (the byte
    tokenizer's <bos>; nothing before a template's rendering), <eos> where appended."""
    pieces = tok.render_chat(messages, "f.jsonl:1", ChatOptions(**options))
    return chat_tokens(pieces, tok, ends_trained(messages, ChatOptions(**options)), ChatOptions(**options))


def by_hand(raw, messages, header: str | None = None, train_all: bool = False) -> tuple[list[int], list[bool]]:
    """transformers' rendering of a {% generation %} template and its assistant mask, its ids as they are; with
    `header`, the header's tokens right before each masked span marked too; with train_all, every token."""
    out = raw.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    if header is not None:
        head = raw.encode(header, add_special_tokens=False)
        starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
        assert starts
        for start in starts:
            assert ids[start - len(head) : start] == head
            mask[start - len(head) : start] = [True] * len(head)
    if train_all:
        mask = [True] * len(ids)
    return ids, mask


def segments(*parts: tuple[str, bool], eos: bool) -> tuple[list[int], list[bool]]:
    """The byte tokenizer's document of text parts (text, trained?), <bos> first and a trained <eos> last."""
    ids, trained = [BYTE.bos_id], [False]
    for text, is_trained in parts:
        encoded = BYTE.encode(text)
        ids += encoded
        trained += [is_trained] * len(encoded)
    if eos:
        ids.append(BYTE.eos_id)
        trained.append(True)
    return ids, trained


# The built-in format (byte tokenizer): '<|role|>\n' header, then 'content\n'


@pytest.mark.parametrize("options, header, content, other", [
    ({}, False, True, False),
    ({"train_header": True}, True, True, False),
    ({"train_on": "all"}, True, True, True),
    ({"train_on": "all", "train_header": True}, True, True, True),
])  # fmt: skip
def test_the_built_in_format_trains_what_the_options_say(options, header, content, other):
    parts = []
    for m in CAFE:
        is_assistant = m["role"] == "assistant"
        parts += [(f"<|{m['role']}|>\n", header if is_assistant else other),
                  (m["content"] + "\n", content if is_assistant else other)]
    assert rendered(BYTE, CAFE, **options) == segments(*parts, eos=True)


# Templates with {% generation %} blocks: the template's mask, its headers, or all


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_blocks_with_the_header_add_the_generation_prompt_before_each_span(tokenizers, family):
    tok, raw = tokenizers[family, True]
    assert rendered(tok, MULTI_TURN) == by_hand(raw, MULTI_TURN)
    assert rendered(tok, MULTI_TURN, train_header=True) == by_hand(raw, MULTI_TURN, HEADERS[family])


@pytest.mark.parametrize("is_marked", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_train_on_all_trains_every_token_of_the_rendering(tokenizers, family, is_marked):
    """With or without generation blocks (qwen3's and deepseek's plain templates cannot be rendered by prefixes for
    this conversation: rendered once, nothing has to be found)."""
    tok, _ = tokenizers[family, is_marked]
    raw = tokenizers[family, True][1]
    expected = by_hand(raw, MULTI_TURN, train_all=True)
    assert rendered(tok, MULTI_TURN, train_on="all") == expected
    assert rendered(tok, MULTI_TURN, train_on="all", train_header=True) == expected


def test_a_header_the_template_does_not_render_before_its_span_is_refused(tmp_path):
    directory = tmp_path / "tok"
    raw = save_tokenizer(directory, "kimi", True)
    # The generation prompt says '<|im_assistant|>' but the turns open with '<|im_middle|>'.
    raw.chat_template = ("{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_middle|>' }}{% generation %}"
                         "{{- m.content + '<|im_end|>' }}{% endgeneration %}{%- else %}{{- m.content }}{%- endif %}"
                         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_assistant|>' }}{%- endif %}")
    raw.save_pretrained(directory)
    tok = load_tokenizer(str(directory))
    with pytest.raises(ProfileError) as err:
        rendered(tok, MULTI_TURN, train_header=True)
    assert err.value.problems == [
        "f.jsonl:1: data.train_on_assistant_header (true) needs the assistant header before the tokens the chat "
        "template marks with {% generation %}, but its generation prompt is not rendered there; set "
        "data.train_on_assistant_header: false"]
    # Without the header the same template trains its spans.
    assert sum(rendered(tok, MULTI_TURN)[1]) > 0


# Templates without generation blocks: growing prefixes, the header from the generation prompt


@pytest.mark.parametrize("family, messages", [
    ("kimi", MULTI_TURN),
    ("qwen3", MULTI_TURN[:3]),  # qwen3 rewrites earlier turns: one answer holds as prefixes
    ("deepseek_v3", MULTI_TURN[:3]),
])  # fmt: skip
@pytest.mark.parametrize("header", [False, True])
def test_prefix_rendering_trains_what_the_generation_blocks_mark(tokenizers, family, messages, header):
    tok = tokenizers[family, False][0]
    raw = tokenizers[family, True][1]
    assert rendered(tok, messages, train_header=header) == by_hand(raw, messages, HEADERS[family] if header else None)


# A turn's weight (OpenAI's chat fine-tuning format): 0 leaves an assistant turn untrained, as context


def weighted(messages: list[dict], *turns: int) -> list[dict]:
    """The messages with weight 0 on `turns` (1-based) and weight 1 on the other assistant turns."""
    return [dict(m, weight=0 if i in turns else 1) if m["role"] == "assistant" else m
            for i, m in enumerate(messages, 1)]  # fmt: skip


def without_turns(raw, messages, turns, expected):
    """`expected` (ids, trained) with the tokens transformers' rendering of each turn in `turns` adds to the
    rendering of the turns before it untrained (a trained <eos> our documents append after a last turn goes too)."""
    ids, mask = list(expected[0]), list(expected[1])
    for turn in turns:
        before, through = (list(raw.apply_chat_template(messages[:n], return_dict=True)["input_ids"])
                           for n in (turn - 1, turn))  # fmt: skip
        assert ids[: len(through)] == through and ids[: len(before)] == before
        mask[len(before) : len(through)] = [False] * (len(through) - len(before))
        if turn == len(messages) and len(ids) > len(through):
            ids, mask = ids[: len(through)], mask[: len(through)]
    return ids, mask


@pytest.mark.parametrize("turns", [(3,), (5,), (3, 5)])
@pytest.mark.parametrize("header", [False, True])
@pytest.mark.parametrize("is_marked", [True, False])
def test_a_turn_of_weight_0_trains_nothing_of_its_own(tokenizers, turns, header, is_marked):
    """With {% generation %} blocks or by prefixes: the tokens the turn adds (header, content, closing token) are
    untrained, every other token as without weights."""
    tok, raw = tokenizers["kimi", is_marked][0], tokenizers["kimi", True][1]
    expected = by_hand(raw, MULTI_TURN, HEADERS["kimi"] if header else None)
    got = rendered(tok, weighted(MULTI_TURN, *turns), train_header=header)
    assert got == without_turns(raw, MULTI_TURN, turns, expected)
    assert rendered(tok, weighted(MULTI_TURN), train_header=header) == rendered(tok, MULTI_TURN, train_header=header)
    # train_on: all trains every token: weights change nothing.
    assert rendered(tok, weighted(MULTI_TURN, *turns), train_on="all") == rendered(tok, MULTI_TURN, train_on="all")


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_a_weight_0_turn_a_template_rewrites_later_is_refused_the_last_one_is_untrained(tokenizers, family):
    """qwen3 and deepseek drop an answer's thinking once a later question follows: turn 3's tokens are not those of
    the conversation up to it, so they cannot be found; the last answer's can."""
    tok, raw = tokenizers[family, True]
    with pytest.raises(ProfileError) as err:
        rendered(tok, weighted(MULTI_TURN, 3))
    (line,) = err.value.problems
    assert re.fullmatch(r"f\.jsonl:1: turn 3 \(assistant\) has weight 0, but the chat template renders the turns up to "
                        r"turn 3 differently once later turns follow \(token \d+ changes\): the turn's tokens cannot "
                        r"be told apart to leave them untrained; drop its weight, or drop the turns after it", line)
    assert rendered(tok, weighted(MULTI_TURN, 5)) == without_turns(raw, MULTI_TURN, (5,), by_hand(raw, MULTI_TURN))


@pytest.mark.parametrize("content", ["", "  \n "])
@pytest.mark.parametrize("is_marked", [True, False])
def test_an_assistant_turn_that_says_nothing_trains_nothing_of_its_own(tokenizers, content, is_marked):
    """Blank content, no tool call, no reasoning: its closing token alone would teach the model to stop at once (a
    blank text trains nothing either); trained as a turn of weight 0, in the middle or last."""
    tok, raw = tokenizers["kimi", is_marked][0], tokenizers["kimi", True][1]
    for turn in (3, 5):
        messages = [dict(m, content=content) if i == turn else m for i, m in enumerate(MULTI_TURN, 1)]
        expected = without_turns(raw, messages, (turn,), by_hand(raw, messages))
        assert rendered(tok, messages) == expected
        assert rendered(tok, weighted(messages, turn)) == expected
    # The built-in format: a last turn that says nothing leaves the document untrained (the summary counts it).
    silent = [*CAFE[:4], {"role": "assistant", "content": content}]
    parts = [(f"<|{m['role']}|>\n", False) for m in silent]
    parts = [part for m, header in zip(silent, parts) for part in (header, (m["content"] + "\n", m is CAFE[2]))]
    assert rendered(BYTE, silent) == segments(*parts, eos=False)


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "", "reasoning_content": "think first"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
])  # fmt: skip
def test_a_turn_with_only_reasoning_or_a_tool_call_is_trained(tokenizers, message):
    tok, raw = tokenizers["qwen3", True]
    messages = [*MULTI_TURN[:4], message]
    assert rendered(tok, messages) == by_hand(raw, messages)


@pytest.mark.parametrize("reasoning", ["  \n", "think first"])
def test_reasoning_the_format_does_not_write_or_that_is_blank_says_nothing(reasoning):
    """The built-in format writes no reasoning; blank reasoning is no reasoning anywhere: the turn trains nothing."""
    silent = [*CAFE[:4], {"role": "assistant", "content": "", "reasoning_content": reasoning}]
    pieces = BYTE.render_chat(silent, "f.jsonl:1", ChatOptions())
    ids, trained = chat_tokens(pieces, BYTE, ends_trained(silent, ChatOptions(), writes_reasoning=False), ChatOptions())
    assert sum(trained) == len((CAFE[2]["content"] + "\n").encode())
    assert ends_trained(silent, ChatOptions()) == (reasoning == "think first")


def test_a_record_of_reasoning_alone_in_the_built_in_format_trains_nothing(tmp_path):
    path = tmp_path / "d.jsonl"
    silent = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "", "reasoning_content": "hm"}]}  # fmt: skip
    path.write_text(json.dumps(silent) + "\n" + json.dumps({"text": "t"}) + "\n")
    doc, _ = load_documents(DataProfile(path=path, seq_len=64), BYTE)
    assert set(doc.labels) == {IGNORE_INDEX}


def test_a_blank_turn_a_template_rewrites_later_is_refused(tokenizers):
    tok, _ = tokenizers["qwen3", True]
    messages = [dict(m, content="") if i == 3 else m for i, m in enumerate(MULTI_TURN, 1)]
    with pytest.raises(ProfileError) as err:
        rendered(tok, messages)
    assert re.fullmatch(r"f\.jsonl:1: turn 3 \(assistant\) says nothing \(blank content\), but the chat template renders "
                        r"the turns up to turn 3 differently once later turns follow \(token \d+ changes\): the turn's "
                        r"tokens cannot be told apart to leave them untrained; give it content, or drop the turns "
                        r"after it", err.value.problems[0])


@pytest.mark.parametrize("turns", [(3,), (5,)])
def test_the_built_in_format_leaves_a_weight_0_turn_untrained(turns):
    parts = []
    for turn, m in enumerate(CAFE, 1):
        parts += [(f"<|{m['role']}|>\n", False), (m["content"] + "\n", m["role"] == "assistant" and turn not in turns)]
    assert rendered(BYTE, weighted(CAFE, *turns)) == segments(*parts, eos=5 not in turns)


def test_sharegpt_and_table_weights_train_as_message_weights(tmp_path):
    """axolotl's ShareGPT turns carry a weight too; a table's messages without one hold null: trained."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sharegpt = tmp_path / "s.jsonl"
    sharegpt.write_text(json.dumps({"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "bad", "weight": 0},
        {"from": "human", "value": "q2"}, {"from": "gpt", "value": "good"}]}) + "\n")  # fmt: skip
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad", "weight": 0},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "good", "weight": None}]
    table = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": messages}]), table)
    reference = tmp_path / "m.jsonl"
    reference.write_text(json.dumps({"messages": weighted(messages[:2] + [dict(messages[2]), dict(messages[3])], 2)})
                         + "\n")  # fmt: skip
    (expected,) = load_documents(DataProfile(path=reference, seq_len=64), BYTE)
    assert bytes(t for t in expected.labels if 0 <= t < 256) == b"good\n"
    for path in (sharegpt, table):
        assert load_documents(DataProfile(path=path, seq_len=64), BYTE) == [expected]


@pytest.mark.parametrize("message, rule", [
    ({"role": "user", "content": "q", "weight": 0}, "turn 1 (user) has a weight (0): only an assistant turn's weight "
                                                     "says whether it is trained (0: not, 1: as any)"),
    ({"role": "assistant", "content": "a", "weight": 0.5}, "turn 1 (assistant): weight (0.5) must be 0 (the turn is "
                                                            "not trained) or 1 (it is)"),
    ({"role": "assistant", "content": "a", "weight": "0"}, "turn 1 (assistant): weight (\"0\") must be 0"),
    ({"role": "assistant", "content": "a", "weight": True}, "turn 1 (assistant): weight (true) must be 0"),
    ({"role": "assistant", "content": "a", "weight": [0]}, "turn 1 (assistant): weight ([0]) must be 0"),
    ({"role": "assistant", "content": "a", "weight": 10**60}, f"turn 1 (assistant): weight ({str(10**60)[:37]}...) must "
                                                              "be 0"),
])  # fmt: skip
def test_a_weight_other_than_0_or_1_or_off_the_assistant_is_one_line(tmp_path, message, rule):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [message]}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=64), BYTE)
    (line,) = err.value.problems
    assert line.startswith(f"{path}:1: {rule}")


# The profile's chat template


def test_the_profiles_template_replaces_the_tokenizers(tokenizers):
    """qwen3's plain template refuses this conversation; the marked one given as data.chat_template renders it (and a
    tokenizer without any template takes one the same way)."""
    tok, raw = tokenizers["qwen3", False]
    with pytest.raises(ProfileError, match="renders turn 3"):
        rendered(tok, MULTI_TURN)
    reference = tokenizers["qwen3", True][1]
    for header in (False, True):
        assert rendered(tok, MULTI_TURN, template=marked(QWEN3), train_header=header) == by_hand(
            reference, MULTI_TURN, HEADERS["qwen3"] if header else None)
    bare, _ = tokenizers["bare"]
    assert bare.has_chat_template is False
    assert rendered(bare, MULTI_TURN, template=marked(KIMI)) == by_hand(tokenizers["kimi", True][1], MULTI_TURN)


BYTE_TEMPLATE = ("{%- for m in messages %}{{- '[' + m.role + ']' }}{%- if m.role == 'assistant' %}@GEN"
                 "{{- m.content + ' </s>' }}@END{%- else %}{{- m.content }}{%- endif %}{{- '\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '[assistant]' }}{%- endif %}")


@pytest.mark.parametrize("options, header, content, other", [
    ({}, False, True, False),
    ({"train_header": True}, True, True, False),
    ({"train_on": "all"}, True, True, True),
])  # fmt: skip
@pytest.mark.parametrize("is_marked", [True, False])
def test_the_byte_tokenizer_renders_the_profiles_template(options, header, content, other, is_marked):
    """Non-ASCII text: the template's character spans become byte spans. Marked: content and ' </s>' trained, the
    newline after it not; by prefixes: to the turn's end, the newline included (bytes close no turn)."""
    template = marked(BYTE_TEMPLATE) if is_marked else plain(BYTE_TEMPLATE)
    parts = []
    for m in CAFE:
        if m["role"] != "assistant":
            parts += [(f"[{m['role']}]", other), (m["content"] + "\n", other)]
            continue
        newline = content if not is_marked else other
        parts += [(f"[{m['role']}]", header), (m["content"] + " </s>", content), ("\n", newline)]
    assert rendered(BYTE, CAFE, template=template, **options) == segments(*parts, eos=True)


def test_chat_template_inline_and_from_a_file_train_the_same(tmp_path, tokenizers):
    path = tmp_path / "qwen3.jinja"
    path.write_text(marked(QWEN3))
    tok, _ = tokenizers["qwen3", False]
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": MULTI_TURN}) + "\n")
    docs = {}
    for name, value in (("inline", marked(QWEN3)), ("file", str(path))):
        profile = DataProfile(path=data, seq_len=4096, chat_template=value, train_on_assistant_header=True)
        assert chat_options(profile) == ChatOptions("assistant", True, marked(QWEN3))
        (docs[name],) = load_documents(profile, tok)
    ids, mask = by_hand(tokenizers["qwen3", True][1], MULTI_TURN, HEADERS["qwen3"])
    assert docs["inline"] == docs["file"]
    assert (docs["file"].input_ids, docs["file"].labels) == (ids[:-1], [t if m else IGNORE_INDEX
                                                                        for t, m in zip(ids[1:], mask[1:])])
    # A file edited after the profile was read is read again.
    path.write_text(marked(KIMI).replace("<|im_", "<|x_"))
    assert chat_options(DataProfile(path=data, seq_len=64, chat_template=str(path))).template != marked(QWEN3)


def refusal(tmp_path, template, tok=BYTE, records=1):
    """(the data file, the ProfileError's lines) of `records` MULTI_TURN conversations read under `template`."""
    data = tmp_path / "d.jsonl"
    data.write_text((json.dumps({"messages": MULTI_TURN}) + "\n") * records)
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=data, seq_len=4096, chat_template=template), tok)
    return data, err.value.problems


@pytest.mark.parametrize("escape", [
    "{{ cycler.__init__.__globals__.os.system('touch @MARKER') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ messages.append({'role': 'user'}) }}",  # the environment is immutable too
    "{{ lipsum.__globals__['os'].system('touch @MARKER') }}",
])  # fmt: skip
@pytest.mark.parametrize("tokenizer", ["byte", "kimi"])
def test_a_template_reaching_out_of_the_sandbox_is_refused_naming_the_record(tmp_path, tokenizers, escape, tokenizer):
    marker = tmp_path / "escaped"
    template = escape.replace("@MARKER", str(marker))
    tok = BYTE if tokenizer == "byte" else tokenizers["kimi", True][0]
    data, (line,) = refusal(tmp_path, template, tok)
    assert line.startswith(f"{data}:1: data.chat_template cannot render the conversation: "), line
    assert re.search(r"unsafe|cannot store|immutable|not safely callable|Security", line), line
    assert not marker.exists()


@pytest.mark.parametrize("template, kind", [
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{{ (messages | length) // 0 }}", "ZeroDivisionError"),
    ("{{ messages[99]['content'] }}", "has no element 99"),
    ("{{ (messages | map(attribute='content') | list)[0] | float / 0 }}", "ZeroDivisionError"),
    ("{{ '%d' % 'x' }}", "%d format"),
])  # fmt: skip
def test_whatever_a_template_raises_is_one_line_naming_the_record(tmp_path, template, kind):
    # The template is the user's code: an exception of any kind it raises is its problem, said in one line.
    data, (line,) = refusal(tmp_path, template)
    assert line.startswith(f"{data}:1: "), line
    assert kind in line and "\n" not in line


DROPPING = {
    # Text that is no message: nothing of the conversation.
    "static": "static text only",
    # Headers, no content: the generation prompt's header is all an assistant turn adds.
    "headers_only": "{% for m in messages %}<|{{ m.role }}|>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                    "{% endif %}",
    # The assistant's turns skipped.
    "no_assistant": "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}\n{% endif %}{% endfor %}",
    # Generation blocks that mark nothing.
    "empty_blocks": "{% for m in messages %}{{ m.content }}\n{% if m.role == 'assistant' %}" + GEN_BLOCK_EMPTY + "{% endif %}"
                    "{% endfor %}",
}  # fmt: skip


@pytest.mark.parametrize("template", DROPPING.values(), ids=DROPPING.keys())
def test_a_template_that_renders_no_trained_token_of_an_assistant_turn_is_refused(tmp_path, template):
    # Each record would train its closing <eos> alone.
    data, (line,) = refusal(tmp_path, template)
    assert line == (f"{data}:1: the chat template renders no token of turn 3 (assistant) to train: a template must "
                    "render every message's content (data.chat_template, or the tokenizer's)")


def test_an_assistant_turn_without_content_may_render_nothing(tmp_path):
    template = "{% for m in messages %}{% if m.content %}[{{ m.role }}]{{ m.content }}\n{% endif %}{% endfor %}"
    data = tmp_path / "d.jsonl"
    messages = [*MULTI_TURN[:3], {"role": "user", "content": "more"}, {"role": "assistant", "content": ""}]
    data.write_text(json.dumps({"messages": messages}) + "\n")
    (doc,) = load_documents(DataProfile(path=data, seq_len=4096, chat_template=template), BYTE)
    assert sum(label != IGNORE_INDEX for label in doc.labels) > len("answer one")


def test_a_template_that_runs_too_long_is_refused_on_its_first_record_and_at_once_after(tmp_path, monkeypatch):
    import time

    from moe_tune.engine.data import tokenizer

    monkeypatch.setattr(tokenizer, "RENDER_LIMIT_S", 0.3)
    monkeypatch.setattr(tokenizer, "_TIMED_OUT", {})
    template = "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}"
    start = time.monotonic()
    data, problems = refusal(tmp_path, template, records=3)
    assert time.monotonic() - start < 5
    assert problems == [
        f"{data}:1: data.chat_template cannot render the conversation: 'rendering took more than 0.3 s'",
        f"{data}:2: data.chat_template cannot render the conversation: it ran past 0.3 s on {data}:1",
        f"{data}:3: data.chat_template cannot render the conversation: it ran past 0.3 s on {data}:1",
    ]


def test_a_template_rendering_far_more_than_the_conversation_is_refused(tmp_path):
    content = sum(len(m["content"]) for m in MULTI_TURN)
    data, problems = refusal(tmp_path, "{{ 'x' * 10**8 }}")
    assert problems == [f"{data}:1: data.chat_template renders 100000000 characters from messages of {content}, more "
                        f"than {2**20 + 4 * content}: a template renders the conversation, not more"]  # fmt: skip


def test_the_render_limit_puts_an_outer_timer_back():
    import signal

    from moe_tune.engine.data.tokenizer import _time_limit

    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        with _time_limit(5.0):
            pass
        left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        assert 99.0 < left <= 100.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# Image chats: the built-in format and a template, trained as the options say


@pytest.mark.parametrize("options, expected", [
    ({}, "a square\n"),
    ({"train_on_assistant_header": True}, "<|assistant|>\na square\n"),
    ({"train_on": "all"}, "<|user|>\nwhat?\n<|assistant|>\na square\n"),
])  # fmt: skip
def test_image_chats_in_the_built_in_format_train_as_text_chats(tmp_path, options, expected):
    from test_images import TOKENS, data_profile, vision, write_image

    write_image(tmp_path / "a.png", 16, 16)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>what?"},
                                             {"role": "assistant", "content": "a square"}], "images": ["a.png"]}) + "\n")
    (doc,) = load_documents(data_profile(path, **options), BYTE, vision())
    trained = [t for t, label in zip(doc.input_ids[1:] + [BYTE.eos_id], doc.labels) if label != IGNORE_INDEX]
    # Image tokens are never trained, whatever train_on says; decode drops them (and <eos>).
    assert not set(trained) & {TOKENS.image, TOKENS.start, TOKENS.end}
    assert BYTE.decode(trained) == expected and trained[-1] == BYTE.eos_id


@pytest.mark.parametrize("silent", [
    {"content": "bad answer", "weight": 0}, {"content": " "}, {"content": "", "reasoning_content": "hm"},
    {"content": [{"type": "text", "text": "  "}]},
])  # fmt: skip
def test_image_chats_leave_weight_0_and_silent_turns_untrained(tmp_path, silent):
    """As text chats do: the first answer is context, the last trained."""
    from test_images import data_profile, vision, write_image

    write_image(tmp_path / "a.png", 16, 16)
    path = tmp_path / "d.jsonl"
    messages = [{"role": "user", "content": "<image>what?"}, {"role": "assistant", **silent},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "a square"}]
    path.write_text(json.dumps({"messages": messages, "images": ["a.png"]}) + "\n")
    (doc,) = load_documents(data_profile(path), BYTE, vision())
    trained = [t for t, label in zip(doc.input_ids[1:] + [BYTE.eos_id], doc.labels) if label != IGNORE_INDEX]
    assert BYTE.decode(trained) == "a square\n" and trained[-1] == BYTE.eos_id


def test_image_chats_with_the_byte_tokenizer_and_a_profile_template_are_refused(tmp_path):
    from test_images import data_profile, vision, write_image

    write_image(tmp_path / "a.png", 16, 16)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>what?"},
                                             {"role": "assistant", "content": "a square"}], "images": ["a.png"]}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(data_profile(path, chat_template=plain(BYTE_TEMPLATE)), BYTE, vision())
    assert err.value.problems == [f"{path}:1: data.chat_template cannot place image tokens with the byte tokenizer (its "
                                  "tokens are bytes); image records with data.tokenizer 'byte' use the built-in "
                                  "format: unset data.chat_template"]


# The schema: what data.chat_template may be, each refusal one line naming the field


def test_a_value_ending_in_jinja_is_a_path_and_anything_else_is_inline(tmp_path):
    from moe_tune.profiles.schema import is_chat_template_path

    assert is_chat_template_path("templates/chat.jinja") and is_chat_template_path(str(tmp_path / "a b.jinja"))
    for inline in ("{{ messages }}.jinja", "{% for m in messages %}x{% endfor %}", "chat.jinja\n", "plain text",
                   "chat.jinja2"):
        assert not is_chat_template_path(inline), inline


@pytest.mark.parametrize("kind", ["missing", "directory", "too_large", "not_utf8", "empty", "syntax", "fifo"])
def test_a_bad_chat_template_is_one_line_naming_the_field(tmp_path, kind):
    import os

    path = tmp_path / "chat.jinja"
    value = str(path)
    if kind == "directory":
        path.mkdir()
    elif kind == "too_large":
        path.write_text("x" * (2**20 + 1))
    elif kind == "not_utf8":
        path.write_bytes(b"{{ messages }}\xff")
    elif kind == "empty":
        value = "  \n"
    elif kind == "syntax":
        path.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    elif kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [f"data.chat_template={json.dumps(value)}"])
    (line,) = err.value.problems
    shown = f"data.chat_template ('{path}')"
    assert line == {
        "missing": f"{shown} must name an existing .jinja file (a one-line value ending in .jinja is a path; anything "
                   "else is the template's text)",
        "directory": f"{shown} must be a regular file, not a directory",
        "fifo": f"{shown} must be a regular file, not a FIFO",
        "too_large": f"{shown} must be at most 1048576 bytes (1 MiB)",
        "not_utf8": f"{shown} must be UTF-8 text (not at byte 14: invalid start byte)",
        "empty": "data.chat_template (inline template) must be a Jinja template or the path of a .jinja file, not empty",
        "syntax": f"{shown}: Jinja syntax error on line 2 of the template: unexpected '}}'",
    }[kind]


@pytest.mark.parametrize("field, value, rule", [
    ("train_on", "everything", "input should be 'assistant' or 'all'"),
    ("train_on", "Assistant", "input should be 'assistant' or 'all'"),
    ("train_on_assistant_header", "maybe", "input should be a valid boolean"),
])  # fmt: skip
def test_train_on_options_name_their_field(field, value, rule):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [f"data.{field}={value}"])
    assert err.value.problems == [f"data.{field} ('{value}'): {rule}, unable to interpret input" if "boolean" in rule
                                  else f"data.{field} ('{value}'): {rule}"]


def test_image_chats_through_a_template_train_every_token_but_the_images_with_train_on_all(tmp_path):
    """The checkpoint's template (test_images' word-level tokenizer), with a generation prompt: assistant turns with or
    without their header, or every token; an image's tokens never."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from test_images import CHAT_TEMPLATE_WITH_IMAGES, TOKENS, data_profile, vision, write_image

    specials = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"]
    vocab = {f"w{i}": i for i in range(300)} | {t: 300 + i for i, t in enumerate(specials)}
    vocab |= {"<unk>": 305, "user": 306, "assistant": 307, "what": 308, "square": 309, "<s>": 310, "</s>": 311}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    raw = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=specials)
    raw.chat_template = CHAT_TEMPLATE_WITH_IMAGES + "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    raw.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    write_image(tmp_path / "a.png", 24, 40)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "<image> what"},
                                             {"role": "assistant", "content": "square"}], "images": ["a.png"]}) + "\n")
    image = {TOKENS.image, TOKENS.start, TOKENS.end}
    expected = {
        "assistant": [309, 304],  # square <|im_end|>
        "header": [303, 307, 309, 304],  # <|im_start|> assistant square <|im_end|>
        # <|im_start|> user [image] what <|im_end|> <|im_start|> assistant square <|im_end|>: the document opens with
        # the template's first token, which nothing before it predicts.
        "all": [306, 308, 304, 303, 307, 309, 304],
    }
    for name, options in (("assistant", {}), ("header", {"train_on_assistant_header": True}),
                          ("all", {"train_on": "all"})):
        (doc,) = load_documents(data_profile(path, **options), tok, vision())
        assert doc.input_ids.count(TOKENS.image) == 15
        trained = [label for label in doc.labels if label != IGNORE_INDEX]
        assert trained == expected[name], name
        assert not image & set(trained)


@pytest.mark.parametrize("is_marked, weighted_turn", [(False, None), (True, 3)])
def test_a_record_whose_turn_by_turn_renderings_run_past_the_budget_is_refused(tokenizers, monkeypatch, is_marked,
                                                                             weighted_turn):  # fmt: skip
    """Rendering by growing prefixes is quadratic in turns (a record of 3,200 turns took 92 s): the renderings of one
    record stop at PREFIX_RENDER_LIMIT_S in all (here spent at once); a marked template renders by prefixes only to
    find a weight-0 turn, and otherwise renders once."""
    from moe_tune.engine.data import chat

    tok = tokenizers["kimi", is_marked][0]
    monkeypatch.setattr(chat, "PREFIX_RENDER_LIMIT_S", -1.0)
    messages = weighted(MULTI_TURN, weighted_turn) if weighted_turn else MULTI_TURN
    with pytest.raises(ProfileError) as err:
        rendered(tok, messages)
    assert err.value.problems == [
        "f.jsonl:1: rendering the conversation (5 messages) turn by turn took more than -1 s: a chat template without "
        "{% generation %} markers is rendered once per assistant turn; split the record, or give data.chat_template a "
        "template that marks the assistant's tokens"]
    if is_marked:
        assert sum(rendered(tok, MULTI_TURN)[1]) > 0
