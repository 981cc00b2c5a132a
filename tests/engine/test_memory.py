"""Selective caching (engine/memory): every operator class and preset trains bitwise like saving everything (fp32,
CPU, where offload goes to a second pooled buffer); the metrics count what the policy moved and recomputed; the
budget sinks the coldest tensors first; the size threshold holds; it runs under ZeRO-3 with LoRA."""

import gc
import json
import weakref

import pytest
import torch
from torch import nn

from moe_tune.engine.lora import inject_lora
from moe_tune.engine.memory import OPERATOR_CLASSES, PRESETS, find_activation_memory, resolve_policy
from moe_tune.engine.memory import store as store_module
from moe_tune.engine.memory.store import TieredStore, is_parameter
from moe_tune.engine.model.blocks import RMSNorm
from moe_tune.engine.model.model import build_model
from moe_tune.engine.model.moe import MoEBlock
from moe_tune.engine.train.trainer import build_trainable_model, finetune
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import MemoryProfile

# zero_stage 0: these tests run the model without DeepSpeed (one test below runs ZeRO-3).
SMALL = ["data.seq_len=32", "data.corpus_documents=50", "parallel.zero_stage=0"]
# Every saved tensor is worth moving in these tests: the tiny model's are far below the 1 MB default.
ALL_SIZES = "memory.min_offload_mb=0"


def tiny_profile(*memory):
    return load_profile("tiny", [*SMALL, *memory])


def perturb(model):
    # LoRA's B starts at zero and norms at one: move every parameter so every gradient path carries signal.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def managed_model(*memory):
    torch.manual_seed(0)
    model, _ = build_trainable_model(tiny_profile(*memory))
    return perturb(model).train()


def plain_model():
    """The same model with no memory manager: autograd saves everything, the reference."""
    profile = tiny_profile()
    torch.manual_seed(0)
    return perturb(inject_lora(build_model(profile.model), profile.lora)).train()


@pytest.fixture(scope="module")
def batch():
    from moe_tune.engine.data.dataset import PackedDataset, load_documents
    from moe_tune.engine.data.tokenizer import load_tokenizer

    profile, tok = tiny_profile(), load_tokenizer("byte")
    return PackedDataset(load_documents(profile.data, tok), 32, tok.pad_id, 0).micro_batch(0, 1)


def loss_and_grads(model, batch):
    out = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads


@pytest.fixture(scope="module")
def reference(batch):
    return loss_and_grads(plain_model(), batch)


def assert_bitwise(result, reference):
    loss, grads = result
    assert torch.equal(loss, reference[0]), (loss.item(), reference[0].item())
    assert grads.keys() == reference[1].keys()
    differing = [name for name in grads if not torch.equal(grads[name], reference[1][name])]
    assert not differing, differing


def run(batch, *memory):
    model = managed_model(*memory)
    result = loss_and_grads(model, batch)
    manager = find_activation_memory(model)
    return result, None if manager is None else manager.step_metrics(), model


@pytest.mark.parametrize("klass", OPERATOR_CLASSES)
@pytest.mark.parametrize("choice", ["recompute", "offload"])
def test_each_operator_class_trains_like_saving_everything(klass, choice, batch, reference):
    result, metrics, _ = run(batch, f"memory.{klass}={choice}", ALL_SIZES)
    assert_bitwise(result, reference)
    # The choice took effect: the test would pass vacuously otherwise.
    if choice == "recompute":
        assert metrics["memory_recomputations"] > 0
    else:
        assert metrics[f"memory_host_bytes_{klass}"] > 0


@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_trains_like_saving_everything(preset, batch, reference):
    result, metrics, _ = run(batch, f"memory.preset={preset}", ALL_SIZES)
    assert_bitwise(result, reference)
    if preset != "none":
        assert metrics["memory_host_saved_bytes"] > 0 and metrics["memory_recomputations"] > 0


def test_budget_and_no_prefetch_train_like_saving_everything(batch, reference):
    result, metrics, _ = run(batch, "memory.gpu_budget_gb=0.000002", "memory.prefetch_layers=0", ALL_SIZES)
    assert_bitwise(result, reference)
    assert metrics["memory_evicted_bytes"] > 0


@pytest.mark.parametrize("memory, attached", [
    (("memory.preset=none",), False),  # keeps everything: plain autograd, no saved-tensor hooks
    (("memory.preset=none", "memory.gpu_budget_gb=1000"), True),  # a budget: the store must see every tensor
    (("memory.preset=none", "memory.norm=recompute"), True),
    (("memory.preset=balanced",), True),
])  # fmt: skip
def test_manager_attached_only_when_the_policy_moves_or_recomputes(memory, attached):
    assert (find_activation_memory(managed_model(*memory)) is not None) is attached


@pytest.mark.parametrize("memory, saves", [
    ((), True),  # the tiny profile's own policy
    (("memory.attention=save",), True),
    (("memory.attention=recompute",), True),  # the recomputed forward keeps them for its own backward
    (("memory.attention=offload",), False),  # they would cross PCIe: recomputed in backward instead
    (("memory.preset=max-context",), True),
])  # fmt: skip
def test_linear_attention_keeps_its_kernels_intermediates_unless_offloaded(memory, saves):
    from moe_tune.engine.model.attention import GatedDeltaNet

    mixers = [m for m in managed_model(*memory).modules() if isinstance(m, GatedDeltaNet)]
    assert mixers and all(m.saves_op_intermediates is saves for m in mixers)


def test_whole_layer_checkpointing_still_trains_like_saving_everything(batch, reference):
    torch.manual_seed(0)
    model, _ = build_trainable_model(tiny_profile("memory.activation_checkpointing=true"))
    assert find_activation_memory(model) is None
    assert_bitwise(loss_and_grads(perturb(model).train(), batch), reference)


def fills_its_span(t: torch.Tensor) -> bool:
    """No gaps between elements in some order of the dims: the store moves only such tensors (views with gaps, like
    a split of a wider projection, stay where they are)."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)
    span = 1
    for stride, size in dims:
        if stride != span:
            return False
        span *= size
    return True


class SavedProbe:
    """Records what autograd saves in a plain model, with plain saved-tensor hooks: the independent count the
    manager's metrics are checked against. Keys are tensor objects (one per tensor, as the store keeps them)."""

    def __init__(self):
        self.sizes: list[int] = []
        self.dense: list[bool] = []
        self._seen: dict[int, list[weakref.ref]] = {}
        self.saves = 0
        self.unpacks = 0  # of saved activations (not weights) in backward
        self.unpacked_movable: set[int] = set()

    def hooks(self):
        def pack(t):
            self.saves += 1
            if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
                return t
            refs = self._seen.setdefault(id(t), [])
            if not any(ref() is t for ref in refs):
                refs.append(weakref.ref(t))
                self.sizes.append(t.numel() * t.element_size())
                self.dense.append(fills_its_span(t))
            return t

        def unpack(t):
            if not (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)):
                self.unpacks += 1
                if fills_its_span(t):
                    self.unpacked_movable.add(id(t))
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def attach(self, module):
        """Record whatever `module`'s forward saves."""
        state = {}

        def pre(mod, args):
            state["hooks"] = self.hooks()
            state["hooks"].__enter__()

        def post(mod, args, out):
            state.pop("hooks").__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def test_offloaded_bytes_are_the_saved_tensors_and_prefetch_makes_hits(batch):
    probe = SavedProbe()
    model = plain_model()
    for layer in model.base_model.model.layers:
        probe.attach(layer)
    loss_and_grads(model, batch)
    movable = sum(size for size, dense in zip(probe.sizes, probe.dense) if dense)
    unmovable = sum(probe.sizes) - movable
    assert movable > 0 and unmovable > 0

    everything_offloaded = [f"memory.{klass}=offload" for klass in OPERATOR_CLASSES] + [ALL_SIZES]
    _, metrics, _ = run(batch, *everything_offloaded)
    assert metrics["memory_host_saved_bytes"] == movable
    assert metrics["memory_gpu_saved_bytes"] == unmovable
    assert sum(metrics[f"memory_host_bytes_{k}"] for k in OPERATOR_CLASSES) == movable
    # Prefetch one layer ahead: every swap-in was under way before backward asked; none at all: every one missed.
    assert metrics["memory_cache_hit_rate"] == 1.0
    _, on_demand, _ = run(batch, *everything_offloaded, "memory.prefetch_layers=0")
    # Each moved tensor that backward reads misses once (a second ask finds it back on the device); tensors left on
    # the device never miss.
    misses = len(probe.unpacked_movable)
    assert 0 < misses < probe.unpacks
    assert on_demand["memory_cache_hit_rate"] == pytest.approx(1 - misses / probe.unpacks, abs=1e-12)
    assert on_demand["memory_swap_wait_s"] > 0


def test_recomputed_bytes_and_counts_are_the_norms(batch):
    probe = SavedProbe()
    model = plain_model()
    norms = [m for m in model.base_model.model.layers.modules() if isinstance(m, RMSNorm)]
    saving = []
    for norm in norms:
        before = {}
        norm.register_forward_pre_hook(lambda mod, args, before=before: before.update(n=probe.saves))
        norm.register_forward_hook(
            lambda mod, args, out, before=before, norm=norm: saving.append(norm) if probe.saves > before["n"] else None
        )
        probe.attach(norm)
    loss_and_grads(model, batch)

    _, metrics, managed = run(batch, "memory.norm=recompute")
    assert metrics["memory_recomputed_bytes"] == sum(probe.sizes)
    # Each norm that saved something is recomputed once in backward; the first layer's input norm saves nothing
    # (frozen weight, input from the frozen embedding).
    assert metrics["memory_recomputations"] == len(saving) < len(norms)
    assert len(find_activation_memory(managed).regions) == len(norms)


def test_recomputing_the_router_counts_expert_loads_once(batch):
    plain = plain_model()
    loss_and_grads(plain, batch)
    _, metrics, managed = run(batch, "memory.router=recompute")
    assert metrics["memory_recomputations"] == 4
    loads = [m.load_counts for m in plain.modules() if isinstance(m, MoEBlock)]
    managed_loads = [m.load_counts for m in managed.modules() if isinstance(m, MoEBlock)]
    assert all(torch.equal(a, b) for a, b in zip(loads, managed_loads))


# Small enough that one step of the tiny model (about 460 KB offloaded) spans many chunks.
SMALL_HOST_CHUNK_BYTES = 8 * 2**10


def record_host_slots(monkeypatch) -> list[int]:
    """The host address of every tensor the store copies out, in order."""
    addresses = []
    copy_out = TieredStore._copy_out

    def recording(self, entry):
        copy_out(self, entry)
        addresses.append(tuple(piece.data_ptr() for piece in entry.host))

    monkeypatch.setattr(TieredStore, "_copy_out", recording)
    return addresses


def test_host_pool_is_allocated_once_and_reused(batch, monkeypatch):
    monkeypatch.setattr(store_module, "HOST_CHUNK_BYTES", SMALL_HOST_CHUNK_BYTES)
    addresses = record_host_slots(monkeypatch)
    model = managed_model("memory.preset=max-context", ALL_SIZES)
    memory = find_activation_memory(model)
    capacities, slots = [], []
    for _ in range(3):
        loss_and_grads(model, batch)
        model.zero_grad()
        memory.step_metrics()
        capacities.append((memory.store.pool.allocations, memory.store.pool.capacity_bytes))
        slots.append(addresses[:])
        addresses.clear()
    assert capacities[0][0] > 1 and capacities == [capacities[0]] * 3
    # Every step copies into the same slots, in the same order.
    assert slots[0] and slots == [slots[0]] * 3


def test_host_pool_pieces_fill_chunks_in_order_and_keep_their_size_when_tensors_change(monkeypatch):
    monkeypatch.setattr(store_module, "HOST_CHUNK_BYTES", 4096)
    pool = store_module.HostPool(pin_memory=False)

    def take_all(sizes):
        pool.reset()
        return [pool.take(n) for n in sizes]

    # 3000 fits the first chunk; 5000 fills its rest (from the aligned 3072) and 3976 of the second, which leaves
    # less than one alignment step there, so 100 opens a third.
    pieces = take_all([3000, 5000, 100])
    assert [[p.numel() for p in ps] for ps in pieces] == [[3000], [1024, 3976], [100]]
    chunk_of = [0, 0, 1, 2]
    flat = [p for ps in pieces for p in ps]
    offsets = [p.data_ptr() - pool.chunks[c].data_ptr() for p, c in zip(flat, chunk_of)]
    assert offsets == [0, 3072, 0, 0]
    assert pool.allocations == 3 and pool.capacity_bytes == 3 * 4096
    # Larger tensors next step (a longer sequence): the same chunks first, then one more; never a chunk per size.
    pieces = take_all([9000, 4000])
    assert [[p.numel() for p in ps] for ps in pieces] == [[4096, 4096, 808], [3072, 928]]
    assert pool.allocations == 4 and pool.capacity_bytes == 4 * 4096
    # Smaller again: nothing new.
    take_all([4096, 4096, 100])
    assert pool.allocations == 4


def test_offloaded_tensor_in_pieces_comes_back_bitwise_with_its_strides(monkeypatch):
    monkeypatch.setattr(store_module, "HOST_CHUNK_BYTES", 1024)
    store = store_with(preset="max-context", min_offload_mb=0)
    store.begin_forward(torch.device("cpu"))
    store.klass = "linear"
    # Dense but not contiguous (a transpose), 7 chunks' worth of fp64.
    t = torch.randn(30, 29, dtype=torch.float64).t()
    entry = store.pack(t)
    assert entry.device is None and len(entry.host) > 1
    back = store.unpack(entry)
    assert back.stride() == t.stride() and torch.equal(back, t)


def test_forward_without_backward_leaves_nothing_alive(batch):
    # Under a budget never reached every saved tensor stays on the device: an entry holding its tensor with the
    # tensor's autograd history would close a cycle (the op that saved its own output) that outlives the dropped
    # output.
    model = managed_model("memory.gpu_budget_gb=1000", ALL_SIZES)
    store = find_activation_memory(model).store
    out = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels)
    entries = [ref for refs in store._by_layer.values() for ref in refs]
    assert sum(ref() is not None for ref in entries) > 0
    del out
    gc.collect()
    assert sum(ref() is not None for ref in entries) == 0


def store_with(**memory):
    return TieredStore(resolve_policy(MemoryProfile(**memory)), num_layers=4)


def test_budget_sinks_the_coldest_first():
    store = store_with(gpu_budget_gb=3500e-9, min_offload_mb=0)
    store.begin_forward(torch.device("cpu"))
    tensors, entries = [], []
    for layer in range(4):
        store.layer = layer
        for _ in range(2):
            tensors.append(torch.randn(250))  # 1000 bytes
            entries.append(store.pack(tensors[-1]))
    store.end_forward()
    # 8000 bytes against a 3500-byte budget: the 5 saved first (needed last in backward) moved, the 3 last stayed.
    assert [e.host is not None for e in entries] == [True] * 5 + [False] * 3
    assert [e.device is not None for e in entries] == [False] * 5 + [True] * 3
    for t, e in zip(reversed(tensors), reversed(entries)):
        assert torch.equal(store.unpack(e), t)
    stats = store.take_stats()
    assert (stats.evicted_bytes, stats.host_bytes, stats.gpu_bytes) == (5000, 5000, 3000)


def test_storage_held_by_saved_views_is_counted_once_each():
    # A saved view keeps its whole base alive: gpu_bytes counts the views' own bytes, gpu_storage_bytes the storage
    # they hold, each storage once (two views of one base, a tensor of its own, and one sent to the host).
    store = store_with(gpu_budget_gb=1e-9 * 2000, min_offload_mb=0)
    store.begin_forward(torch.device("cpu"))
    base, own, moved = torch.randn(1000), torch.randn(100), torch.randn(600)
    store.layer = 0
    moved_entry = store.pack(moved)  # 2400 bytes: over the 2000-byte budget once the rest come
    store.layer = 3
    entries = [store.pack(base[:10]), store.pack(base[500:510]), store.pack(own)]
    store.end_forward()
    assert moved_entry.host is not None and all(entry.device is not None for entry in entries)
    stats = store.take_stats()
    assert stats.gpu_bytes == (10 + 10 + 100) * 4
    assert stats.gpu_storage_bytes == (1000 + 100) * 4


def test_tensors_under_the_threshold_stay_on_the_device():
    store = store_with(experts="offload", min_offload_mb=0.002)
    store.begin_forward(torch.device("cpu"))
    store.klass = "experts"
    small, large = torch.randn(400), torch.randn(600)  # 1600 and 2400 bytes, threshold 2000
    small_entry, large_entry = store.pack(small), store.pack(large)
    store.klass = "linear"
    linear_entry = store.pack(torch.randn(600))
    store.end_forward()
    assert small_entry.device is not None and large_entry.host is not None and linear_entry.device is not None
    # A tensor saved twice is stored once.
    assert torch.equal(store.unpack(large_entry), large) and torch.equal(store.unpack(small_entry), small)
    assert store.take_stats().host_bytes == 2400


def test_zero3_with_lora_trains_like_saving_everything(tmp_path):
    common = ["data.seq_len=32", "train.micro_batch_size=1", "data.corpus_documents=50", "train.steps=2",
              "train.warmup_steps=1"]  # fmt: skip
    saved = finetune(load_profile("tiny", [*common, f"output.dir={tmp_path / 'a'}"]), show_progress=False)
    managed = finetune(
        load_profile("tiny", [*common, f"output.dir={tmp_path / 'b'}", "memory.preset=max-context", ALL_SIZES]),
        show_progress=False,
    )
    assert managed.losses == saved.losses
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["memory_host_saved_bytes"] > 0 and r["memory_recomputations"] > 0 for r in records)


def test_bad_memory_values_are_one_line_each():
    with pytest.raises(ProfileError) as err:
        load_profile(
            "tiny",
            ["memory.experts=keep", "memory.gpu_budget_gb=-1", "memory.prefetch_layers=-2"],
        )
    assert err.value.problems == [
        "memory.experts ('keep'): input should be 'save', 'recompute' or 'offload'",
        "memory.gpu_budget_gb (-1): input should be greater than or equal to 0",
        "memory.prefetch_layers (-2): input should be greater than or equal to 0",
    ]
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", ["memory.activation_checkpointing=true", "memory.preset=balanced", "memory.norm=save"])
    assert err.value.problems == [
        "memory.activation_checkpointing (true) recomputes whole layers: memory.preset ('balanced') must be 'none' "
        "with it",
        "memory.norm ('save') must be unset with memory.activation_checkpointing (true), which recomputes whole "
        "layers",
    ]


def test_is_parameter_agrees_with_isinstance():
    class MyParameter(nn.Parameter):
        pass

    weight, activation = nn.Parameter(torch.randn(3, 4)), torch.randn(3, 4, requires_grad=True)
    flagged = torch.randn(2)
    flagged._is_param = True
    cases = {"parameter": weight, "subclass": MyParameter(torch.randn(2)), "flagged": flagged,
             "activation": activation, "activation view": activation.t(), "detached weight": weight.detach()}  # fmt: skip
    for name, t in cases.items():
        expected = isinstance(t, nn.Parameter)
        assert is_parameter(t) == expected, name
    # A view of a weight (linear saves weight.t()) counts as the weight.
    assert is_parameter(weight.t()) and not isinstance(weight.t(), nn.Parameter)
    assert [name for name, t in cases.items() if is_parameter(t)] == ["parameter", "subclass", "flagged"]
