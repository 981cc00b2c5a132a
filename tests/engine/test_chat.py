"""Chat records: roles mapped or refused, conversations rendered once with the template's own assistant spans (or by
checked growing prefixes), no end of turn trained twice, and no step or dataset without a token to train on.

The chat templates below are written for the tests and behave as the published ones do: qwen3 (think blocks kept
only after the last user turn, the last assistant turn always gets one; turns closed by <|im_end|>), deepseek_v3
(<bos> rendered by the template, assistant turns closed by the <eos> itself, earlier turns rewritten without their
reasoning) and kimi (a default system turn, every turn closed by its own <|im_end|>, which is not the <eos>). Each
comes with `{% generation %}` markers around the assistant's tokens and without them.
"""

import json
import re

import pytest

from moe_tune.engine.data.chat import canonical_messages
from moe_tune.engine.data.dataset import IGNORE_INDEX, load_documents, load_splits
from moe_tune.engine.data.tokenizer import ByteTokenizer, load_tokenizer
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import DataProfile

GEN, END_GEN = "{% generation %}", "{% endgeneration %}"

QWEN3 = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}@GEN"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- content }}{%- endif %}"
    "{{- '<|im_end|>' }}@END{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEEPSEEK_V3 = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='', last_query=-1) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{%- set ns.system = m.content %}{%- endif %}"
    "{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{{- ns.system }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- if loop.index0 < ns.last_query and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<｜Assistant｜>' }}@GEN{{- content + '<｜end▁of▁sentence｜>' }}@END"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

KIMI = (
    "{%- if messages|length == 0 or messages[0].role != 'system' %}"
    "{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_assistant|>assistant<|im_middle|>' }}@GEN{{- m.content + '<|im_end|>' }}@END"
    "{%- else %}{{- '<|im_' + m.role + '|>' + m.role + '<|im_middle|>' + m.content + '<|im_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)

# family: (template, bos, eos, special tokens)
FAMILIES = {
    "qwen3": (QWEN3, None, "<|im_end|>", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
    # A base checkpoint's tokenizer: its <eos> is not the token that closes the template's turns.
    "qwen3_base": (QWEN3, None, "<|endoftext|>", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
    "deepseek_v3": (DEEPSEEK_V3, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                    ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]),
    "kimi": (KIMI, "[BOS]", "[EOS]",
             ["[BOS]", "[EOS]", "<|im_end|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"]),
}  # fmt: skip
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]


def save_tokenizer(directory, family: str, marked: bool):
    """A character-level tokenizer with the family's special tokens and chat template, saved as a checkpoint ships
    it (built offline)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, bos, eos, specials = FAMILIES[family]
    vocab = {"<unk>": 0} | {c: i + 1 for i, c in enumerate(CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token=bos, eos_token=eos)
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in (bos, eos)]})
    # As in Qwen3 and DeepSeek-R1: added tokens that are not special.
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.chat_template = template.replace("@GEN", GEN if marked else "").replace("@END", END_GEN if marked else "")
    tok.save_pretrained(directory)
    return tok


def save_tokenizers(tmp_path_factory) -> dict:
    """(family, marked) -> (our tokenizer, transformers' own, the directory), for every family, with and without
    {% generation %} markers."""
    made = {}
    for family in FAMILIES:
        for marked in (True, False):
            directory = tmp_path_factory.mktemp(f"{family}-{'marked' if marked else 'plain'}")
            raw = save_tokenizer(directory, family, marked)
            made[family, marked] = (load_tokenizer(str(directory)), raw, directory)
    return made


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return save_tokenizers(tmp_path_factory)


def write_records(path, *conversations, key="messages"):
    path.write_text("".join(json.dumps({key: c}) + "\n" for c in conversations))
    return path


def document(tmp_path, tok, messages, tokenizer="byte", **data):
    path = write_records(tmp_path / "chat.jsonl", messages)
    (doc,) = load_documents(DataProfile(path=path, seq_len=4096, tokenizer=tokenizer, **data), tok)
    return doc


def trained_ids(doc) -> list[int]:
    return [label for label in doc.labels if label != IGNORE_INDEX]


def trained_runs(doc, tok) -> list[str]:
    """The trained text, one string per run of trained labels."""
    runs, current = [], []
    for label in doc.labels + [IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


def reference(raw, messages):
    """transformers' rendering and assistant mask of a template with {% generation %} blocks."""
    out = raw.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def expected_document(raw, messages):
    """(input_ids, labels) as the reference makes them: transformers' ids as they are (a <bos> only where the
    template renders one: deepseek_v3's, not kimi's), label t is token t + 1 where masked in."""
    ids, mask = reference(raw, messages)
    return ids[:-1], [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]


SHAREGPT = [{"role": "human", "content": "question zero"}, {"role": "gpt", "content": "hello there"}]
CANONICAL = [{"role": "user", "content": "question zero"}, {"role": "assistant", "content": "hello there"}]
MULTI_TURN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "<think>\nplan one\n</think>\n\nanswer one"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "<think>\nplan two\n</think>\n\nanswer two"},
]


# Roles


@pytest.mark.parametrize("roles, record_roles", [
    ({"human": "user", "gpt": "assistant"}, ("human", "gpt")),
    ({"Human": "user", "Assistant": "assistant"}, ("Human", "Assistant")),  # case variants are mapped, not guessed
    ({"USER": "user", "ASSISTANT": "assistant"}, ("USER", "ASSISTANT")),
    ({"gpt": "assistant"}, ("user", "gpt")),  # a mapping may cover only some roles
    ({"user": "user", "bot": "assistant", "instructions": "system"}, ("user", "bot")),
])  # fmt: skip
@pytest.mark.parametrize("tokenizer", ["byte", "qwen3", "kimi"])
def test_mapped_roles_train_as_the_canonical_ones(tmp_path, tokenizers, roles, record_roles, tokenizer):
    tok, name = (ByteTokenizer(), "byte") if tokenizer == "byte" else (
        tokenizers[tokenizer, True][0], str(tokenizers[tokenizer, True][2]))
    mapped = [{"role": r, "content": m["content"]} for r, m in zip(record_roles, CANONICAL)]
    got = document(tmp_path, tok, mapped, name, roles=roles)
    assert got == document(tmp_path, tok, CANONICAL, name)
    assert "hello there" in "".join(trained_runs(got, tok)) and "question" not in "".join(trained_runs(got, tok))


@pytest.mark.parametrize("role", [
    "human", "gpt", "Assistant", "USER", "System", " assistant", "assistant\n", "", "bot", "Tool", "function",
    "\x1b[31massistant", "assistant\u202e",  # controls and bidirectional marks are echoed escaped
])  # fmt: skip
@pytest.mark.parametrize("tokenizer", ["byte", "qwen3"])
def test_unknown_roles_are_refused_naming_the_record_and_role(tmp_path, tokenizers, role, tokenizer):
    tok, name = (ByteTokenizer(), "byte") if tokenizer == "byte" else (
        tokenizers[tokenizer, True][0], str(tokenizers[tokenizer, True][2]))
    path = write_records(tmp_path / "d.jsonl", CANONICAL, [{"role": "user", "content": "hi"}, {"role": role,
                                                                                              "content": "x"}])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=64, tokenizer=name), tok)
    (line,) = err.value.problems
    shown = repr(role).replace("\u202e", "\\u202e")
    assert line.startswith(f"{path}:2: message role {shown} must be one of system, user, assistant, tool; map record "
                           "roles onto them with data.roles, e.g. --set 'data.roles={")
    assert "\x1b" not in line and "\u202e" not in line and "\n" not in line


def test_every_record_with_unknown_roles_is_reported_with_all_its_roles(tmp_path):
    path = write_records(tmp_path / "d.jsonl", SHAREGPT, CANONICAL, SHAREGPT[:1])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=64), ByteTokenizer())
    assert [p.split(" must")[0] for p in err.value.problems] == [
        f"{path}:1: message roles 'human', 'gpt'", f"{path}:3: message role 'human'"]
    # The hint is the mapping that fixes the data.
    assert err.value.problems[0].endswith("--set 'data.roles={human: user, gpt: assistant}'")


@pytest.mark.parametrize("user, assistant", [("human", "gpt"), ("user", "Assistant"), ("User", "assistant")])
def test_unknown_roles_in_image_records_are_refused_too(tmp_path, user, assistant):
    from test_images import data_profile, vision, write_image

    write_image(tmp_path / "a.png", 16, 16)
    record = {"messages": [{"role": user, "content": "<image> what"}, {"role": assistant, "content": "a square"}],
              "images": ["a.png"]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    unknown = [r for r in (user, assistant) if r not in ("user", "assistant")]
    with pytest.raises(ProfileError) as err:
        load_documents(data_profile(path), ByteTokenizer(), vision())
    named = ", ".join(repr(r) for r in unknown)
    assert err.value.problems[0].startswith(f"{path}:1: message role{'s' * (len(unknown) > 1)} {named} must be one of")
    # Mapped, the record loads with its image.
    (doc,) = load_documents(data_profile(path, roles={user: "user", assistant: "assistant"}), ByteTokenizer(),
                            vision())
    assert len(doc.images) == 1 and "a square" in ByteTokenizer().decode(trained_ids(doc))


@pytest.mark.parametrize("value", ["bot", "Assistant", "", "function", "user "])
def test_roles_mapping_must_name_a_chat_role(value):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [f"data.roles={json.dumps({'human': 'user', 'gpt': value})}", "data.path=/nonexistent"])
    # Reported together with the profile's other problems.
    assert err.value.problems == [f"data.roles.gpt ({value!r}) must be one of system, user, assistant, tool",
                                  "data.path ('/nonexistent') must be an existing file"]


def test_canonical_messages_keep_the_rest_of_each_message():
    messages = [{"role": "human", "content": [{"type": "text", "text": "hi"}], "name": "x"}]
    assert canonical_messages(messages, {"human": "user"}, "f:1") == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "x"}]
    assert messages[0]["role"] == "human"


# Rendering: the whole conversation once, the template's own assistant spans


CONVERSATIONS = {
    "single": CANONICAL,
    "system": [{"role": "system", "content": "be brief"}, *CANONICAL],
    "multi_turn_think": MULTI_TURN,
    "multi_turn_plain": [CANONICAL[0], CANONICAL[1], {"role": "user", "content": "and?"},
                         {"role": "assistant", "content": "done"}],
    "ends_with_user": [*CANONICAL, {"role": "user", "content": "thanks"}],
    "agent_turns": [CANONICAL[0], {"role": "assistant", "content": "step"},
                    {"role": "assistant", "content": "<think>\nmore\n</think>\n\nfinal"}],
    # The assistant opens: what the template renders before its header (kimi's default system turn, a <bos>) is not
    # the turn's.
    "assistant_only": [CANONICAL[1]],
    "assistant_first": [CANONICAL[1], {"role": "user", "content": "and?"}, {"role": "assistant", "content": "done"}],
}  # fmt: skip


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_labels_are_the_templates_own_assistant_mask(tmp_path, tokenizers, family, conversation):
    tok, raw, directory = tokenizers[family, True]
    messages = CONVERSATIONS[conversation]
    doc = document(tmp_path, tok, messages, str(directory))
    input_ids, labels = expected_document(raw, messages)
    # Every template here closes the assistant's turns with a special token: nothing is appended.
    assert (doc.input_ids, doc.labels) == (input_ids, labels)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_assistant_turn_is_trained_once_and_nothing_else(tmp_path, tokenizers, family):
    tok, _, directory = tokenizers[family, True]
    trained = "".join(trained_runs(document(tmp_path, tok, MULTI_TURN, str(directory)), tok))
    for answer in ("answer one", "answer two"):
        assert trained.count(answer) == 1
    # Only the last turn keeps its reasoning (qwen3, deepseek_v3); kimi's template keeps the content as given.
    assert trained.count("plan two") == 1
    assert trained.count("plan one") == (1 if family == "kimi" else 0)
    for text in ("be brief", "question", "user", "Kimi"):
        assert text not in trained


@pytest.mark.parametrize("family, conversation", [
    (family, conversation) for family in FAMILIES
    for conversation in ("single", "system", "ends_with_user", "assistant_only", "assistant_first")
    # qwen3 gives the last assistant turn an empty think block: it holds as a prefix only while last.
    if not (family.startswith("qwen3") and conversation in ("ends_with_user", "assistant_first"))
])  # fmt: skip
def test_templates_without_generation_blocks_train_what_the_marked_ones_mark(tmp_path, tokenizers, family,
                                                                             conversation):
    """Growing prefixes, where they hold: the assistant's tokens from after the generation prompt to its closing
    token, as the same template with {% generation %} blocks marks them."""
    tok = tokenizers[family, False][0]
    messages = CONVERSATIONS[conversation]
    doc = document(tmp_path, tok, messages, str(tokenizers[family, False][2]))
    assert (doc.input_ids, doc.labels) == expected_document(tokenizers[family, True][1], messages)


@pytest.mark.parametrize("conversation", ["assistant_only", "assistant_first", "system"])
@pytest.mark.parametrize("family", ["kimi", "deepseek_v3"])
def test_headers_are_trained_alike_with_and_without_generation_blocks(tmp_path, tokenizers, family, conversation):
    """data.train_on_assistant_header: each assistant turn's header trained with it, the turn the assistant opens
    too, and nothing the template renders before that header (kimi's default system prompt)."""
    messages = CONVERSATIONS[conversation]
    docs = [document(tmp_path, tokenizers[family, marked][0], messages, str(tokenizers[family, marked][2]),
                     train_on_assistant_header=True) for marked in (True, False)]
    assert docs[0] == docs[1]
    runs = trained_runs(docs[1], tokenizers[family, False][0])
    header = "<|im_assistant|>assistant<|im_middle|>" if family == "kimi" else "<｜Assistant｜>"
    assert runs[0].startswith(header + "hello there") and "Kimi" not in "".join(runs)


@pytest.mark.parametrize("conversation", ["multi_turn_think", "multi_turn_plain"])
def test_kimi_multi_turn_holds_as_prefixes(tmp_path, tokenizers, conversation):
    messages = CONVERSATIONS[conversation]
    doc = document(tmp_path, tokenizers["kimi", False][0], messages, str(tokenizers["kimi", False][2]))
    assert (doc.input_ids, doc.labels) == expected_document(tokenizers["kimi", True][1], messages)


@pytest.mark.parametrize("family, conversation, turn", [
    ("qwen3", "multi_turn_think", 3),  # the first answer's think block is dropped once a user turn follows
    ("qwen3", "multi_turn_plain", 2),  # the last assistant turn gets an empty think block, earlier ones do not
    ("qwen3", "ends_with_user", 2),
    ("qwen3_base", "multi_turn_think", 3),
    ("qwen3", "agent_turns", 2),  # an agent turn without reasoning gets an empty think block only while last
    ("deepseek_v3", "multi_turn_think", 3),  # reasoning dropped from turns before the last user turn
])  # fmt: skip
def test_templates_that_rewrite_earlier_turns_are_refused_without_generation_blocks(tmp_path, tokenizers, family,
                                                                                    conversation, turn):
    tok, _, directory = tokenizers[family, False]
    path = write_records(tmp_path / "d.jsonl", CANONICAL, CONVERSATIONS[conversation])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=4096, tokenizer=str(directory)), tok)
    (line,) = err.value.problems
    head = f"{path}:2: the chat template renders turn {turn} (assistant) differently once later turns follow (token "
    tail = (" changes): the assistant's tokens cannot be found by rendering growing prefixes; use a tokenizer whose "
            "chat template marks them with {% generation %} ... {% endgeneration %}")
    assert re.fullmatch(re.escape(head) + r"\d+" + re.escape(tail), line), line


def test_a_template_that_raises_is_one_line_naming_the_record(tmp_path):
    directory = tmp_path / "tok"
    raw = save_tokenizer(directory, "kimi", True)
    raw.chat_template = ("{%- for m in messages %}{%- if loop.index0 % 2 == 0 and m.role != 'user' %}"
                         "{{ raise_exception('Conversation roles must alternate user/assistant') }}{%- endif %}"
                         "{{ m.content }}{%- endfor %}")
    raw.save_pretrained(directory)
    path = write_records(tmp_path / "d.jsonl", [CANONICAL[1], CANONICAL[0]])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=64, tokenizer=str(directory)), load_tokenizer(str(directory)))
    assert err.value.problems == [f"{path}:1: the chat template of data.tokenizer cannot render the conversation: "
                                  "'Conversation roles must alternate user/assistant'"]


# Tools

# A tool result in a user block of its own.
SEPARATE_RESULT = ("{%- elif m.role == 'tool' %}"
                   "{{- '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}")
TOOLS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}@GEN"
    "{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '<tool_call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>' }}@END{{- '\\n' }}"
    + SEPARATE_RESULT +
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# As Qwen2.5's and Qwen3's templates: consecutive tool results in one user block, closed after the last of them.
TOOLS_GROUPED = TOOLS.replace(
    SEPARATE_RESULT,
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>' + m.content + '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}")
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHATS = {
    "call_then_answer": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None,
                         "tool_calls": [CALL]}, {"role": "tool", "content": "23 C"},
                         {"role": "assistant", "content": "It is sunny."}],
    "content_and_call": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Checking.",
                         "tool_calls": [CALL]}, {"role": "tool", "content": "23 C"}],
    "no_content_key": [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [CALL, CALL]},
                       {"role": "tool", "content": "23 C"}, {"role": "tool", "content": "rain"},
                       {"role": "assistant", "content": "Mixed."}],
}  # fmt: skip


@pytest.fixture(scope="module")
def tool_tokenizers(tmp_path_factory):
    """(template, marked?) -> (our tokenizer, transformers' own, the directory), TOOLS or TOOLS_GROUPED."""
    made = {}
    for name, template in (("separate", TOOLS), ("grouped", TOOLS_GROUPED)):
        for marked in (True, False):
            directory = tmp_path_factory.mktemp(f"tools-{name}-{marked}")
            raw = save_tokenizer(directory, "qwen3", marked)
            raw.chat_template = template.replace("@GEN", GEN * marked).replace("@END", END_GEN * marked)
            raw.save_pretrained(directory)
            made[name, marked] = (load_tokenizer(str(directory)), raw, directory)
    return made


@pytest.mark.parametrize("template", ["separate", "grouped"])
@pytest.mark.parametrize("conversation", TOOL_CHATS)
def test_tool_calls_and_results_train_as_the_templates_mask(tmp_path, tool_tokenizers, conversation, template):
    """Tool calls (content null or left out beside tool_calls) and tool results (role tool) go to the template as
    they are: the assistant's calls are trained, the results never, as transformers' mask says; by growing prefixes
    as with the markers, consecutive results in one block too."""
    messages = TOOL_CHATS[conversation]
    made = {marked: tool_tokenizers[template, marked] for marked in (True, False)}
    docs = [document(tmp_path, made[marked][0], messages, str(made[marked][2])) for marked in (True, False)]
    assert (docs[0].input_ids, docs[0].labels) == expected_document(made[True][1], messages)
    assert docs[1] == docs[0]
    trained = "".join(trained_runs(docs[0], made[True][0]))
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in trained and "23 C" not in trained


@pytest.mark.parametrize("marked", [True, False])
def test_a_tool_call_turn_of_weight_0_is_context_not_refused(tmp_path, tool_tokenizers, marked):
    """Its call is written and untrained (it was refused as a call the template does not write); the answer after
    the result is trained."""
    messages = [dict(m, weight=0) if i == 1 else m for i, m in enumerate(TOOL_CHATS["call_then_answer"])]
    tok, _, directory = tool_tokenizers["separate", marked]
    doc = document(tmp_path, tok, messages, str(directory))
    trained = "".join(trained_runs(doc, tok))
    assert "get_weather" not in trained and "It is sunny." in trained
    assert "get_weather" in tok.decode(doc.input_ids)


TOOL_DEFS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("marked", [True, False])
def test_a_records_tools_reach_the_template_untrained(tmp_path, marked):
    """A record's `tools` (function definitions) go to the template as transformers' apply_chat_template(tools=...)
    takes them: written where the template writes them (a system block here), never trained."""
    directory = tmp_path / "tok"
    raw = save_tokenizer(directory, "qwen3", True)
    defined = ("{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- ' ' + t.function.name }}"
               "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}")
    raw.chat_template = defined + TOOLS.replace("@GEN", GEN).replace("@END", END_GEN)
    out = raw.apply_chat_template(TOOL_CHATS["call_then_answer"], tools=TOOL_DEFS, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    raw.chat_template = defined + TOOLS.replace("@GEN", GEN * marked).replace("@END", END_GEN * marked)
    raw.save_pretrained(directory)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": TOOL_CHATS["call_then_answer"], "tools": TOOL_DEFS}) + "\n")
    (doc,) = load_documents(DataProfile(path=path, seq_len=4096, tokenizer=str(directory)),
                            load_tokenizer(str(directory)))
    assert (doc.input_ids, doc.labels) == (ids[:-1], [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])])
    assert "Tools: get_weather get_time" in raw.decode(doc.input_ids)


@pytest.mark.parametrize("tools, message", [
    (TOOL_DEFS, "'tools' needs a chat template that writes them (data.chat_template, or the tokenizer's); the "
                "built-in <|role|> format has none"),
    ("get_weather", "'tools' must be a list of tool definitions (JSON objects), got str"),
    ([["get_weather"]], "'tools' must be a list of tool definitions (JSON objects), got list"),
])  # fmt: skip
def test_tools_the_format_cannot_write_or_not_definitions_are_refused(tmp_path, tools, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": CANONICAL, "tools": tools}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=256), ByteTokenizer())
    assert err.value.problems == [f"{path}:1: {message}"]


def test_a_tool_call_without_a_chat_template_is_refused(tmp_path):
    path = write_records(tmp_path / "d.jsonl", TOOL_CHATS["call_then_answer"])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=256), ByteTokenizer())
    assert err.value.problems == [f"{path}:1: a message with tool_calls needs a chat template that writes them "
                                  "(data.chat_template, or the tokenizer's); the built-in <|role|> format has none"]


@pytest.mark.parametrize("message, shown", [
    ({"role": "assistant", "content": None}, "turn 2 (assistant): 'content' (null)"),
    ({"role": "user"}, "turn 2 (user): 'content' (left out)"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "turn 2 (assistant): 'content' (null)"),
    ({"role": "assistant", "content": 42}, "turn 2 (assistant): 'content' (42)"),
    ({"role": "assistant", "content": True}, "turn 2 (assistant): 'content' (true)"),
    ({"role": "assistant", "content": {"text": "a" * 50}},
     "turn 2 (assistant): 'content' ({\"text\": \"aaaaaaaaaaaaaaaaaaaaaaaaaaa...)"),
])  # fmt: skip
def test_content_may_be_missing_only_beside_tool_calls(tmp_path, message, shown):
    """The line names the turn, its role and the value (shortened), as the rule for it."""
    path = write_records(tmp_path / "d.jsonl", [{"role": "user", "content": "hi"}, message])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=256), ByteTokenizer())
    assert err.value.problems == [f"{path}:1: {shown} must be a string (null or left out only beside tool_calls)"]


@pytest.mark.parametrize("messages, line", [
    ("hi", "'messages' (\"hi\") must be a list of messages {\"role\": str, \"content\": str}"),
    ({"role": "user"}, "'messages' ({\"role\": \"user\"}) must be a list of messages {\"role\": str, \"content\": str}"),
    ([{"role": "user", "content": "q"}, 7], "'messages' turn 2 (7) must be a message {\"role\": str, \"content\": str}"),
    ([{"content": "q"}], "turn 1: 'role' (left out) must be a string"),
    ([{"role": None, "content": "q"}], "turn 1: 'role' (null) must be a string"),
    ([{"role": ["user"], "content": "q"}], "turn 1: 'role' ([\"user\"]) must be a string"),
])  # fmt: skip
def test_a_malformed_message_list_names_the_turn_and_the_value(tmp_path, messages, line):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=256), ByteTokenizer())
    assert err.value.problems == [f"{path}:1: {line}"]


# Double end of turn


@pytest.mark.parametrize("marked", [True, False])
@pytest.mark.parametrize("family, closing", [
    ("qwen3", "<|im_end|>"), ("qwen3_base", "<|im_end|>"), ("deepseek_v3", "<｜end▁of▁sentence｜>"),
    ("kimi", "<|im_end|>"),
])  # fmt: skip
def test_an_end_of_turn_is_trained_once_per_assistant_turn(tmp_path, tokenizers, family, closing, marked):
    tok, raw, directory = tokenizers[family, marked]
    messages = CONVERSATIONS["single" if not marked else "multi_turn_think"]
    doc = document(tmp_path, tok, messages, str(directory))
    turns = sum(m["role"] == "assistant" for m in messages)
    closing_id = raw.convert_tokens_to_ids(closing)
    trained = trained_ids(doc)
    assert trained.count(closing_id) == turns
    # Nothing after the last closing token is trained, and the <eos> is never trained on its own.
    assert trained[-1] == closing_id and trained.count(tok.eos_id) == (turns if tok.eos_id == closing_id else 0)
    assert tok.eos_id not in doc.input_ids[-1:] or tok.eos_id == closing_id


@pytest.mark.parametrize("marked", [True, False])
@pytest.mark.parametrize("answer", ["fine", "fine\n\n", "caf\u00e9"])  # é is <unk> here: no end of turn
def test_a_template_without_an_end_of_turn_token_gets_one_trained_eos(tmp_path, marked, answer):
    directory = tmp_path / "tok"
    raw = save_tokenizer(directory, "kimi", marked)
    template = ("{%- for m in messages %}{{- m.role + ': ' }}{%- if m.role == 'assistant' %}@GEN"
                "{{- m.content }}@END{%- else %}{{- m.content }}{%- endif %}{{- '\n' }}{%- endfor %}")
    raw.chat_template = template.replace("@GEN", GEN * marked).replace("@END", END_GEN * marked)
    raw.save_pretrained(directory)
    tok = load_tokenizer(str(directory))
    messages = [CANONICAL[0], {"role": "assistant", "content": answer}]
    doc = document(tmp_path, tok, messages, str(directory))
    assert trained_ids(doc).count(tok.eos_id) == 1 and doc.labels[-1] == tok.eos_id
    # Without a generation prompt in the template, the plain one trains the turn's header too.
    assert tok.decode(trained_ids(doc)[:-1]) in (answer.replace("\u00e9", "<unk>"),
                                                 f"assistant: {answer}\n".replace("\u00e9", "<unk>"))


@pytest.mark.parametrize("between", ["", "\n"])
@pytest.mark.parametrize("conversation", ["single", "multi_turn_plain", "agent_turns"])
def test_a_closing_token_after_the_generation_block_is_trained(tmp_path, conversation, between):
    """`{% generation %}{{ content }}{% endgeneration %}<|im_end|>`: the turn's <|im_end|> is trained with it, as
    the same template without the markers trains it (by prefixes), and no <eos> is added."""
    directory = tmp_path / "tok"
    raw = save_tokenizer(directory, "qwen3", True)
    template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}{%- if m.role == 'assistant' %}@GEN"
                "{{- m.content }}@END{%- else %}{{- m.content }}{%- endif %}{{- '@BETWEEN<|im_end|>\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
    messages = CONVERSATIONS[conversation]
    docs = []
    for marked in (True, False):
        raw.chat_template = (template.replace("@GEN", GEN * marked).replace("@END", END_GEN * marked)
                             .replace("@BETWEEN", between))
        raw.save_pretrained(directory)
        docs.append(document(tmp_path, load_tokenizer(str(directory)), messages, str(directory)))
    assert docs[0] == docs[1]
    close = raw.convert_tokens_to_ids("<|im_end|>")
    turns = sum(m["role"] == "assistant" for m in messages)
    assert trained_ids(docs[0]).count(close) == turns and trained_ids(docs[0])[-1] == close


def test_a_template_that_does_not_close_its_turns_gets_an_eos(tmp_path):
    # The byte tokenizer's plain format ends turns with a newline: <eos> is appended and trained, once.
    doc = document(tmp_path, ByteTokenizer(), CONVERSATIONS["multi_turn_plain"])
    assert trained_ids(doc).count(ByteTokenizer.eos_id) == 1 and doc.labels[-1] == ByteTokenizer.eos_id
    # After a user turn nothing is appended: the model is not taught to end the conversation there.
    doc = document(tmp_path, ByteTokenizer(), CONVERSATIONS["ends_with_user"])
    assert ByteTokenizer.eos_id not in doc.input_ids + doc.labels and doc.labels[-1] == IGNORE_INDEX


# Nothing to train on


@pytest.mark.parametrize("records, roles", [
    ([[{"role": "user", "content": "hi"}]], {}),
    ([[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]] * 3, {}),
    ([SHAREGPT, SHAREGPT], {"human": "user", "gpt": "user"}),  # a mapping that leaves no assistant turn
    ([SHAREGPT], {"human": "user", "gpt": "system"}),
])  # fmt: skip
@pytest.mark.parametrize("tokenizer", ["byte", "kimi"])
def test_a_dataset_without_a_token_to_train_on_is_refused(tmp_path, tokenizers, records, roles, tokenizer):
    tok, name = (ByteTokenizer(), "byte") if tokenizer == "byte" else (
        tokenizers[tokenizer, True][0], str(tokenizers[tokenizer, True][2]))
    path = write_records(tmp_path / "d.jsonl", *records)
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=64, tokenizer=name, roles=roles), tok)
    assert err.value.problems == [f"data.path ('{path}') must hold at least one token to train on (its {len(records)} "
                                  "documents train nothing: a chat trains its assistant turns but those of weight 0 or "
                                  "that say nothing, a text all but a blank one)"]


def test_a_step_without_a_token_to_train_on_stops_the_run(tmp_path):
    """A prompt longer than a row fills the first step's rows with masked labels: the step is refused (exit 2), not
    trained as 0 / 0, and nothing of it is saved."""
    long_prompt = [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]
    path = write_records(tmp_path / "d.jsonl", long_prompt)
    # One full-attention layer: the step is what is tested, not the model.
    result = finetune_cli(path, tmp_path / "out", "data.seq_len=64", "train.micro_batch_size=2", "train.steps=2",
                          "train.warmup_steps=0", "model.layers=[{attention: full, mlp: moe}]",
                          "lora.target_modules=[q_proj, v_proj]")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: step 1: none of its 2 rows (rows 0..1 of the packed data, data.seq_len 64) holds a token to train on: "
        "records without assistant tokens, or prompts cut into rows of data.seq_len, leave every label there masked; "
        "drop such records, or raise data.seq_len or train.micro_batch_size (step 1 is not saved)"
    )
    assert not list((tmp_path / "out").glob("checkpoints/*"))


def test_finetune_on_sharegpt_roles_exits_2_naming_the_record(tmp_path):
    path = write_records(tmp_path / "d.jsonl", CANONICAL, SHAREGPT)
    result = finetune_cli(path, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: {path}:2: message roles 'human', 'gpt' must be one of system, user, assistant, tool; map record roles "
        "onto them with data.roles, e.g. --set 'data.roles={human: user, gpt: assistant}'"
    )
    assert not (tmp_path / "out" / "checkpoints").exists()
    # With the mapping the hint gives, the same data is read (and a bad mapping is refused in one line).
    result = finetune_cli(path, tmp_path / "out", "data.roles={human: user, gpt: bot}")
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: data.roles.gpt ('bot') must be one of system, user, assistant, tool")


def finetune_cli(data, out, *overrides):
    from typer.testing import CliRunner

    from moe_tune.cli import app

    sets = [a for o in (f"data.path={data}", f"output.dir={out}", *overrides) for a in ("--set", o)]
    return CliRunner().invoke(app, ["finetune", "tiny", "--quiet", *sets])


@pytest.mark.parametrize("message, line", [
    ({"role": "assistant", "content": None, "tool_calls": "get_weather"},
     "turn 2's 'tool_calls' must be a list of calls, each an object whose 'function' object has a 'name' string"),
    ({"role": "assistant", "content": None, "tool_calls": [None]},
     "turn 2's 'tool_calls' must be a list of calls, each an object whose 'function' object has a 'name' string"),
    ({"role": "assistant", "content": "x", "tool_calls": [{"function": None}]},
     "turn 2's 'tool_calls' must be a list of calls, each an object whose 'function' object has a 'name' string"),
    ({"role": "user", "content": None, "tool_calls": [CALL]},
     "turn 2 (user) has 'tool_calls'; only an assistant message calls tools"),
])  # fmt: skip
def test_tool_calls_that_are_no_calls_or_not_the_assistants_are_refused(tmp_path, tool_tokenizers, message, line):
    tok, _, directory = tool_tokenizers["separate", True]
    path = write_records(tmp_path / "d.jsonl", [{"role": "user", "content": "weather?"}, message])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=4096, tokenizer=str(directory)), tok)
    assert err.value.problems == [f"{path}:1: {line}"]


@pytest.mark.parametrize("left_out, line", [
    ("calls", "the chat template writes no trained token of turn 2's call of 'get_weather': a template must write "
              "an assistant's tool_calls (data.chat_template, or the tokenizer's)"),
    ("results", "the chat template does not write turn 3 (tool)'s result: a template must write tool messages "
                "(data.chat_template, or the tokenizer's)"),
])  # fmt: skip
@pytest.mark.parametrize("marked", [True, False])
def test_a_template_that_leaves_tool_calls_or_results_out_is_refused(tmp_path, left_out, line, marked):
    """A template without a branch for them would train an empty turn (its closing token alone: the model learns to
    stop), or an answer to a result it never saw."""
    directory = tmp_path / "tok"
    raw = save_tokenizer(directory, "qwen3", marked)
    template = TOOLS.replace("@GEN", GEN * marked).replace("@END", END_GEN * marked)
    if left_out == "calls":
        template = template.replace("{%- for call in m.tool_calls or [] %}", "{%- for call in [] %}")
    else:
        template = template.replace("m.content + '</tool_response>", "'</tool_response>")
    raw.chat_template = template
    raw.save_pretrained(directory)
    path = write_records(tmp_path / "d.jsonl", TOOL_CHATS["call_then_answer"])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=4096, tokenizer=str(directory)), load_tokenizer(str(directory)))
    assert err.value.problems == [f"{path}:1: {line}"]


def test_sharegpt_tools_reach_the_template(tmp_path):
    """A ShareGPT record's tools are the chat's, as a messages record's: refused where no template writes them."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
                                "tools": TOOL_DEFS}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=256), ByteTokenizer())
    assert err.value.problems == [f"{path}:1: 'tools' needs a chat template that writes them (data.chat_template, "
                                  "or the tokenizer's); the built-in <|role|> format has none"]


def test_a_closing_token_after_the_block_is_trained_where_the_template_wants_a_system_turn(tmp_path):
    """The closing token is found from a probe conversation, or, where the template refuses it (a system turn
    first), from the record's own conversation up to its first assistant turn."""
    directory = tmp_path / "tok"
    raw = save_tokenizer(directory, "qwen3", True)
    raw.chat_template = (
        "{%- if messages[0].role != 'system' %}{{ raise_exception('a system turn first') }}{%- endif %}"
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.role == 'assistant' %}"
        "{% generation %}{{- m.content }}{% endgeneration %}{%- else %}{{- m.content }}{%- endif %}"
        "{{- '<|im_end|>\\n' }}{%- endfor %}")
    raw.save_pretrained(directory)
    tok = load_tokenizer(str(directory))
    doc = document(tmp_path, tok, [{"role": "system", "content": "s"}, *CANONICAL], str(directory))
    assert trained_runs(doc, tok) == ["hello there<|im_end|>"]


def test_a_records_own_tools_and_arguments_count_as_its_text_against_the_render_limit():
    """The limit on what a template renders counts the record's own text: a large tool schema or call arguments
    written out are the record's, not a template rendering more than the conversation."""
    from moe_tune.engine.data.tokenizer import RENDERED_EXTRA_CHARS, render_template_text

    template = "{{ tools | tojson }}{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}"
    big = "x" * RENDERED_EXTRA_CHARS
    tools = [{"type": "function", "function": {"name": "f", "description": big}}]
    calls = [{"type": "function", "function": {"name": "f", "arguments": {"text": big}}}]
    text, _ = render_template_text(template, [{"role": "assistant", "content": None, "tool_calls": calls}], False,
                                   False, "d.jsonl:1", tools)
    assert len(text) > 2 * RENDERED_EXTRA_CHARS
    with pytest.raises(ProfileError, match=r"^d.jsonl:1: data.chat_template renders \d+ characters from messages of"):
        render_template_text("{{ 'y' * 3000000 }}", [{"role": "user", "content": "x"}], False, False, "d.jsonl:1")


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "ok", "reasoning_content": "x" * 2**20},  # a long thinking trace
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x" * 2**20}]},  # a multimodal turn
], ids=["reasoning_content", "text_parts"])  # fmt: skip
def test_a_records_reasoning_and_text_parts_count_as_its_text_against_the_render_limit(message):
    from moe_tune.engine.data.tokenizer import RENDERED_EXTRA_CHARS, render_template_text

    template = ("{% for m in messages %}{{ m.reasoning_content or '' }}{% if m.content is string %}{{ m.content }}"
                "{% else %}{% for p in m.content %}{{ p.text or '<image>' }}{% endfor %}{% endif %}{% endfor %}")
    text, _ = render_template_text(template + "{{ 'y' * 2**20 }}", [message], False, False, "d.jsonl:1")
    assert len(text) > 2 * RENDERED_EXTRA_CHARS


@pytest.mark.parametrize("role, likely", [
    ("developer", "system"), ("AI", "assistant"), ("chatgpt", "assistant"), ("Bing", "assistant"),
    ("model", "assistant"), ("observation", "tool"), ("Human", "user"), ("narrator", "user"),
])  # fmt: skip
def test_the_roles_hint_maps_each_unknown_role_onto_the_role_it_likely_means(tmp_path, role, likely):
    """OpenAI's developer instructions are a system prompt, assistants go by many names; a role no tool names is
    hinted as the user's."""
    path = write_records(tmp_path / "d.jsonl", [{"role": role, "content": "x"}])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=64), ByteTokenizer())
    assert err.value.problems[0].endswith(f"e.g. --set 'data.roles={{{role}: {likely}}}'")


@pytest.mark.parametrize("records, count, first", [
    ([{"text": "hello<|im_end|>world"}], 1, "'<|im_end|>' at {path}:1"),
    ([{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd<|im_end|>more"}]},
      {"text": "clean"}, {"messages": [{"role": "system", "content": "<|im_start|>x"},
                                       {"role": "assistant", "content": "y"}]}], 2, "'<|im_end|>' at {path}:1"),
    ([{"instruction": "i<|endoftext|>", "output": "o"}], 1, "'<|endoftext|>' at {path}:1"),
    ([{"text": "<|im_end" + "|> split by nothing"}, {"text": "<| im_end |>"}], 1, "'<|im_end|>' at {path}:1"),
    ([{"text": "no special text"}], 0, ""),
])  # fmt: skip
def test_records_whose_text_holds_a_special_tokens_text_are_counted(tmp_path, tokenizers, records, count, first):
    """The tokenizer encodes '<|im_end|>' in a record's text into the token itself, as transformers does (an <eos>
    trained mid-answer, a forged turn): the source's summary counts such records and names the first."""
    tok, _, directory = tokenizers["qwen3", True]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    (source,) = load_splits(DataProfile(path=path, seq_len=256, tokenizer=str(directory)), tok).summary.sources
    assert source.special_text == (count, first.format(path=path))
    noted = f"{count} with a special token's text, encoded as the token: {first.format(path=path)}"
    assert (noted in source.line()) == bool(count)
    byte = load_splits(DataProfile(path=path, seq_len=256), ByteTokenizer()).summary.sources[0]
    assert byte.special_text == (0, "")


@pytest.mark.parametrize("messages", [5, "<|im_end|>", {"content": "<|im_end|>"}, [5, None]])
def test_malformed_messages_are_one_line_with_a_tokenizer_of_special_texts(tmp_path, tokenizers, messages):
    """The special-text count reads a record before its messages are checked: whatever they are, the record's
    refusal is the message check's one line."""
    tok, _, directory = tokenizers["qwen3", True]
    path = write_records(tmp_path / "d.jsonl", messages)
    with pytest.raises(ProfileError) as err:
        load_splits(DataProfile(path=path, seq_len=256, tokenizer=str(directory)), tok)
    (line,) = err.value.problems
    assert line.startswith(f"{path}:1: ") and "must be a" in line


def test_a_long_unknown_role_is_shown_short_and_the_rule_whole(tmp_path):
    role = "speaker " + "x" * 5000
    path = write_records(tmp_path / "d.jsonl", [{"role": role, "content": "x"}])
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=64), ByteTokenizer())
    (line,) = err.value.problems
    shown = repr(role)[:57] + "..."
    assert line == (f"{path}:1: message role {shown} must be one of system, user, assistant, tool; map record roles "
                    f"onto them with data.roles, e.g. --set 'data.roles={{{json.dumps(role)[:57]}...: user}}'")
