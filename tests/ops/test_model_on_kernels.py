"""A whole hybrid MoE model on the Triton kernels (in the interpreter) against the same model on the references: the
loss and every trainable gradient. The ops' own tests check each kernel alone; this one checks how the model wires
them: the input norm handing its input on (the residual's gradient summed in the norm's backward, where the reference
lets autograd add it), the top-k slot sums, the residual add fused into the post-attention norm, LoRA on attention
and on every expert. The projection nodes are the same torch code on both paths (tests/engine/test_projections.py
checks them, the router's handing its input on included, against the modules' own calls).

fp32 (the interpreter's bf16 arithmetic is not the GPU's); tests/gpu runs bf16 steps on the GPU.
"""

import pytest
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.engine.model.moe import MoEBlock
    from moe_tune.profiles import load_profile
    from small_models import loss_and_grads, perturbed_lora_model

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

# Measured at most 7e-7 of each gradient's largest entry: the kernels and the references sum in other orders.
RELATIVE_TOLERANCE = 1e-5
VOCAB = 300


def hybrid_moe_model(shared_expert_gate: bool):
    """bench-qwen3-next's architecture cut small (a gated delta net layer and a gated attention layer, each with a MoE
    of 4 experts top-2 and a shared expert), LoRA r4 on q, k, v, o and the experts, parameters perturbed."""
    raw = load_profile("bench-qwen3-next").model.model_dump(mode="json")
    raw.update(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
               layers=[{"attention": "linear", "mlp": "moe"}, {"attention": "full", "mlp": "moe"}])  # fmt: skip
    raw["linear_attention"].update(num_key_heads=1, num_value_heads=2, key_head_dim=16, value_head_dim=16)
    raw["moe"].update(num_experts=4, top_k=2, expert_intermediate_size=16, shared_expert_intermediate_size=16,
                      shared_expert_gate=shared_expert_gate)  # fmt: skip
    return perturbed_lora_model(raw, ["q_proj", "k_proj", "v_proj", "o_proj"], True, torch.float32)


def row_loss_and_grads(model):
    return loss_and_grads(model, [0, 20, 45, 70], VOCAB)


@pytest.mark.parametrize("shared_expert_gate", [True, False], ids=["gated_shared_expert", "ungated"])
def test_model_on_the_kernels_trains_as_on_the_references(monkeypatch, shared_expert_gate):
    model = hybrid_moe_model(shared_expert_gate)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MOE_TUNE_KERNELS", "reference")
    expected_loss, expected = row_loss_and_grads(model)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    loss, grads = row_loss_and_grads(model)
    torch.testing.assert_close(loss, expected_loss, atol=0, rtol=RELATIVE_TOLERANCE)
    assert grads.keys() == expected.keys() and len(grads) > 20
    for name, grad in grads.items():
        scale = expected[name].abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(grad, expected[name], atol=RELATIVE_TOLERANCE * scale, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def model_on_kernels(monkeypatch):
    """The gated-shared-expert model on the kernels (interpreter), and its loss and gradients as it stands."""
    model = hybrid_moe_model(True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    return model, *row_loss_and_grads(model)


def assert_bitwise_as_before(model, expected_loss, expected):
    loss, grads = row_loss_and_grads(model)
    assert torch.equal(loss, expected_loss) and grads.keys() == expected.keys()
    assert all(torch.equal(grad, expected[name]) for name, grad in grads.items())


def test_moe_blocks_read_their_inputs_where_they_ask_them_written(monkeypatch):
    # Blocks offering input buffers (a CUDA-graphed block's static inputs, MoEBlock.input_buffers) get the
    # post-attention norm and the residual written there by the norm's kernel and read them with no copy: the loss
    # and every gradient bit for bit those of the blocks without them.
    model, expected_loss, expected = model_on_kernels(monkeypatch)
    buffers, read = {}, []
    for block in [m for m in model.modules() if isinstance(m, MoEBlock)]:

        def input_buffers(like, block=block):
            return buffers.setdefault(block, (torch.full_like(like, float("nan")), torch.full_like(like, float("nan"))))

        def forward(x, chunk=None, residual=None, forward=block.forward, block=block):
            read.append((x.data_ptr(), residual.data_ptr()) == tuple(b.data_ptr() for b in buffers[block]))
            return forward(x, chunk, residual)

        monkeypatch.setattr(block, "input_buffers", input_buffers, raising=False)
        monkeypatch.setattr(block, "forward", forward, raising=False)
    assert_bitwise_as_before(model, expected_loss, expected)
    assert read == [True, True]


@pytest.mark.parametrize("shared_expert_gate", [True, False], ids=["gated_shared_expert", "ungated"])
def test_moe_blocks_add_to_their_inputs_gradient_in_place(monkeypatch, shared_expert_gate):
    # In each MoE block's backward the routed experts (MoEFunction) lodge the input's gradient they make, the shared
    # expert's node adds its products into it in place and lodges it in turn, and the router's node adds its own:
    # every node handing the input on owns the gradient it is passed (no copy of it; ops/common/grad_handoff.py).
    # test_model_on_the_kernels_trains_as_on_the_references checks the gradients this makes.
    from moe_tune.engine.model import projections

    model = hybrid_moe_model(shared_expert_gate)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    owned = []
    take_owned = projections.take_owned

    def recording(handoff, grad):
        result = take_owned(handoff, grad)
        if grad is not None:
            owned.append(result)
        return result

    monkeypatch.setattr(projections, "take_owned", recording)
    row_loss_and_grads(model)
    # Two MoE layers, each with the router's node and the shared expert's gate-and-up node.
    assert owned == [True] * 4


def test_norms_write_the_moe_blocks_output_gradients_where_they_are_wanted(monkeypatch):
    # Blocks whose outputs ask for their gradient in a buffer (a CUDA-graphed block's backward input, want_grad_in)
    # get it written there by the op consuming the output (the next layer's input norm, the final norm): the
    # gradient that reaches each output is a view of its buffer, and the loss and every gradient are bit for bit
    # those of the blocks without buffers.
    from moe_tune.ops.common.grad_handoff import want_grad_in

    model, expected_loss, expected = model_on_kernels(monkeypatch)
    buffers, arrived = {}, []
    for block in [m for m in model.modules() if isinstance(m, MoEBlock)]:

        def forward(x, chunk=None, residual=None, forward=block.forward, block=block):
            out, aux = forward(x, chunk, residual)
            buffer = buffers.setdefault(block, torch.full_like(out, float("nan")))
            out.register_hook(lambda grad, buffer=buffer: arrived.append(grad.data_ptr() == buffer.data_ptr()))
            return want_grad_in(out, buffer), aux

        monkeypatch.setattr(block, "forward", forward, raising=False)
    assert_bitwise_as_before(model, expected_loss, expected)
    assert arrived == [True, True]
    assert not any(torch.isnan(buffer).any() for buffer in buffers.values())
