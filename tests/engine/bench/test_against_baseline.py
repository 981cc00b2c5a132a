"""What the `--against transformers` baseline starts from and what it runs (engine/bench/against.py): a model built
from a profile hands its initial weights to the baseline (first-step losses equal in fp32), and the row names the
linear-attention implementations read from the built model."""

import json
import random

import pytest
import torch
from torch import nn

from moe_tune.engine.bench.against import InitialWeights, initial_weights_text, kernel_paths
from moe_tune.profiles import validate_profile

# Rows of one document each (the byte tokenizer's <bos> and SEQ_LEN - 1 bytes): transformers attends over whole
# rows, we over documents, so only such rows give both the same attention.
SEQ_LEN = 24
# Bytes of a packed document: with <bos>, SEQ_LEN / 3 inputs, so a row packs three documents.
DOCUMENT_BYTES = SEQ_LEN // 3 - 1
NEXT_MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"
# What transformers' qwen3_next runs without flash-linear-attention and causal-conv1d (or inside pure_torch_paths).
TORCH_PATHS = {
    "linear_attention_implementation": f"{NEXT_MODULE}.torch_chunk_gated_delta_rule",
    "causal_conv_implementation": f"{NEXT_MODULE}.causal_conv1d_fn",
    "gated_norm_implementation": f"{NEXT_MODULE}.Qwen3NextRMSNormGated",
}
# The module FLA's chunked gated delta rule is defined in (fla-core 0.6.0).
FLA_CHUNK_MODULE = "fla.ops.gated_delta_rule.chunk"
# The row's `documents` where FLA keeps the delta rule's documents apart and transformers' PyTorch short conv runs
# (causal-conv1d not installed).
FLA_DOCUMENTS = ("kept apart in full attention and the linear-attention layers' delta rule (one packed row [1, R*L]: "
                 "position_ids restart at each document, cu_seq_lens_q bounds the delta rule); their short conv runs "
                 "across the documents of the packed row (their causal_conv1d_fn does not keep them apart given "
                 "seq_idx)")  # fmt: skip
NEXT_LIKE = dict(
    vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    partial_rotary_factor=0.5, norm_one_plus=True,
    layers=[{"attention": "linear"}, {"attention": "full"}, {"attention": "linear", "mlp": "dense"}],
    intermediate_size=40,
    linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12),
    moe=dict(num_experts=4, top_k=2, expert_intermediate_size=16, shared_expert_intermediate_size=16),
)  # fmt: skip
MOE_LIKE = dict(
    vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    attention_output_gate=False, layers=[{"attention": "full"}, {"attention": "full"}],
    moe=dict(num_experts=4, top_k=2, expert_intermediate_size=16),
)  # fmt: skip


def as_fla(function):
    """`function` named as FLA's chunked gated delta rule is (its module and qualified name)."""
    function.__module__, function.__qualname__ = FLA_CHUNK_MODULE, "chunk_gated_delta_rule"
    return function


def one_document_rows(path, count=12):
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh .") for _ in range(SEQ_LEN - 1))}) + "\n"
                            for _ in range(count)))  # fmt: skip
    return path


def packed_rows(path, count=12):
    """Documents of DOCUMENT_BYTES bytes: <bos> and those bytes are DOCUMENT_BYTES + 1 inputs, three to a row."""
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh .") for _ in range(DOCUMENT_BYTES))})
                            + "\n" for _ in range(count)))  # fmt: skip
    return path


def job_of(model: dict, tmp_path, precision: str = "fp32", rows=one_document_rows):
    return validate_profile({
        "name": "from-profile",
        "model": model,
        "data": {"path": str(rows(tmp_path / "rows.jsonl")), "tokenizer": "byte", "seq_len": SEQ_LEN},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "experts": True},
        "train": {"steps": 4, "micro_batch_size": 2, "lr": 1e-3, "precision": precision},
        "output": {"dir": str(tmp_path / "out")},
    })  # fmt: skip


@pytest.mark.parametrize("model", [NEXT_LIKE, MOE_LIKE], ids=["qwen3_next", "qwen3_moe"])
def test_baseline_starts_from_our_initial_weights(tmp_path, monkeypatch, model):
    """From random init (no checkpoint) the baseline loads our initial weights: the first step's loss is ours in
    fp32 (the adapters start as a no-op), and the row says where its weights came from and what it ran."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    from moe_tune.engine.bench.steps import profile_steps

    lines = []
    result = profile_steps(job_of(model, tmp_path), steps=1, warmup=1, against="transformers", on_line=lines.append)
    other = result["against"]
    assert other["first_step_loss"] == pytest.approx(result["first_step_loss"], rel=1e-5, abs=0)
    assert other["initial_weights"] == "ours (our initial weights written as a transformers checkpoint)"
    assert any(line.startswith("writing our initial weights as a transformers checkpoint") for line in lines)
    # On a CPU the baseline runs transformers' PyTorch paths (pure_torch_paths), and its row says so.
    expected = TORCH_PATHS if model is NEXT_LIKE else dict.fromkeys(TORCH_PATHS)
    assert {field: other[field] for field in TORCH_PATHS} == expected
    # The temporary checkpoint is gone once the baseline ran.
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("moe-tune-against-")]


def documentwise_delta_rule(torch_chunk):
    """FLA's chunk_gated_delta_rule given cu_seqlens (fla/ops/gated_delta_rule/chunk.py: a batch of one row, each
    sequence from a zero state) as `torch_chunk` (transformers' PyTorch path) on each document alone."""

    def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:
            return torch_chunk(q, k, v, g=g, beta=beta, **kwargs)
        assert q.shape[0] == 1
        bounds = cu_seqlens.tolist()
        outs = [torch_chunk(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kwargs)[0]
                for s, e in zip(bounds, bounds[1:])]  # fmt: skip
        return torch.cat(outs, dim=1), None

    return chunk_gated_delta_rule


def documentwise_conv(torch_conv):
    """causal-conv1d's causal_conv1d_fn given seq_idx (each document's window starts from zeros) as `torch_conv`
    (transformers' PyTorch path) on each document alone; the layer's other kwargs are dropped, as transformers'
    wrapper drops what the package does not take."""

    def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        if seq_idx is None:
            return torch_conv(x, weight, bias, activation=activation)
        ids = seq_idx[0]
        bounds = [0, *(torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist(), ids.numel()]
        return torch.cat([torch_conv(x[..., s:e], weight, bias, activation=activation)
                          for s, e in zip(bounds, bounds[1:])], dim=-1)  # fmt: skip

    return causal_conv1d_fn


def patch_kernels(monkeypatch, delta_rule: bool, short_conv: bool):
    """Bind, where qwen3_next's modeling module calls them, stand-ins with FLA's cu_seqlens (`delta_rule`) and
    causal-conv1d's seq_idx (`short_conv`) semantics; pure_torch_paths leaves them bound (they are not transformers'
    fallback wrappers)."""
    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    from moe_tune.engine.align.reference import torch_function

    if delta_rule:
        torch_chunk = torch_function(modeling.torch_chunk_gated_delta_rule)
        monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", documentwise_delta_rule(torch_chunk))
    if short_conv:
        monkeypatch.setattr(modeling, "causal_conv1d_fn", documentwise_conv(torch_function(modeling.causal_conv1d_fn)))


@pytest.mark.parametrize("model", [MOE_LIKE, NEXT_LIKE], ids=["qwen3_moe", "qwen3_next"])
def test_baseline_keeps_the_documents_of_a_packed_row_apart(tmp_path, monkeypatch, model):
    """Rows packing three documents each: the baseline's positions restart at each document (ours come from
    cu_seqlens), so transformers' attention stops at the documents' bounds as ours does, and qwen3_next's
    linear-attention layers, on one packed row, get them as cu_seq_lens_q and seq_idx (here kernels with FLA's and
    causal-conv1d's semantics): the first step's loss is ours in fp32 (qwen3_moe with positions counted over the whole
    row attends across documents: 5.7313 against 5.7281; qwen3_next fed [R, L] rows without bounds: 5.68253 against
    5.68281, with the delta rule kept apart but not the short conv 5.68250)."""
    from moe_tune.engine.bench.against import KEPT_APART, TransformersRunner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    from moe_tune.engine.bench.steps import profile_steps

    patch_kernels(monkeypatch, delta_rule=True, short_conv=True)
    seen = []
    inputs = TransformersRunner.inputs
    monkeypatch.setattr(TransformersRunner, "inputs", lambda self, batch: seen.append(inputs(self, batch)) or seen[-1])
    result = profile_steps(job_of(model, tmp_path, rows=packed_rows), steps=1, warmup=1, against="transformers")
    other = result["against"]
    assert other["first_step_loss"] == pytest.approx(result["first_step_loss"], rel=1e-5, abs=0)
    document = torch.arange(SEQ_LEN // 3)
    if model is MOE_LIKE:
        assert other["documents"] == KEPT_APART
        assert seen[0]["position_ids"].tolist() == [torch.cat([document] * 3).tolist()] * 2
        assert sorted(seen[0]) == ["input_ids", "labels", "position_ids"]
        return
    assert other["documents"] == ("kept apart (one packed row [1, R*L]: position_ids restart at each document, "
                                  "cu_seq_lens_q bounds the linear-attention layers' delta rule, seq_idx their short "
                                  "conv)")  # fmt: skip
    packed = seen[0]
    assert packed["position_ids"].tolist() == [torch.cat([document] * 6).tolist()]
    assert packed["input_ids"].shape == packed["labels"].shape == (1, 2 * SEQ_LEN)
    bounds = torch.arange(0, 2 * SEQ_LEN + 1, SEQ_LEN // 3, dtype=torch.int32)
    assert torch.equal(packed["cu_seq_lens_q"], bounds) and torch.equal(packed["cu_seq_lens_k"], bounds)
    assert (packed["max_length_q"], packed["max_length_k"]) == (SEQ_LEN // 3, SEQ_LEN // 3)
    assert packed["seq_idx"].dtype == torch.int32
    assert packed["seq_idx"].tolist() == [torch.arange(6).repeat_interleave(SEQ_LEN // 3).tolist()]


class NoBoundsGatedDeltaNet(nn.Module):
    """A linear-attention layer (its forward calls a function named as transformers' delta rule, below) whose forward
    reads no document bounds from its kwargs."""

    def forward(self, x, **kwargs):
        return torch_chunk_gated_delta_rule(x)


def torch_chunk_gated_delta_rule(x):
    return x


@pytest.mark.parametrize(("delta_rule", "short_conv", "expected"), [
    (False, False, (True, False, False)),  # transformers' PyTorch paths: no bounds kept
    (True, False, (True, True, False)),  # FLA without causal-conv1d (the H200's)
    (True, True, (True, True, True)),
], ids=["torch", "fla", "fla+causal-conv1d"])  # fmt: skip
def test_linear_attention_bounds_are_read_from_the_layers(tmp_path, monkeypatch, delta_rule, short_conv, expected):
    """What the layers keep apart is probed on the functions they call, and the row's `documents` says it."""
    from moe_tune.engine.align.reference import pure_torch_paths
    from moe_tune.engine.bench.against import (LinearBounds, build_transformers_model, documents_text,
                                               linear_attention_bounds)  # fmt: skip

    patch_kernels(monkeypatch, delta_rule, short_conv)
    with pure_torch_paths():
        model, _ = build_transformers_model(job_of(NEXT_LIKE, tmp_path), torch.device("cpu"))
        bounds = linear_attention_bounds(model, torch.device("cpu"), torch.float32)
    assert bounds == LinearBounds(*expected)
    assert documents_text(bounds) == {
        "torch": "kept apart in full attention (position_ids restart at each document); its linear-attention layers "
                 "carry their state and short conv across the documents of a row (their chunk_gated_delta_rule does "
                 "not keep them apart given cu_seqlens)",
        "fla": FLA_DOCUMENTS,
        "fla+causal-conv1d": "kept apart (one packed row [1, R*L]: position_ids restart at each document, "
                             "cu_seq_lens_q bounds the linear-attention layers' delta rule, seq_idx their short conv)",
    }["torch" if not delta_rule else "fla+causal-conv1d" if short_conv else "fla"]  # fmt: skip
    # A layer whose forward reads no cu_seq_lens_q gets no bounds, whatever its kernels keep.
    no_bounds = linear_attention_bounds(nn.Sequential(NoBoundsGatedDeltaNet()), torch.device("cpu"), torch.float32)
    assert no_bounds == LinearBounds(False, False, False)
    assert documents_text(no_bounds).endswith("(their forward reads no cu_seq_lens_q)")
    assert linear_attention_bounds(nn.Sequential(nn.Linear(2, 2)), torch.device("cpu"), torch.float32) is None


def test_fp8_base_hands_its_weights_over_dequantized(monkeypatch):
    """An FP8 base reaches the baseline as its weights dequantized (what our FP8 GEMMs compute with on the CPU)."""
    from test_real_size_profiles import SHRUNK

    from moe_tune.engine.bench.steps import profile_steps
    from moe_tune.profiles import load_profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name = "bench-qwen3-next-80b-a3b"
    job = load_profile(name, [*SHRUNK[name], "train.precision=fp32", "data.corpus_documents=8",
                              "train.micro_batch_size=1", "output.dir=/nonexistent/fp8-base"])  # fmt: skip
    assert job.model.base_precision == "fp8"
    result = profile_steps(job, steps=1, warmup=1, against="transformers")
    other = result["against"]
    assert other["first_step_loss"] == pytest.approx(result["first_step_loss"], rel=1e-5, abs=0)
    assert other["initial_weights"] == ("ours (our initial weights written as a transformers checkpoint, the FP8 base "
                                        "dequantized)")  # fmt: skip


def test_row_names_an_fla_function_bound_in_the_modeling_module(tmp_path, monkeypatch):
    """A function of an `fla.` module bound where the modeling file calls its chunked delta rule (as transformers
    binds FLA's when it is importable) is what the row names, and what the layers call."""
    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    from moe_tune.engine.align.reference import pure_torch_paths
    from moe_tune.engine.bench.against import build_transformers_model

    calls = []
    # Patched inside pure_torch_paths and undone before it restores transformers' wrapper.
    with pure_torch_paths(), monkeypatch.context() as patch:
        torch_chunk = modeling.torch_chunk_gated_delta_rule

        def chunk_gated_delta_rule(*args, **kwargs):
            calls.append(1)
            return torch_chunk(*args, **kwargs)

        patch.setattr(modeling, "torch_chunk_gated_delta_rule", as_fla(chunk_gated_delta_rule))
        model, _ = build_transformers_model(job_of(NEXT_LIKE, tmp_path), torch.device("cpu"))
        paths = kernel_paths(model)
        model(input_ids=torch.randint(0, 300, (1, 8)), use_cache=False)
    assert paths == dict(TORCH_PATHS, linear_attention_implementation=f"{FLA_CHUNK_MODULE}.chunk_gated_delta_rule")
    assert len(calls) == 2  # both linear-attention layers


def fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):  # fmt: skip
    """FLA 0.6.0's chunk_gated_delta_rule as read (fla/ops/gated_delta_rule/chunk.py): q and k L2-normalised as
    fla/modules/norm/l2norm.py does (x / sqrt(sum x^2 + 1e-6)), value head i reading key head i // (HV // H)
    (ops/common/chunk_delta_h.py), scale K ** -0.5 when None, then FLA's own PyTorch reference of the recurrence."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    assert cu_seqlens is None
    if use_qk_l2norm_in_kernel:
        q, k = (x / torch.sqrt((x.float() * x.float()).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    groups = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(groups, dim=2) for x in (q, k))
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale, initial_state, output_final_state)


def test_fla_semantics_as_transformers_calls_them_equal_its_torch_path(tmp_path, monkeypatch):
    """What FLA computes with the arguments transformers' qwen3_next passes it (no scale, use_qk_l2norm_in_kernel,
    g in log space, q and k at key heads) is what transformers' PyTorch path computes: the baseline's logits within
    1e-5 in fp32 either way. (FLA's kernels need a GPU: its semantics here are its PyTorch reference and the
    argument handling of its public function, as read.)"""
    pytest.importorskip("fla.ops.gated_delta_rule.naive")
    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    from moe_tune.engine.align.reference import pure_torch_paths
    from moe_tune.engine.bench.against import build_transformers_model

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with pure_torch_paths(), monkeypatch.context() as patch:
        model, _ = build_transformers_model(job_of(NEXT_LIKE, tmp_path), torch.device("cpu"))
        model.eval()
        with torch.no_grad():
            torch_logits = model(input_ids=ids, use_cache=False).logits
            patch.setattr(modeling, "torch_chunk_gated_delta_rule", fla_chunk_gated_delta_rule)
            fla_logits = model(input_ids=ids, use_cache=False).logits
        assert kernel_paths(model)["linear_attention_implementation"].endswith(".fla_chunk_gated_delta_rule")
    torch.testing.assert_close(fla_logits, torch_logits, rtol=1e-5, atol=1e-5)


class OlderGatedDeltaNet(nn.Module):
    """A linear-attention layer as older transformers wrote qwen3_next's: the kernels chosen at build and kept as
    attributes (None where the package is missing), its forward calling them through self."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk_gated_delta_rule = chunk
        self.causal_conv1d_fn = None
        self.norm = nn.RMSNorm(4)

    def forward(self, x):
        if self.causal_conv1d_fn is None:
            x = torch.nn.functional.silu(x)
        return self.norm(self.chunk_gated_delta_rule(x))


def test_row_reads_the_kernels_a_layer_holds():
    def chunk_gated_delta_rule(x):
        return x

    paths = kernel_paths(nn.Sequential(OlderGatedDeltaNet(as_fla(chunk_gated_delta_rule))))
    assert paths == {
        "linear_attention_implementation": f"{FLA_CHUNK_MODULE}.chunk_gated_delta_rule",
        "causal_conv_implementation": f"{__name__}.OlderGatedDeltaNet.forward (its PyTorch path: causal_conv1d_fn is "
                                      "None)",
        "gated_norm_implementation": "torch.nn.modules.normalization.RMSNorm",
    }  # fmt: skip
    assert kernel_paths(nn.Sequential(nn.Linear(2, 2))) == dict.fromkeys(TORCH_PATHS)


def test_weights_the_disk_cannot_hold_leave_the_baseline_its_own_init(tmp_path, monkeypatch):
    import shutil

    job = job_of(NEXT_LIKE, tmp_path)
    initial = InitialWeights(job)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    initial.write(nn.Linear(2, 2))
    assert initial.folder is None
    assert initial_weights_text(job, initial).startswith(
        f"its own random init (our initial weights (0.0 GB) do not fit the 0.0 GB free in ")


def test_a_checkpoint_missing_a_weight_is_refused(tmp_path):
    """Every weight of the baseline comes from the checkpoint: one it lacks is an error, not a random draw."""
    import transformers
    from safetensors.torch import load_file, save_file

    from moe_tune.engine.bench.against import _loaded, transformers_config

    job = job_of(MOE_LIKE, tmp_path)
    model_type, config = transformers_config(job.model)
    built = transformers.AutoConfig.for_model(model_type, **config)
    folder = tmp_path / "checkpoint"
    transformers.AutoModelForCausalLM.from_config(built).save_pretrained(folder)
    _loaded(transformers.Qwen3MoeForCausalLM, folder, built, torch.float32, "the test's weights")
    shard = folder / "model.safetensors"
    state = load_file(str(shard))
    del state["model.layers.1.self_attn.o_proj.weight"]
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"the test's weights does not load into Qwen3MoeForCausalLM: missing_keys "
                                           r"\['model.layers.1.self_attn.o_proj.weight'\]"):
        _loaded(transformers.Qwen3MoeForCausalLM, folder, built, torch.float32, "the test's weights")


def test_cli_line_names_the_weights_and_the_kernels():
    from moe_tune.cli.profile_steps import baseline_runs_line
    from moe_tune.engine.bench.against import KEPT_APART

    row = dict(TORCH_PATHS, baseline="transformers", initial_weights="ours (our initial weights written as a "
               "transformers checkpoint)")  # fmt: skip
    assert baseline_runs_line(row) == (
        "  weights: ours (our initial weights written as a transformers checkpoint); linear attention "
        f"{NEXT_MODULE}.torch_chunk_gated_delta_rule; short conv {NEXT_MODULE}.causal_conv1d_fn; gated norm "
        f"{NEXT_MODULE}.Qwen3NextRMSNormGated")  # fmt: skip
    assert baseline_runs_line(dict(row, **dict.fromkeys(TORCH_PATHS))) == (
        "  weights: ours (our initial weights written as a transformers checkpoint)")
    assert baseline_runs_line(dict(row, documents=KEPT_APART, **dict.fromkeys(TORCH_PATHS))) == (
        "  weights: ours (our initial weights written as a transformers checkpoint); documents kept apart "
        "(position_ids restart at each document)")
    # qwen3_next with FLA and without causal-conv1d (the H200's).
    fla_row = dict(row, documents=FLA_DOCUMENTS,
                   linear_attention_implementation=f"{FLA_CHUNK_MODULE}.chunk_gated_delta_rule")  # fmt: skip
    assert baseline_runs_line(fla_row) == (
        "  weights: ours (our initial weights written as a transformers checkpoint); documents kept apart in full "
        "attention and the linear-attention layers' delta rule (one packed row [1, R*L]: position_ids restart at "
        "each document, cu_seq_lens_q bounds the delta rule); their short conv runs across the documents of the "
        "packed row (their causal_conv1d_fn does not keep them apart given seq_idx); linear attention "
        f"{FLA_CHUNK_MODULE}.chunk_gated_delta_rule; short conv {NEXT_MODULE}.causal_conv1d_fn; gated norm "
        f"{NEXT_MODULE}.Qwen3NextRMSNormGated")  # fmt: skip
    assert baseline_runs_line({"baseline": "bf16-base"}) is None


def test_one_document_shows_equal_weights_where_the_first_step_losses_differ(tmp_path, monkeypatch):
    """qwen3_next on transformers' PyTorch paths carries its delta rule's state and its short conv across the
    documents packed in a row (as its short conv does on the H200): the first-step losses differ by 5e-5, while both
    models' loss on the longest document of the first micro-batch alone, before any step, agree in fp32."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    from moe_tune.engine.bench.steps import profile_steps

    result = profile_steps(job_of(NEXT_LIKE, tmp_path, rows=packed_rows), steps=1, warmup=1, against="transformers")
    other = result["against"]
    probe = other["one_document"]
    assert sorted(probe) == ["baseline_loss", "moe_tune_loss", "tokens"]
    assert probe["tokens"] == SEQ_LEN // 3  # packed_rows' documents are all this long: the first is taken
    assert probe["baseline_loss"] == pytest.approx(probe["moe_tune_loss"], rel=1e-5, abs=0)
    assert abs(other["first_step_loss"] - result["first_step_loss"]) > 1e-5 * result["first_step_loss"]
    assert "document_loss" not in other


def scaled_final_norm(build, factor):
    """build_transformers_model whose model's final norm weight is scaled by `factor` once loaded."""

    def build_scaled(*args, **kwargs):
        model, model_type = build(*args, **kwargs)
        (weight,) = [p for name, p in model.named_parameters() if name.endswith("model.norm.weight")]
        with torch.no_grad():
            weight.mul_(factor)
        return model, model_type

    return build_scaled


@pytest.mark.parametrize("factor", [1.0, 1.5], ids=["same", "final-norm-x1.5"])
def test_one_document_tells_weights_apart(tmp_path, monkeypatch, factor):
    """The check can fail: a baseline whose final norm weight is 1.5x ours loses agreement on the one document."""
    from moe_tune.engine.bench import against

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(against, "build_transformers_model", scaled_final_norm(against.build_transformers_model,
                                                                                factor))  # fmt: skip
    from moe_tune.engine.bench.steps import profile_steps

    result = profile_steps(job_of(MOE_LIKE, tmp_path), steps=1, warmup=1, against="transformers")
    probe = result["against"]["one_document"]
    gap = abs(probe["baseline_loss"] - probe["moe_tune_loss"]) / probe["moe_tune_loss"]
    assert (gap < 1e-5) == (factor == 1.0), gap


def test_longest_document_is_cut_from_the_micro_batch():
    from moe_tune.engine.bench.against import longest_document
    from moe_tune.engine.data.dataset import Batch

    ids = torch.arange(100, 112)[None]
    labels = torch.arange(200, 212)[None]
    for bounds, (start, stop) in (([0, 3, 8, 12], (3, 8)), ([0, 4, 8, 12], (0, 4)), ([0, 12], (0, 12)),
                                  ([0, 1, 2, 12], (2, 12))):  # fmt: skip
        batch = Batch(input_ids=ids, labels=labels, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
        piece = longest_document(batch)
        assert piece.input_ids.tolist() == [list(range(100 + start, 100 + stop))]
        assert piece.labels.tolist() == [list(range(200 + start, 200 + stop))]
        assert piece.cu_seqlens.tolist() == [0, stop - start] and piece.cu_seqlens.dtype == torch.int32


def test_cli_line_gives_both_one_document_losses():
    from moe_tune.cli.profile_steps import one_document_line

    other = {"baseline": "transformers", "impl": "transformers 5.17.0 + peft 0.21.0",
             "one_document": {"tokens": 4095, "moe_tune_loss": 10.78125, "baseline_loss": 10.8}}  # fmt: skip
    assert one_document_line({"against": other}) == (
        "the longest document of the first micro-batch alone (4,095 tokens), before any step: loss 10.7812 (moe-tune)"
        " / 10.8000 (transformers 5.17.0 + peft 0.21.0), 0.174% apart")
    # Out of memory before the loss, and the bf16 twin (no such check): no line.
    assert one_document_line({"against": dict(other, one_document=dict(other["one_document"], baseline_loss=None))}) is None
    assert one_document_line({"against": {"baseline": "bf16-base", "impl": "moe-tune, bf16 base"}}) is None


class RefusedBackward(torch.autograd.Function):
    """Identity forward, a backward that refuses as FLA 0.6's gated backward does on Hopper with Triton 3.4-3.7.0."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
                           "chunk_bwd_dqkwg (see #640).\nPlease upgrade Triton")  # fmt: skip


def refusing_chunk(torch_chunk):
    """`torch_chunk` whose output's backward refuses, named as FLA's chunked delta rule."""

    def chunk_gated_delta_rule(q, k, v, **kwargs):
        out, state = torch_chunk(q, k, v, **kwargs)
        return RefusedBackward.apply(out), state

    return as_fla(chunk_gated_delta_rule)


def refusing_conv(torch_conv):
    """`torch_conv` whose output's backward refuses, named as causal-conv1d's function."""

    def causal_conv1d_fn(*args, **kwargs):
        return RefusedBackward.apply(torch_conv(*args, **kwargs))

    causal_conv1d_fn.__module__, causal_conv1d_fn.__qualname__ = "causal_conv1d.causal_conv1d_interface", "causal_conv1d_fn"
    return causal_conv1d_fn


@pytest.mark.parametrize("refuses", ["nothing", "delta rule", "short conv"])
def test_a_baseline_kernel_that_cannot_train_here_is_refused_before_anything_runs(tmp_path, monkeypatch, refuses):
    """On a GPU, the delta rule and short conv transformers' qwen3_next calls are run forward and backward on tiny
    inputs before our steps: a kernel that raises (FLA's gated backward on Triton 3.6 on Hopper) refuses the run in
    one line naming it and its error; transformers' own PyTorch paths train and pass. (The baseline's device is this
    CPU.)"""
    import inspect

    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    from moe_tune.engine.align.reference import pure_torch_paths
    from moe_tune.engine.bench import against
    from moe_tune.engine.bench.steps import check_against
    from moe_tune.profiles import ProfileError

    monkeypatch.setattr(against, "baseline_device", lambda: torch.device("cpu"))
    job = job_of(NEXT_LIKE, tmp_path)
    error = ("RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
             "chunk_bwd_dqkwg (see #640).")  # fmt: skip
    with pure_torch_paths(), monkeypatch.context() as patch:
        if refuses == "nothing":
            check_against(job, "transformers")
            return
        if refuses == "delta rule":
            torch_chunk = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)
            patch.setattr(modeling, "torch_chunk_gated_delta_rule", refusing_chunk(torch_chunk))
            function = f"{FLA_CHUNK_MODULE}.chunk_gated_delta_rule"
        else:
            patch.setattr(modeling, "causal_conv1d_fn", refusing_conv(inspect.unwrap(modeling.causal_conv1d_fn)))
            function = "causal_conv1d.causal_conv1d_interface.causal_conv1d_fn"
        with pytest.raises(ProfileError) as refusal:
            check_against(job, "transformers")
    assert refusal.value.problems == [
        f"--against transformers: transformers' qwen3_next trains its linear-attention layers with {function}, which "
        f"fails a backward on this machine ({error}); the baseline cannot train here (docs/bench.md, \"What the "
        "baseline runs\")"]  # fmt: skip
    # qwen3_moe has no linear attention: nothing to probe.
    check_against(job_of(MOE_LIKE, tmp_path), "transformers")
