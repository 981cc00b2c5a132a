"""MoE cases shared by the interpreter tests (tests/ops/test_moe_triton.py) and the GPU tests (tests/gpu/
test_moe_gpu.py) of ops/moe: routing patterns, random inputs with optional per-expert LoRA, and gradients.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank.
"""

import torch

from moe_tune.ops.moe import ExpertLoRA

LORA_NAMES = ("a_gate_up", "b_gate_up", "a_down", "b_down")


def route_pattern(pattern: str, gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int, device: str = "cpu"):
    """topk_ids [N, k] int64 of one of the test routings."""
    if pattern == "random":
        # Distinct experts per token, as a router picks them.
        return torch.rand(num_tokens, num_experts, generator=gen, device=device).argsort(dim=-1)[:, :top_k]
    if pattern == "two_experts_only":
        # Experts 1 and 4 only: every other expert is empty and owns no tile.
        pair = torch.tensor([1, 4], device=device)
        flips = torch.rand(num_tokens, generator=gen, device=device) < 0.5
        return torch.stack([torch.where(flips, pair[0], pair[1]), torch.where(flips, pair[1], pair[0])], dim=1)
    if pattern == "all_to_last":
        # Every slot on the last expert: its rows span several tiles, the last one partial.
        return torch.full((num_tokens, top_k), num_experts - 1, device=device)
    raise AssertionError(pattern)


def make_case(
    num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern="random", lora_on="none", seed=0, *,
    rank: int, scaling: float, device: str = "cpu", ids_dtype: torch.dtype = torch.int64,
) -> dict:  # fmt: skip
    """moe_mlp's keyword arguments: x [N, D], topk_ids [N, k] in ids_dtype, topk_weights [N, k], w_gate_up
    [E, 2F, D], w_down [E, D, F] in dtype, every float tensor a leaf that requires grad; lora: None, or ExpertLoRA on
    lora_on ("both", "gate_up", "down") with rank r and scaling. fp64 cases draw fp64 values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=draw_dtype) * scale).to(dtype).requires_grad_()

    case = dict(
        x=randn(num_tokens, model_dim),
        topk_ids=route_pattern(pattern, gen, num_tokens, num_experts, top_k, device).to(ids_dtype),
        topk_weights=torch.rand(num_tokens, top_k, generator=gen, device=device, dtype=draw_dtype)
        .to(dtype)
        .requires_grad_(),
        w_gate_up=randn(num_experts, 2 * hidden_dim, model_dim, scale=model_dim**-0.5),
        w_down=randn(num_experts, model_dim, hidden_dim, scale=hidden_dim**-0.5),
        lora=None,
    )
    if lora_on != "none":
        # B is random, not PEFT's zero init, so that the adapter changes the output and gets gradients to compare.
        pairs = {}
        if lora_on in ("both", "gate_up"):
            pairs["a_gate_up"] = randn(num_experts, rank, model_dim, scale=model_dim**-0.5)
            pairs["b_gate_up"] = randn(num_experts, 2 * hidden_dim, rank, scale=rank**-0.5)
        if lora_on in ("both", "down"):
            pairs["a_down"] = randn(num_experts, rank, hidden_dim, scale=hidden_dim**-0.5)
            pairs["b_down"] = randn(num_experts, model_dim, rank, scale=rank**-0.5)
        case["lora"] = ExpertLoRA(**pairs, scaling=scaling)
    return case


def grad_inputs(case: dict) -> dict[str, torch.Tensor]:
    """The case's tensors that require grad, by name (LoRA ones as lora.<name>)."""
    inputs = {name: case[name] for name in ("x", "topk_weights", "w_gate_up", "w_down") if name in case}
    add_to = case.get("add_to")
    if isinstance(add_to, torch.Tensor):
        inputs["add_to"] = add_to
    elif add_to is not None:
        inputs.update({f"add_to[{i}]": t for i, t in enumerate(add_to)})
    if case["lora"] is not None:
        for name in LORA_NAMES:
            tensor = getattr(case["lora"], name)
            if tensor is not None:
                inputs[f"lora.{name}"] = tensor
    return {name: tensor for name, tensor in inputs.items() if tensor.requires_grad}


def run_with_grads(fn, case: dict, grad_y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """fn(**case) and the gradient of <y, grad_y> for every input that requires grad."""
    y = fn(**case)
    inputs = grad_inputs(case)
    grads = torch.autograd.grad(y, list(inputs.values()), grad_y)
    return y, dict(zip(inputs, grads))
