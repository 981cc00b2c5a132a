"""train.cuda_graphs on a machine without CUDA: what rules graphs out, the error when they are asked for anyway,
and that 'auto' leaves the model untouched. The captures and their equality with eager steps are GPU tests
(tests/gpu/test_cuda_graphs_gpu.py)."""

import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.train.graphs import GRAPHED_ATTR, check_cuda_graphs, graph_blockers, maybe_graph_moe_blocks
from moe_tune.profiles import ProfileError, load_profile

# The benchmark profile as shipped: ZeRO-1, memory preset none, one process.
BENCH = "bench-qwen3-next"


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("true", True), ("on", True), ("off", False)])
def test_profile_values(value, expected):
    assert load_profile(BENCH, [f"train.cuda_graphs={value}"]).train.cuda_graphs == expected


def test_profile_default_is_auto():
    assert load_profile("tiny").train.cuda_graphs == "auto"


def test_nothing_rules_out_the_benchmark_profile_on_cuda():
    assert graph_blockers(load_profile(BENCH), "cuda", 1) == []


@pytest.mark.parametrize(
    "overrides, device, expert_parallel, expected",
    [
        ([], "cpu", 1, "the run is on cpu: CUDA graphs need a CUDA device"),
        (["parallel.zero_stage=3"], "cuda", 1, "parallel.zero_stage (3) gathers each module's weights in hooks"),
        ([], "cuda", 2, "parallel.expert_parallel (2) sizes its all-to-all on the host every step: use 1"),
        (["memory.activation_checkpointing=true"], "cuda", 1, "memory.activation_checkpointing (true) recomputes"),
        (["memory.preset=balanced"], "cuda", 1, "memory.preset (balanced) offloads or recomputes saved tensors"),
        # A preset of none with one class changed is no longer "keep everything".
        (["memory.norm=recompute"], "cuda", 1, "memory.preset (none) offloads or recomputes saved tensors"),
        (["memory.sequence_chunk_tokens=4095"], "cuda", 1, "memory.sequence_chunk_tokens (4095) runs each MoE block"),
        (["memory.sequence_chunk_tokens=1"], "cuda", 1, "memory.sequence_chunk_tokens (1) runs each MoE block"),
    ],
    ids=["cpu", "zero3", "expert-parallel", "checkpointing", "balanced", "none-with-a-class-set", "chunks-below-row",
         "chunks-of-one"],
)
def test_what_rules_graphs_out(overrides, device, expert_parallel, expected):
    reasons = graph_blockers(load_profile(BENCH, overrides), device, expert_parallel)
    assert len(reasons) == 1 and reasons[0].startswith(expected), reasons


@pytest.mark.parametrize("chunk", [4096, 4097, 10**6])
def test_chunks_of_a_whole_row_leave_graphs_on(chunk):
    # A row no longer than the chunk runs whole (MoEBlock.forward), as without chunks.
    profile = load_profile(BENCH, [f"memory.sequence_chunk_tokens={chunk}"])
    assert profile.data.seq_len == 4096
    assert graph_blockers(profile, "cuda", 1) == []


def test_every_reason_is_listed():
    profile = load_profile(BENCH, ["parallel.zero_stage=3", "memory.preset=balanced"])
    assert len(graph_blockers(profile, "cpu", 2)) == 4


def test_true_where_ruled_out_is_a_profile_error():
    profile = load_profile(BENCH, ["train.cuda_graphs=true", "parallel.zero_stage=3"])
    with pytest.raises(ProfileError, match=r"train\.cuda_graphs \(true\): parallel\.zero_stage \(3\)") as err:
        check_cuda_graphs(profile, "cuda", 1)
    assert len(err.value.problems) == 1
    # auto and false never raise.
    for value in ("auto", "false"):
        check_cuda_graphs(load_profile(BENCH, [f"train.cuda_graphs={value}", "parallel.zero_stage=3"]), "cpu", 2)


def test_auto_on_cpu_leaves_the_model_alone():
    from moe_tune.engine.model.model import build_model

    profile = load_profile("tiny")
    model = build_model(profile.model)
    graphs = maybe_graph_moe_blocks(model, profile, torch.device("cpu"), 1, 64)
    assert graphs is None
    blocks = [m for m in model.modules() if type(m).__name__ == "MoEBlock"]
    assert blocks and not any("forward" in vars(b) or hasattr(b, GRAPHED_ATTR) for b in blocks)


def test_finetune_with_graphs_on_cpu_exits_2_before_building(tmp_path):
    result = CliRunner().invoke(
        app, ["finetune", "tiny", "--set", "train.cuda_graphs=true", "--set", f"output.dir={tmp_path / 'run'}"]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: train.cuda_graphs (true): the run is on cpu: CUDA graphs need a CUDA device",
        "error: train.cuda_graphs (true): parallel.zero_stage (3) gathers each module's weights in hooks that a graph "
        "replay skips: use 1 or 2",
    ]
    # Refused before anything was written.
    assert not (tmp_path / "run").exists()


def test_release_gives_each_block_its_eager_forward_back_and_drops_the_graphs():
    # The bookkeeping of GraphedBlocks without CUDA: stand-in captures in place of recorded graphs.
    import types

    from moe_tune.engine.model.model import build_model
    from moe_tune.engine.train.graphs import GraphedBlocks, moe_blocks

    blocks = moe_blocks(build_model(load_profile("tiny").model))
    dropped = []
    captures = []
    for block in blocks:
        block.forward = lambda x: "replayed"
        block.input_buffers = lambda like: ("static input", "static residual")
        setattr(block, GRAPHED_ATTR, True)
        captures.append(types.SimpleNamespace(block=block, drop=lambda block=block: dropped.append(block)))
    graphs = GraphedBlocks(captures, tokens=64)
    assert graphs.blocks == blocks
    assert graphs.note() == f"CUDA graphs: {len(blocks)} MoE blocks captured for micro-batches of 64 tokens"
    graphs.release()
    assert dropped == blocks and graphs.blocks == []
    assert not any("forward" in vars(b) or "input_buffers" in vars(b) or hasattr(b, GRAPHED_ATTR) for b in blocks)
    assert all(b.input_buffers(torch.zeros(1, 4, 8)) == (None, None) for b in blocks)
