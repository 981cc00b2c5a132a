"""The shipped benchmark profiles (docs/bench.md, "Benchmark profiles") and the long documents that fill their rows."""

import pytest

from moe_tune.engine.bench.documents import long_documents, write_long_documents
from moe_tune.profiles import load_profile


@pytest.mark.parametrize("name", ["bench-qwen3-next", "bench-qwen3-moe", "bench-qwen3-next-32k"])
def test_bench_profiles_train_as_the_anchor_runs(name):
    """Random init, bf16, LoRA r16 alpha 32 on q/k/v/o and the routed experts, AdamW (the trainer's), B2 T4096;
    the long-context variant one row of 32K."""
    job = load_profile(name)
    model = job.model
    assert (model.vocab_size, model.hidden_size, len(model.layers)) == (32000, 2048, 8)
    assert (model.num_attention_heads, model.num_key_value_heads, model.head_dim) == (16, 4, 128)
    assert (model.moe.num_experts, model.moe.top_k, model.moe.expert_intermediate_size) == (64, 8, 768)
    assert model.checkpoint is None and job.train.precision == "bf16"
    assert (job.lora.r, job.lora.alpha, job.lora.experts) == (16, 32, True)
    assert job.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    if name.endswith("-32k"):
        assert (job.train.micro_batch_size, job.data.seq_len, job.memory.preset) == (1, 32768, "max-context")
        assert job.model == load_profile("bench-qwen3-next").model
    else:
        assert (job.train.micro_batch_size, job.data.seq_len, job.memory.preset) == (2, 4096, "none")


def test_hybrid_bench_model_is_qwen3_next_like():
    model = load_profile("bench-qwen3-next").model
    # full_attention_interval 4: every fourth layer full attention, the rest gated delta net.
    assert [layer.attention for layer in model.layers] == ["linear", "linear", "linear", "full"] * 2
    spec = model.linear_attention
    assert (spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim) == (16, 32, 128, 128)
    assert model.moe.shared_expert_intermediate_size == 768


@pytest.mark.parametrize("seq_len", [8, 100, 4096])
def test_long_documents_fill_one_row_each(tmp_path, seq_len):
    from moe_tune.engine.data.dataset import PackedDataset, load_documents
    from moe_tune.engine.data.tokenizer import load_tokenizer
    from moe_tune.profiles.schema import DataProfile

    texts = long_documents(seq_len, count=5)
    assert [len(text.encode()) for text in texts] == [seq_len - 1] * 5
    path = write_long_documents(tmp_path / "long.jsonl", seq_len, count=5)
    tok = load_tokenizer("byte")
    documents = load_documents(DataProfile(path=path, seq_len=seq_len), tok)
    dataset = PackedDataset(documents, seq_len, tok.pad_id, seed=0)
    batch = dataset.micro_batch(0, rows_per_rank=4)
    # One piece per row, nothing padded: every row is one document of seq_len tokens.
    assert batch.cu_seqlens.tolist() == [i * seq_len for i in range(5)]
    assert batch.num_label_tokens == 4 * seq_len
