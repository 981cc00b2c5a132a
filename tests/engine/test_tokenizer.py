"""Tokenizers: an <eos> that is the vocabulary's <unk> is refused (a byte-level BPE's nominal unk_token is not that);
a tokenizer's own chat template is rendered once, as transformers renders it, under the same limit on what it renders
as data.chat_template; what a template renders for the probe conversation is found once per template, a refusal too.

The tiny character-level tokenizers are test_chat.py's.
"""

import pytest
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.data.chat import ChatOptions, chat_tokens
from moe_tune.engine.data.dataset import IGNORE_INDEX, load_documents
from moe_tune.engine.data.tokenizer import (
    RENDERED_EXTRA_CHARS,
    RENDERED_PER_CONTENT_CHAR,
    ByteTokenizer,
    load_tokenizer,
)
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import DataProfile
from test_chat import CANONICAL, END_GEN, GEN, expected_document, save_tokenizer, write_records

GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Turns closed by the tokenizer's own <eos> (as base checkpoints' templates close them).
EOS_CLOSED = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.role == 'assistant' %}@GEN"
              "{{- m.content + eos_token }}@END{%- else %}{{- m.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}"
              "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def save_vocabulary_tokenizer(directory, model: str, eos: str):
    """A tokenizer whose vocabulary model ('wordlevel', 'wordpiece', or a 'bpe' with byte fallback, as Llama's) gives
    text it lacks its <unk>, with `eos` as its eos_token."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    unk = "[UNK]" if model == "wordpiece" else "<unk>"
    vocab = {unk: 0, "</s>": 1} | {c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    core = Tokenizer({
        "wordlevel": lambda: models.WordLevel(vocab, unk_token=unk),
        "wordpiece": lambda: models.WordPiece(vocab, unk_token=unk),
        "bpe": lambda: models.BPE(vocab, [], unk_token=unk, byte_fallback=True),
    }[model]())  # fmt: skip
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token=unk, eos_token=eos).save_pretrained(directory)


def save_gpt2_like(directory, template: str | None = None):
    """A byte-level BPE tokenizer as GPT-2's (its vocabulary has every byte: no text is unknown to it) whose
    unk_token, bos_token and eos_token are all <|endoftext|>, with a few merges that join a space to the word after
    it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("\u0120", "h"), ("\u0120h", "e"), ("l", "l"), ("\u0120he", "ll"), ("\u0120hell", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    core = Tokenizer(models.BPE(vocab, merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    raw = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>")
    raw.add_special_tokens({"additional_special_tokens": GPT2_SPECIALS[1:]})
    raw.chat_template = template
    raw.save_pretrained(directory)
    return raw


# An <eos> that is the vocabulary's <unk>


@pytest.mark.parametrize("model, eos", [
    ("wordlevel", "<unk>"),
    ("wordpiece", "[UNK]"),
    ("bpe", "<unk>"),  # byte fallback: <unk> is still the vocabulary's token for what it lacks
])  # fmt: skip
def test_an_eos_that_is_the_unk_token_is_refused_naming_the_tokenizer(tmp_path, model, eos):
    save_vocabulary_tokenizer(tmp_path / "tok", model, eos)
    with pytest.raises(ProfileError) as err:
        load_tokenizer(str(tmp_path / "tok"))
    assert err.value.problems == [
        f"data.tokenizer ('{tmp_path / 'tok'}') has eos_token {eos!r}, the token its vocabulary gives text it lacks "
        "(unk_token): it cannot end a document (the model would learn to end with it, and generation would not "
        "stop); set eos_token in its tokenizer_config.json to the token that ends a text"]


@pytest.mark.parametrize("model", ["wordlevel", "wordpiece", "bpe"])
def test_an_eos_beside_the_unk_token_is_read(tmp_path, model):
    save_vocabulary_tokenizer(tmp_path / "tok", model, "</s>")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.eos_id == 1 and tok.eos_id in tok.special_ids and 0 not in tok.special_ids


def test_an_unk_token_the_vocabulary_does_not_give_may_be_the_eos(tmp_path):
    """The unk_token of tokenizer_config.json names </s>, but the vocabulary gives unknown text <unk>: </s> ends
    documents and closes turns; <unk> never closes one."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="</s>", eos_token="</s>").save_pretrained(tmp_path / "t")
    tok = load_tokenizer(str(tmp_path / "t"))
    assert tok.eos_id == 1 and 1 in tok.special_ids and 0 not in tok.special_ids


def test_validate_exits_2_on_an_eos_that_is_the_unk_token(tmp_path):
    save_vocabulary_tokenizer(tmp_path / "tok", "wordlevel", "<unk>")
    data = write_records(tmp_path / "d.jsonl", CANONICAL)
    sets = [a for o in (f"data.path={data}", f"data.tokenizer={tmp_path / 'tok'}") for a in ("--set", o)]
    result = CliRunner().invoke(app, ["validate", "tiny", *sets])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: data.tokenizer ('{tmp_path / 'tok'}') has eos_token '<unk>', the token its vocabulary gives text it "
        "lacks (unk_token): it cannot end a document (the model would learn to end with it, and generation would not "
        "stop); set eos_token in its tokenizer_config.json to the token that ends a text"]


@pytest.mark.parametrize("marked", [True, False])
@pytest.mark.parametrize("messages", [
    CANONICAL,
    [{"role": "system", "content": "be brief"}, *CANONICAL, {"role": "user", "content": "and?"},
     {"role": "assistant", "content": "hello"}],
])  # fmt: skip
def test_a_byte_level_eos_named_unk_too_closes_turns_as_the_template_renders_them(tmp_path, marked, messages):
    """GPT-2's <|endoftext|> is its unk_token, bos_token and eos_token, and no text is unknown to its vocabulary:
    read, and a template that closes turns with it trains each <eos> once, as transformers marks it."""
    directory = tmp_path / "tok"
    raw = save_gpt2_like(directory, EOS_CLOSED.replace("@GEN", GEN).replace("@END", END_GEN))
    reference = expected_document(raw, messages)
    raw = save_gpt2_like(directory, EOS_CLOSED.replace("@GEN", GEN * marked).replace("@END", END_GEN * marked))
    tok = load_tokenizer(str(directory))
    assert tok.eos_id == raw.convert_tokens_to_ids("<|endoftext|>") and tok.eos_id in tok.special_ids
    (doc,) = load_documents(DataProfile(path=write_records(tmp_path / "d.jsonl", messages), seq_len=4096,
                                        tokenizer=str(directory)), tok)  # fmt: skip
    assert (doc.input_ids, doc.labels) == reference


# The tokenizer's own template: rendered once, as transformers renders it, under data.chat_template's limit


@pytest.mark.parametrize("messages", [
    CANONICAL,
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello hello"}],
    [{"role": "assistant", "content": " hello"}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
])  # fmt: skip
@pytest.mark.parametrize("opening", ["", " ", "he"], ids=["at-a-word", "after-a-space", "inside-a-word"])
def test_the_assistant_mask_is_transformers_where_tokens_straddle_the_generation_blocks(tmp_path, messages, opening):
    """Merged tokens (' hello') that cross a block's edge are marked as apply_chat_template marks them."""
    template = ("{%- for m in messages %}{{- m.role + ':' }}{%- if m.role == 'assistant' %}{{- '" + opening + "' }}"
                "{% generation %}{{- m.content or '' }}{%- for c in m.tool_calls or [] %}{{- c.function.name }}"
                "{%- endfor %}{% endgeneration %}{%- else %}{{- m.content }}{%- endif %}{{- '<|im_end|>' }}"
                "{%- endfor %}")  # fmt: skip
    raw = save_gpt2_like(tmp_path / "tok", template)
    tok = load_tokenizer(str(tmp_path / "tok"))
    out = raw.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, trained = chat_tokens(tok.render_chat(messages, "r", ChatOptions()), tok, False, ChatOptions())
    mask = [bool(m) for m in out["assistant_masks"]]
    # The turn's <|im_end|> after a block is trained with it (chat._with_closing_tokens).
    closing = [t == raw.convert_tokens_to_ids("<|im_end|>") and i > 0 and mask[i - 1] for i, t in enumerate(ids)]
    assert ids == list(out["input_ids"])
    assert trained == [m or c for m, c in zip(mask, closing)]
    assert tok.render_ids(messages, ChatOptions(), True, "r") == raw.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]


@pytest.mark.parametrize("source", ["tokenizer", "profile"])
@pytest.mark.parametrize("reader", ["render_chat", "render_ids"])
def test_a_template_rendering_far_more_than_the_conversation_is_refused_whichever_it_is(tmp_path, source, reader):
    """The tokenizer's own template (training, and the prompt of generate) as data.chat_template."""
    template = "{{ 'x' * 10**7 }}{% for m in messages %}{{ m.content }}{% endfor %}"
    raw = save_tokenizer(tmp_path / "tok", "kimi", True)
    raw.chat_template = template if source == "tokenizer" else raw.chat_template
    raw.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    options = ChatOptions(template=None if source == "tokenizer" else template)
    with pytest.raises(ProfileError) as err:
        if reader == "render_chat":
            tok.render_chat(CANONICAL, "d.jsonl:1", options)
        else:
            tok.render_ids(CANONICAL, options, True, "d.jsonl:1")
    field = "the chat template of data.tokenizer" if source == "tokenizer" else "data.chat_template"
    content = sum(len(m["content"]) for m in CANONICAL)
    rendered = 10**7 + content
    assert err.value.problems == [
        f"d.jsonl:1: {field} renders {rendered} characters from messages of {content}, more than "
        f"{RENDERED_EXTRA_CHARS + RENDERED_PER_CONTENT_CHAR * content}: a template renders the conversation, not more"]


@pytest.fixture
def renders(monkeypatch):
    """Every conversation transformers' Jinja renders, as the template sees its messages."""
    import transformers.tokenization_utils_base as tokenization
    from transformers.utils import chat_template_utils

    seen = []
    render = chat_template_utils.render_jinja_template

    def counted(conversations, **kwargs):
        seen.append([dict(m) for m in conversations[0]])
        return render(conversations, **kwargs)

    # Where apply_chat_template finds it too.
    for module in (chat_template_utils, tokenization):
        monkeypatch.setattr(module, "render_jinja_template", counted)
    return seen


@pytest.mark.parametrize("with_mask", [True, False])
def test_the_tokenizers_template_is_rendered_once_for_ids_and_mask(tmp_path, renders, with_mask):
    """One rendering by transformers' Jinja gives the ids (and the mask) that apply_chat_template gives."""
    raw = save_tokenizer(tmp_path / "tok", "kimi", True)
    tok = load_tokenizer(str(tmp_path / "tok"))
    out = raw.apply_chat_template(CANONICAL, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    renders.clear()
    if with_mask:
        (ids, _), = tok.render_chat(CANONICAL, "r", ChatOptions(train_on="all"))
    else:
        ids = tok.render_ids(CANONICAL, ChatOptions(), False, "r")
    assert renders == [CANONICAL] and ids == list(out["input_ids"])


# The probe conversation: once per template

PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
TURNS = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.role == 'assistant' %}@GEN"
         "{{- m.content }}@END{%- else %}{{- m.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# A template that wants the assistant to open: it refuses the probe, which opens with a user turn.
ASSISTANT_FIRST = "{%- if messages[0].role == 'user' %}{{ raise_exception('the assistant opens') }}{%- endif %}" + TURNS


@pytest.mark.parametrize("template", [ASSISTANT_FIRST, TURNS], ids=["refuses-the-probe", "renders-it"])
@pytest.mark.parametrize("tokenizer", ["hf", "byte"])
@pytest.mark.parametrize("marked", [True, False])
def test_the_probe_conversation_is_rendered_once_per_template(tmp_path, renders, template, tokenizer, marked):
    """Three records the assistant opens, each trained as the first: the probe's closing token (a template with
    generation blocks) or generation prompt (one without) is rendered for the first record only, also where the
    template refuses the probe."""
    text = template.replace("@GEN", GEN * marked).replace("@END", END_GEN * marked)
    if tokenizer == "hf":
        raw = save_tokenizer(tmp_path / "tok", "qwen3", True)
        raw.chat_template = text
        raw.save_pretrained(tmp_path / "tok")
        tok, data = load_tokenizer(str(tmp_path / "tok")), {"tokenizer": str(tmp_path / "tok")}
    else:
        tok, data = ByteTokenizer(), {"chat_template": text}
    record = [{"role": "assistant", "content": "hello there"}]
    path = write_records(tmp_path / "d.jsonl", record, record, record)
    docs = load_documents(DataProfile(path=path, seq_len=4096, **data), tok)
    assert len(docs) == 3 and docs[0] == docs[1] == docs[2]
    # The byte tokenizer's <|im_end|> is text, no token that closes a turn: its <eos> (which decode drops) does.
    trained = {("hf", True): "hello there<|im_end|>", ("hf", False): "hello there<|im_end|>",
               ("byte", True): "hello there", ("byte", False): "hello there<|im_end|>\n"}[tokenizer, marked]
    labelled = [t for t, label in zip(docs[0].input_ids[1:], docs[0].labels) if label != IGNORE_INDEX]
    assert tok.decode(labelled) == trained
    # With blocks: the probe conversation; without: its user turn, then (where that renders) with the prompt.
    expected = [PROBE] if marked else [PROBE[:1]] * (1 if template == ASSISTANT_FIRST else 2)
    assert [r for r in renders if r in (PROBE, PROBE[:1])] == expected
