"""CUDA graphs of the MoE blocks (train.cuda_graphs, engine/train/graphs.py): a replay runs the kernels eager mode
runs, so outputs, every gradient, the expert loads and whole training steps are bitwise eager's; inputs the graphs
were not captured for run eagerly.

Run on the H200: pytest -m gpu tests/gpu/test_cuda_graphs_gpu.py
"""

import pytest
import torch

from moe_tune.engine.train.graphs import GRAPHED_ATTR, graph_moe_blocks, moe_blocks
from moe_tune.profiles import load_profile

pytestmark = pytest.mark.gpu

# The hybrid benchmark model's layer kinds at a small width (as tests/gpu/test_host_syncs_gpu.py), ZeRO-1.
SMALL = ["model.hidden_size=256", "model.num_attention_heads=4", "model.num_key_value_heads=2",
         "model.linear_attention.num_key_heads=2", "model.linear_attention.num_value_heads=4",
         "model.linear_attention.key_head_dim=64", "model.linear_attention.value_head_dim=64",
         "model.moe.expert_intermediate_size=128", "model.moe.shared_expert_intermediate_size=128",
         "model.vocab_size=4096", "data.seq_len=1024", "data.corpus_documents=2000"]  # fmt: skip
TOKENS = 2048


@pytest.fixture
def replays(monkeypatch):
    """Counts CUDA graph replays."""
    count = [0]
    replay = torch.cuda.CUDAGraph.replay

    def counting(self):
        count[0] += 1
        return replay(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    return count


def _bf16_blocks():
    from moe_tune.engine.train.trainer import build_trainable_model

    torch.manual_seed(0)
    model, _ = build_trainable_model(load_profile("bench-qwen3-next", SMALL))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # LoRA B factors start at zero: perturbed, every adapter gradient is non-zero.
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    model = model.to(device="cuda").train()
    with torch.no_grad():
        # As DeepSpeed's bf16 cast: parameters only. The buffers (the MoE load counts among them) stay fp32, where
        # counting goes past 256 (bf16 counts stop there, and the loads comparison would see saturated counts).
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    assert all(buffer.dtype != torch.bfloat16 for buffer in model.buffers())
    return model, moe_blocks(model)


def _inputs(blocks, tokens, seed):
    """Each block's x and residual (the decoder layer's two inputs to it), and its output's gradient."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = blocks[0].gate.in_features

    def draws():
        return [torch.randn(1, tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
                for _ in blocks]  # fmt: skip

    xs, residuals = draws(), draws()
    grads_out = [torch.randn(1, tokens, hidden, generator=gen, device="cuda") for _ in blocks]
    return xs, residuals, grads_out


def _fwd_bwd(blocks, xs, residuals, grads_out):
    """Forwards first to last, one backward (a step's order): outputs, input, residual and parameter gradients,
    loads."""
    outs = [block(x, residual=r) for block, x, r in zip(blocks, xs, residuals)]
    loss = sum((y.float() * g).sum() + aux for (y, aux), g in zip(outs, grads_out))
    params = [p for block in blocks for p in block.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, xs + residuals + params)
    loads = [block.load_counts.clone() for block in blocks]
    for block in blocks:
        block.load_counts.zero_()
    # Clones: a replay's outputs and gradients live in the graphs' static buffers.
    return [y.detach().clone() for y, _ in outs] + [g.clone() for g in grads] + loads


def _assert_bitwise(result, reference):
    assert len(result) == len(reference)
    differing = [i for i, (a, b) in enumerate(zip(result, reference)) if not torch.equal(a, b)]
    assert not differing, f"{len(differing)} of {len(reference)} tensors differ (first: {differing[:5]})"


def test_graphed_blocks_are_bitwise_eager(replays):
    _, blocks = _bf16_blocks()
    rounds = [_inputs(blocks, TOKENS, seed) for seed in (10, 11)]
    eager = [_fwd_bwd(blocks, *inputs) for inputs in rounds]
    # Bitwise equality means something only if eager reproduces itself.
    _assert_bitwise(_fwd_bwd(blocks, *rounds[0]), eager[0])
    graph_moe_blocks(blocks, (1, TOKENS, blocks[0].gate.in_features), torch.bfloat16, torch.device("cuda"))
    assert all(block.load_counts.abs().sum() == 0 for block in blocks), "warm-up loads left in the counts"
    replays[0] = 0
    for inputs, reference in zip(rounds, eager):
        _assert_bitwise(_fwd_bwd(blocks, *inputs), reference)
    # Each block's forward and backward replayed once a round.
    assert replays[0] == 2 * 2 * len(blocks)
    # The gradients are non-trivial (the adapters included).
    assert all(g.abs().sum() > 0 for g in eager[0][len(blocks):-len(blocks)])
    # A block called without its residual (the decoder layer always passes one) runs eagerly.
    replays[0] = 0
    xs = rounds[0][0]
    eager_without = [block(x) for block, x in zip(blocks, xs)]
    assert replays[0] == 0 and all(y.shape == x.shape for (y, _), x in zip(eager_without, xs))


def test_other_inputs_run_eagerly(replays):
    model, blocks = _bf16_blocks()
    odd = _inputs(blocks, TOKENS - 1, 12)
    reference = _fwd_bwd(blocks, *odd)
    graph_moe_blocks(blocks, (1, TOKENS, blocks[0].gate.in_features), torch.bfloat16, torch.device("cuda"))
    replays[0] = 0
    _assert_bitwise(_fwd_bwd(blocks, *odd), reference)
    # The captured shape in eval mode: eager too.
    model.eval()
    with torch.no_grad():
        x = torch.randn(1, TOKENS, blocks[0].gate.in_features, device="cuda", dtype=torch.bfloat16)
        blocks[0](x, residual=x.clone())
    assert replays[0] == 0


def test_release_gives_the_eager_forward_back_and_capture_again_works(replays):
    _, blocks = _bf16_blocks()
    inputs = _inputs(blocks, TOKENS, 13)
    reference = _fwd_bwd(blocks, *inputs)
    shape = (1, TOKENS, blocks[0].gate.in_features)
    graphs = graph_moe_blocks(blocks, shape, torch.bfloat16, torch.device("cuda"))
    graphs.release()
    assert not any("forward" in vars(block) or "input_buffers" in vars(block) or hasattr(block, GRAPHED_ATTR)
                   for block in blocks)  # fmt: skip
    replays[0] = 0
    _assert_bitwise(_fwd_bwd(blocks, *inputs), reference)
    assert replays[0] == 0
    graph_moe_blocks(blocks, shape, torch.bfloat16, torch.device("cuda"))
    _assert_bitwise(_fwd_bwd(blocks, *inputs), reference)
    assert replays[0] == 2 * len(blocks)


def _train(cuda_graphs: str, steps: int = 3):
    """Training steps of the small model through the benchmark's runner (DeepSpeed ZeRO-1, AdamW): losses, the
    adapters after them, the selection biases, and the replays' copies of inputs and of the blocks' output gradients
    (None: no graphs were captured)."""
    from moe_tune.engine.bench.steps import StepRunner

    runner = StepRunner(load_profile("bench-qwen3-next", [*SMALL, f"train.cuda_graphs={cuda_graphs}"]))
    try:
        losses = [runner.step()["loss"] for _ in range(steps)]
        module = runner.engine.module
        trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
        biases = [block.selection_bias.clone() for block in moe_blocks(module)]
        captures = [] if runner.graphs is None else runner.graphs.captures
        copies = None if runner.graphs is None else sum(capture.input_copies for capture in captures)
        grad_copies = None if runner.graphs is None else sum(capture.grad_copies[0] for capture in captures)
        return losses, trained, biases, copies, grad_copies
    finally:
        runner.close()


def test_graphed_training_steps_are_bitwise_eager():
    losses, trained, biases, copies, grad_copies = _train("false")
    assert copies is None and grad_copies is None
    again = _train("false")
    # Bitwise equality means something only if eager training reproduces itself.
    assert again[0] == losses
    with_graphs = _train("true")
    # Every replay read its inputs where the post-attention norm wrote them (MoEBlock.input_buffers), and every
    # backward replay its output's gradient where the next norm wrote it (want_grad_in): none was copied.
    assert with_graphs[3] == 0 and with_graphs[4] == 0
    assert with_graphs[0] == losses
    assert all(torch.equal(with_graphs[1][name], trained[name]) for name in trained)
    assert all(torch.equal(a, b) for a, b in zip(with_graphs[2], biases))


def _finetune(out, *overrides, **kwargs):
    from moe_tune.engine.train.trainer import finetune

    profile = load_profile("bench-qwen3-next", [*SMALL, "train.steps=4", "output.save_every=2", f"output.dir={out}",
                                                *overrides])  # fmt: skip
    return finetune(profile, show_progress=False, **kwargs)


def test_finetune_with_graphs_trains_resumes_and_exports_as_eager(tmp_path):
    # The trainer's path: graphs captured after DeepSpeed's set-up (and after a resume's loading), checkpoints and the
    # exported adapter written from graphed blocks; everything bitwise the eager run.
    from safetensors.torch import load_file

    eager = _finetune(tmp_path / "eager", "train.cuda_graphs=false")
    graphed = _finetune(tmp_path / "graphed", "train.cuda_graphs=true")
    assert graphed.losses == eager.losses
    adapter = lambda run: load_file(str(run.adapter / "adapter_model.safetensors"))  # noqa: E731
    expected = adapter(eager)
    assert expected and all(torch.equal(t, expected[name]) for name, t in adapter(graphed).items())
    first = _finetune(tmp_path / "split", "train.cuda_graphs=true", stop_after=2)
    second = _finetune(tmp_path / "split", "train.cuda_graphs=true", resume=True)
    assert second.start_step == 2 and first.losses + second.losses == eager.losses
