"""kimi_linear against transformers' KimiLinearForCausalLM on tiny perturbed checkpoints, in fp32.

Compared: the hidden state after every decoder layer and the logits (max abs, KL) on one sequence and on a packed row
of three documents against per-document reference runs, and the gradients of weights in every kind of block.
Layers: KDA with a dense MLP (saved as block_sparse_moe.*), two KDA + MoE, one MLA (no RoPE) + MoE.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.families import UnsupportedModel, load_checkpoint_weights, model_profile_from_checkpoint
from moe_tune.engine.families.kimi_linear import KimiLinear
from moe_tune.engine.model.model import build_model

from hf_tiny import save_tiny_checkpoint

transformers = pytest.importorskip("transformers")

LOGITS_MAX_ABS = 1e-4
KL_MAX = 1e-6
HIDDEN_MAX_ABS = 1e-4
# max |g_ours - g_ref| / max |g_ref| per weight: fp32 sums in different orders.
GRAD_REL = 1e-4
# A wrong mapping must move the logits by far more than the tolerance.
WRONG_MIN_ABS = 100 * LOGITS_MAX_ABS

BASE = dict(
    vocab_size=320,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    linear_num_heads=3,
    linear_head_dim=8,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    # Kimi-Linear's own shape: no query latent, one group, one shared expert.
    "kimi": dict(BASE, q_lora_rank=None, num_local_experts=7, num_experts_per_tok=2, n_group=1, topk_group=1,
                 n_shared_experts=1, routed_scaling_factor=2.5),
    # Group-limited routing (4 groups of 2, 2 kept), a query latent and two shared experts.
    "grouped": dict(BASE, q_lora_rank=12, num_local_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                    n_shared_experts=2, routed_scaling_factor=1.7),
}
# The single sequence crosses the 64-token chunk of the KDA op; so does the first packed document.
SEQUENCE_LENGTH = 80
DOCUMENT_LENGTHS = (70, 9, 23)


# Built once per module and config name, whichever tests ask (some run on the "kimi" config only, to stay fast).
_CACHE: dict[tuple[str, str], object] = {}


def _cached(kind: str, name: str, build):
    if (kind, name) not in _CACHE:
        _CACHE[kind, name] = build()
    return _CACHE[kind, name]


@pytest.fixture(scope="module", autouse=True)
def _clear_cache():
    yield
    _CACHE.clear()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Path:
    def build():
        torch.manual_seed(0)
        reference = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**CONFIGS[request.param]))
        return save_tiny_checkpoint(reference.float(), tmp_path_factory.mktemp(request.param) / "checkpoint")

    return _cached("checkpoint", request.param, build)


@pytest.fixture(scope="module")
def reference(checkpoint):
    def build():
        from moe_tune.engine.align.compare import hold_pure_torch_paths
        from moe_tune.engine.align.reference import pure_torch_paths

        # transformers' own PyTorch paths, flash-linear-attention installed or not (align's reference).
        with pure_torch_paths():
            model = transformers.KimiLinearForCausalLM.from_pretrained(
                str(checkpoint), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
            )
        hold_pure_torch_paths(model)
        return model.eval()

    return _cached("reference", str(checkpoint), build)


@pytest.fixture(scope="module")
def reference_packed_logits(checkpoint, reference) -> torch.Tensor:
    """The reference's logits on DOCUMENT_LENGTHS, each document alone."""

    def build():
        with torch.no_grad():
            return run_reference(reference, documents(DOCUMENT_LENGTHS))[0]

    return _cached("packed logits", str(checkpoint), build)


only_kimi = pytest.mark.parametrize("checkpoint", ["kimi"], indirect=True)


def load_ours(directory: Path):
    family, _, cfg = model_profile_from_checkpoint(directory)
    assert isinstance(family, KimiLinear)
    model = build_model(cfg)
    load_checkpoint_weights(model, cfg)
    return model.eval()


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_ours(checkpoint)


def documents(lengths, vocab_size=BASE["vocab_size"], seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


def run_reference(model, docs):
    """Each document alone: logits [T, V] and every layer's hidden state [T, D], concatenated over documents."""
    hidden: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    handles = [
        layer.register_forward_hook(lambda _m, _i, out, i=i: hidden[i].append(out[0]))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        logits = torch.cat([model(input_ids=doc[None]).logits[0] for doc in docs])
    finally:
        for h in handles:
            h.remove()
    return logits, [torch.cat(h) for h in hidden]


def run_ours(model, docs, labels=None):
    """All documents packed in one row: the output and every layer's hidden state [T, D]."""
    hidden: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda _m, _i, out: hidden.append(out[0][0])) for layer in model.layers]
    cu = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).to(torch.int32)
    try:
        out = model(torch.cat(docs)[None], cu, labels)
    finally:
        for h in handles:
            h.remove()
    return out, hidden


def kl_ref_ours(ref_logits: torch.Tensor, our_logits: torch.Tensor) -> float:
    ref_logp, our_logp = ref_logits.log_softmax(-1), our_logits.log_softmax(-1)
    return (ref_logp.exp() * (ref_logp - our_logp)).sum(-1).mean().item()


@pytest.mark.parametrize(
    "lengths", [(SEQUENCE_LENGTH,), DOCUMENT_LENGTHS], ids=["one-sequence", "packed-3-documents"]
)
def test_layers_and_logits_match_reference(ours, reference, lengths):
    docs = documents(lengths)
    with torch.no_grad():
        ref_logits, ref_hidden = run_reference(reference, docs)
        out, our_hidden = run_ours(ours, docs)
    assert len(our_hidden) == len(ref_hidden) == 4
    for i, (mine, theirs) in enumerate(zip(our_hidden, ref_hidden)):
        gap = (mine - theirs).abs().max().item()
        assert gap <= HIDDEN_MAX_ABS, f"layer {i}: hidden state max abs {gap:.3g}"
    assert (out.logits[0] - ref_logits).abs().max().item() <= LOGITS_MAX_ABS
    assert kl_ref_ours(ref_logits, out.logits[0]) <= KL_MAX


def _reference_param(reference, ours_name: str) -> torch.Tensor:
    """The reference parameter holding the same numbers as our parameter `ours_name` (same layout unless noted)."""
    renames = {
        "f_b_proj": "forget_gate.f_b_proj",
        "A_log": "forget_gate.A_log",
        "dt_bias": "forget_gate.dt_bias",
        "conv": "conv1d",
        "experts.w_gate_up": "experts.gate_up_proj",
        "experts.w_down": "experts.down_proj",
        "shared_expert": "shared_experts",
    }
    name = ours_name
    for mine, theirs in renames.items():
        name = name.replace(f".{mine}", f".{theirs}")
    return dict(reference.named_parameters())[f"model.{name}"]


GRAD_PARAMS = [
    "layers.0.self_attn.A_log",
    "layers.0.self_attn.dt_bias",
    "layers.0.self_attn.f_b_proj.weight",
    "layers.0.self_attn.conv.weight",
    "layers.0.self_attn.o_norm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.1.self_attn.g_a_proj.weight",
    "layers.1.mlp.gate.weight",
    "layers.1.mlp.experts.w_gate_up",
    "layers.2.mlp.shared_expert.down_proj.weight",
    "layers.3.self_attn.kv_b_proj.weight",
    "layers.3.self_attn.kv_a_layernorm.weight",
]


def test_gradients_match_reference(checkpoint, reference):
    ours = load_ours(checkpoint)
    docs = documents(DOCUMENT_LENGTHS, seed=1)
    labelled = sum(len(d) - 1 for d in docs)
    reference.zero_grad()
    for doc in docs:
        logits = reference(input_ids=doc[None]).logits[0]
        (torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum") / labelled).backward()
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None]
    out, _ = run_ours(ours, docs, labels)
    out.lm_loss.backward()
    params = dict(ours.named_parameters())
    for name in GRAD_PARAMS:
        theirs = _reference_param(reference, name).grad
        mine = params[name].grad
        gap = (mine - theirs.reshape(mine.shape)).abs().max().item()
        assert gap <= GRAD_REL * theirs.abs().max().item(), f"{name}: gradient max abs {gap:.3g}"
    reference.zero_grad()


# ---- a wrong mapping must show ----------------------------------------------------------------------------------


def _swap_gate_up(recipe, name):
    if name.endswith("experts.w_gate_up"):
        return lambda get: torch.cat(recipe(get).chunk(2, dim=1)[::-1], dim=1)
    return recipe


def _conv_k_before_q(recipe, name):
    if name.endswith("self_attn.conv.weight"):
        return lambda get: torch.cat([recipe(get).chunk(3)[i] for i in (1, 0, 2)])
    return recipe


def _no_correction_bias(recipe, name):
    # Read (so the loader sees the key used) but left at zero, as a mapping that forgets the bias would.
    if name.endswith("mlp.selection_bias"):
        return lambda get: recipe(get) * 0.0
    return recipe


def _decay_on_wrong_head(recipe, name):
    if name.endswith("self_attn.A_log"):
        return lambda get: recipe(get).roll(1)
    return recipe


WRONG_MAPPINGS = {
    "swapped-gate-up": _swap_gate_up,
    "conv-k-before-q": _conv_k_before_q,
    "no-correction-bias": _no_correction_bias,
    "decay-on-wrong-head": _decay_on_wrong_head,
}


@pytest.fixture
def wrong_mapping(monkeypatch, request):
    original = KimiLinear.recipe

    def recipe(self, name, module, cfg):
        return WRONG_MAPPINGS[request.param](original(self, name, module, cfg), name)

    monkeypatch.setattr(KimiLinear, "recipe", recipe)


@only_kimi
@pytest.mark.parametrize("wrong_mapping", sorted(WRONG_MAPPINGS), indirect=True)
def test_wrong_mapping_fails_comparison(checkpoint, reference_packed_logits, wrong_mapping):
    with torch.no_grad():
        out, _ = run_ours(load_ours(checkpoint), documents(DOCUMENT_LENGTHS))
    assert (out.logits[0] - reference_packed_logits).abs().max().item() > WRONG_MIN_ABS


@only_kimi
@pytest.mark.parametrize("pin", [False, True], ids=["own-routing", "pinned-routing"])
def test_align_passes(checkpoint, pin):
    report = align_checkpoint(checkpoint, pin_routing=pin)
    assert report.passed, report.failures
    assert len(report.layers) == 4 and report.logits.max_abs <= LOGITS_MAX_ABS and report.kl <= KL_MAX
    # LoRA gradients compared on q, k, v, o of the three KDA layers and on q, o of the MLA layer (no query latent).
    adapted = {row.name.rsplit(".", 1)[0] for row in report.lora_grads}
    expected = {f"layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert expected | {"layers.3.self_attn.q_proj", "layers.3.self_attn.o_proj"} <= adapted, sorted(adapted)


@only_kimi
@pytest.mark.parametrize("wrong_mapping", ["swapped-gate-up"], indirect=True)
def test_align_fails_on_wrong_mapping(checkpoint, wrong_mapping):
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert not report.passed
    # The first layer (KDA + dense MLP) is still right: the table points at layer 1, the first MoE layer.
    assert report.layers[0].max_abs <= HIDDEN_MAX_ABS < report.layers[1].max_abs


@only_kimi
def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(checkpoint)
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)


# ---- config.json ------------------------------------------------------------------------------------------------


def _config_dir(checkpoint: Path, tmp_path: Path, **changes) -> Path:
    directory = tmp_path / "edited"
    directory.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@only_kimi
def test_unsupported_config_values_are_all_reported(checkpoint, tmp_path):
    directory = _config_dir(
        checkpoint,
        tmp_path,
        hidden_act="gelu",
        mla_use_nope=False,
        moe_router_activation_func="softmax",
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
    )
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(directory)
    message = str(err.value)
    assert "hidden_act ('gelu') is not mapped" in message
    assert "mla_use_nope (False) is not mapped" in message
    assert "moe_router_activation_func ('softmax') is not mapped" in message
    assert "layer_types[1] ('sliding_attention') is not mapped" in message


@only_kimi
def test_hub_config_layout_reads_like_transformers(checkpoint, tmp_path):
    """The original hub config.json (linear_attn_config with 1-based layer lists, first_k_dense_replace) gives the
    same architecture as the one transformers writes, and transformers reads it the same way."""
    saved = json.loads((checkpoint / "config.json").read_text())
    directory = _config_dir(
        checkpoint,
        tmp_path,
        layer_types=None,
        mlp_layer_types=None,
        linear_num_heads=None,
        linear_head_dim=None,
        linear_conv_kernel_dim=None,
        linear_attn_config={
            "full_attn_layers": [4],
            "kda_layers": [1, 2, 3],
            "num_heads": saved["linear_num_heads"],
            "head_dim": saved["linear_head_dim"],
            "short_conv_kernel_size": saved["linear_conv_kernel_dim"],
        },
        first_k_dense_replace=1,
    )
    _, _, from_hub = model_profile_from_checkpoint(directory)
    _, _, from_saved = model_profile_from_checkpoint(checkpoint)
    assert from_hub.model_copy(update={"checkpoint": None}) == from_saved.model_copy(update={"checkpoint": None})
    hub_config = transformers.KimiLinearConfig.from_pretrained(str(directory))
    assert hub_config.layer_types == saved["layer_types"]
    assert hub_config.mlp_layer_types == saved["mlp_layer_types"]


@only_kimi
def test_unmapped_checkpoint_tensor_is_reported(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "extra"
    shutil.copytree(checkpoint, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=r"module not mapped: model\.layers\.\*\.self_attn\.q_norm\.weight"):
        load_ours(directory)


@only_kimi
def test_config_our_rules_refuse_is_reported(checkpoint, tmp_path):
    # 7 experts do not split into 3 groups: transformers' router fails at run time, we report it on reading.
    directory = _config_dir(checkpoint, tmp_path, num_expert_group=3, topk_group=2)
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(directory)
    assert any("n_group (3) must divide" in line for line in err.value.problems), err.value.problems


# ---- the KDA layer in a profile-built model --------------------------------------------------------------------


def test_kda_layers_from_a_profile_train():
    """A model declared in a profile (no checkpoint) with KDA layers: FLA's init, finite loss and gradients, and the
    schema asks for the kda_attention section."""
    from pydantic import ValidationError

    from moe_tune.profiles.schema import KDASpec, LayerSpec, ModelProfile

    spec = dict(vocab_size=300, hidden_size=32, layers=[LayerSpec(attention="kda", mlp="dense")] * 2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=48)
    with pytest.raises(ValidationError, match=r"kda_attention \(None\) must be set: a layer has attention: kda"):
        ModelProfile(**spec)
    model = build_model(ModelProfile(**spec, kda_attention=KDASpec(num_heads=2, head_dim=16)))
    attn = model.layers[0].self_attn
    assert attn.A_log.exp().min() >= 1.0 and attn.A_log.exp().max() < 16.0
    dt = torch.nn.functional.softplus(attn.dt_bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
    ids = torch.randint(0, 300, (1, 40))
    out = model(ids, torch.tensor([0, 25, 40], dtype=torch.int32), ids.roll(-1, 1))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert attn.f_a_proj.weight.grad.abs().sum() > 0 and attn.A_log.grad.abs().sum() > 0
