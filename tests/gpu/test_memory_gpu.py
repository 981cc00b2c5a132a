"""Selective caching on a GPU: the copy to host runs on its own stream beside compute and reads the tensor before
its memory is reused, the page-locked pool is allocated once and reused, policies that only copy train bitwise like
saving everything (with the token mixers' ops in the mode the policy gives them), at the test's size and the
benchmark model's, and those that recompute within bf16 tolerance.

Run on a GPU machine: pytest -m gpu tests/gpu/test_memory_gpu.py
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from gpu_memory import GPU_MEMORY_GROUP

from moe_tune.engine.memory import OPERATOR_CLASSES, attach_activation_memory, find_activation_memory, resolve_policy
from moe_tune.engine.memory import store as store_module
from moe_tune.engine.memory.store import TieredStore
from moe_tune.engine.train.trainer import build_trainable_model
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import MemoryProfile

pytestmark = pytest.mark.gpu

# Relative error ||a - b|| / ||b|| of a bf16 run against another (METHOD.md: bf16 lands between 1e-3 and 1e-2).
BF16_REL_TOL = 1e-2
# Enough compute on the stream to see a 256 MiB copy run beside it (~5 ms at PCIe 5 rates against ~40 ms of GEMMs).
OVERLAP_BYTES = 256 * 2**20
OVERLAP_GEMM = 8192
OVERLAP_GEMMS = 50
# Small enough that one step of the tiny model spans many chunks of the pinned pool.
SMALL_HOST_CHUNK_BYTES = 64 * 2**10
# Policies that only move saved tensors (to the host and back, or nowhere): the same kernels on the same values, so
# the reference's loss and gradients bit for bit. Offloading a token mixer's class also turns its op's saving of
# kernel intermediates off (docs/memory.md), a different backward: the reference runs its ops in the same mode.
COPY_ONLY = {
    "none": ("memory.preset=none",),
    "budget-0": ("memory.gpu_budget_gb=0",),
    "offload-all": tuple(f"memory.{klass}=offload" for klass in OPERATOR_CLASSES),
}
# Policies that recompute, held to the bf16 tolerance.
RECOMPUTING = {"balanced": ("memory.preset=balanced",), "max-context": ("memory.preset=max-context",)}


def test_copy_out_runs_beside_compute():
    store = TieredStore(resolve_policy(MemoryProfile(experts="offload", min_offload_mb=0)), num_layers=1)
    device = torch.device("cuda")
    store.begin_forward(device)
    store.layer, store.klass = 0, "experts"
    saved = torch.randn(OVERLAP_BYTES // 2, device=device, dtype=torch.bfloat16)
    a = torch.randn(OVERLAP_GEMM, OVERLAP_GEMM, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    compute_start, compute_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    compute_start.record()
    entry = store.pack(saved)
    for _ in range(OVERLAP_GEMMS):
        a = a @ a * 1e-4
    compute_end.record()
    store.end_layer()
    torch.cuda.synchronize()
    (kind, copy_start, copy_end, nbytes), *_ = store._timings
    assert (kind, nbytes) == ("d2h", OVERLAP_BYTES)
    # The copy began and finished while the GEMMs were still running on the compute stream.
    assert compute_start.elapsed_time(copy_start) >= 0
    assert copy_end.elapsed_time(compute_end) > 0
    assert entry.host and all(piece.is_pinned() for piece in entry.host) and entry.device is None
    store.end_forward()
    back = store.unpack(entry)
    assert torch.equal(back, saved)


def test_copy_out_reads_the_tensor_before_its_memory_is_reused():
    # The saved tensor is freed when its layer ends, while its copy to the host may still be running: the caching
    # allocator must not hand that memory to the compute stream (which would overwrite it) before the copy has read it.
    store = TieredStore(resolve_policy(MemoryProfile(experts="offload", min_offload_mb=0)), num_layers=1)
    device = torch.device("cuda")
    store.begin_forward(device)
    store.layer, store.klass = 0, "experts"
    saved = torch.randn(OVERLAP_BYTES // 4, device=device)
    expected = saved.clone()
    torch.cuda.synchronize()
    entry = store.pack(saved)
    del saved
    store.end_layer()
    # Allocated and written on the compute stream at once, while the copy runs: the freed memory would be the first
    # the allocator hands out if the copy's stream did not hold it.
    torch.empty_like(expected).fill_(float("nan"))
    store.end_forward()
    back = store.unpack(entry)
    torch.cuda.synchronize()
    assert torch.equal(back, expected)


def _cuda_profile(*extra):
    return load_profile(
        "tiny",
        ["data.seq_len=256", "parallel.zero_stage=0", "train.precision=bf16", "memory.min_offload_mb=0", *extra],
    )


def _batch(profile):
    from moe_tune.engine.data.dataset import PackedDataset, load_documents
    from moe_tune.engine.data.tokenizer import load_tokenizer

    tok = load_tokenizer("byte")
    return PackedDataset(load_documents(profile.data, tok), 256, tok.pad_id, 0).micro_batch(0, 2)


def _bf16_model(profile):
    torch.manual_seed(0)
    model, _ = build_trainable_model(profile)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.to(device="cuda", dtype=torch.bfloat16).train()


def _loss_and_grads(model, batch):
    out = model(
        input_ids=batch.input_ids.cuda(), cu_seqlens=batch.cu_seqlens.cuda(), labels=batch.labels.cuda()
    )
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}


def test_pinned_pool_is_allocated_once_and_reused(monkeypatch):
    monkeypatch.setattr(store_module, "HOST_CHUNK_BYTES", SMALL_HOST_CHUNK_BYTES)
    addresses = []
    copy_out = TieredStore._copy_out

    def recording(self, entry):
        copy_out(self, entry)
        addresses.append(tuple(piece.data_ptr() for piece in entry.host))

    monkeypatch.setattr(TieredStore, "_copy_out", recording)
    profile = _cuda_profile("memory.preset=max-context")
    model, batch = _bf16_model(profile), _batch(profile)
    memory = find_activation_memory(model)
    seen, slots = [], []
    for _ in range(3):
        _loss_and_grads(model, batch)
        model.zero_grad()
        metrics = memory.step_metrics()
        seen.append((memory.store.pool.allocations, memory.store.pool.capacity_bytes))
        slots.append(addresses[:])
        addresses.clear()
        assert metrics["memory_host_saved_bytes"] > 0 and metrics["memory_cache_hit_rate"] == 1.0
        assert metrics["memory_d2h_gb_per_s"] > 0 and metrics["memory_h2d_gb_per_s"] > 0
    assert seen[0][0] > 1 and seen == [seen[0]] * 3
    # Every step copies into the same page-locked slots, in the same order.
    assert slots[0] and slots == [slots[0]] * 3
    assert all(chunk.is_pinned() for chunk in memory.store.pool.chunks)


def _assert_same(result, reference):
    loss, grads = result
    assert torch.equal(loss, reference[0]), (loss.item(), reference[0].item())
    differing = [name for name in grads if not torch.equal(grads[name], reference[1][name])]
    assert not differing, differing


def _assert_within_bf16(result, reference):
    (loss, grads), (ref_loss, ref_grads) = result, reference
    assert abs(loss - ref_loss) / abs(ref_loss) < BF16_REL_TOL
    for name, grad in grads.items():
        error = (grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)
        assert error < BF16_REL_TOL, (name, error.item())


def _op_modes(model) -> dict[str, bool]:
    """Whether each token mixer's op keeps its kernels' intermediates for backward (the policy may turn it off)."""
    return {name: m.saves_op_intermediates for name, m in model.named_modules() if hasattr(m, "saves_op_intermediates")}


def _set_op_modes(model, modes: dict[str, bool]) -> None:
    mixers = dict(model.named_modules())
    for name, saving in modes.items():
        mixers[name].saves_op_intermediates = saving


@pytest.mark.parametrize("memory", COPY_ONLY.values(), ids=COPY_ONLY.keys())
def test_copy_only_policies_train_bitwise_like_saving_everything_in_bf16(memory):
    reference_profile = _cuda_profile()
    batch = _batch(reference_profile)
    policy_model = _bf16_model(_cuda_profile(*memory))
    modes = _op_modes(policy_model)
    assert modes
    reference_model = _bf16_model(reference_profile)
    full_reference = _loss_and_grads(reference_model, batch)
    reference_model.zero_grad(set_to_none=True)
    _set_op_modes(reference_model, modes)
    reference = _loss_and_grads(reference_model, batch)
    # Bitwise equality means something only if saving everything reproduces itself bit for bit.
    _assert_same(_loss_and_grads(_bf16_model(reference_profile), batch), full_reference)
    _assert_same(_loss_and_grads(policy_model, batch), reference)
    # The op's recomputing backward against its saving one: the same math, rounded differently.
    _assert_within_bf16(reference, full_reference)


def test_offloading_the_ops_intermediates_too_trains_bitwise_like_saving_everything():
    # Every saved tensor crosses to the host and back, the ops' fp32 states and WY factors included.
    reference_profile = _cuda_profile()
    batch = _batch(reference_profile)
    reference = _loss_and_grads(_bf16_model(reference_profile), batch)
    policy_model = _bf16_model(_cuda_profile(*COPY_ONLY["offload-all"]))
    _set_op_modes(policy_model, dict.fromkeys(_op_modes(policy_model), True))
    _assert_same(_loss_and_grads(policy_model, batch), reference)


def _bench_batch(vocab_size: int, num_tokens: int):
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, vocab_size, (1, num_tokens), generator=gen)
    # Documents of uneven lengths, one ending mid-chunk.
    cu_seqlens = torch.tensor([0, 1000, 3000, num_tokens // 2, num_tokens // 2 + 900, num_tokens], dtype=torch.int32)
    labels = input_ids.roll(-1, 1)
    labels[0, cu_seqlens[1:].long() - 1] = -100
    return SimpleNamespace(input_ids=input_ids, cu_seqlens=cu_seqlens, labels=labels)


@pytest.fixture
def math_attention():
    # The full attention layers' flash and memory-efficient backwards accumulate dq with atomics: not bitwise
    # reproducible run to run. SDPA's math kernel is.
    previous = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    yield
    torch.backends.cuda.enable_flash_sdp(previous[0])
    torch.backends.cuda.enable_mem_efficient_sdp(previous[1])


@GPU_MEMORY_GROUP
def test_offload_all_trains_bitwise_at_the_benchmark_models_size(math_attention):
    # bench-qwen3-next (8 layers, hidden 2048, 64 experts, full attention on 2 layers) on one benchmark micro-batch:
    # copies of hundreds of MB per layer over many pool chunks, prefetch two layers deep.
    reference_profile = load_profile("bench-qwen3-next", ["parallel.zero_stage=0", "memory.min_offload_mb=0"])
    batch = _bench_batch(reference_profile.model.vocab_size, 2 * reference_profile.data.seq_len)
    model = _bf16_model(reference_profile)
    policy_model = copy.deepcopy(model)
    policy = load_profile("bench-qwen3-next", ["memory.min_offload_mb=0", *COPY_ONLY["offload-all"]]).memory
    assert attach_activation_memory(policy_model, policy) is not None
    _set_op_modes(model, _op_modes(policy_model))
    reference = _loss_and_grads(copy.deepcopy(model), batch)
    _assert_same(_loss_and_grads(model, batch), reference)
    del model
    _assert_same(_loss_and_grads(policy_model, batch), reference)
    assert find_activation_memory(policy_model).step_metrics()["memory_host_saved_bytes"] > 2**30


@pytest.mark.parametrize("memory", RECOMPUTING.values(), ids=RECOMPUTING.keys())
def test_recomputing_presets_train_like_saving_everything_in_bf16(memory):
    reference_profile = _cuda_profile()
    batch = _batch(reference_profile)
    reference = _loss_and_grads(_bf16_model(reference_profile), batch)
    _assert_within_bf16(_loss_and_grads(_bf16_model(_cuda_profile(*memory)), batch), reference)
