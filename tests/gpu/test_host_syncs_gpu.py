"""Where a training step waits for the GPU: every wait is a point where the host stops queueing work, so the GPU
idles while the host catches up. The benchmark profiles lost about 40 of them per step (docs/PERF.md, issue 9); this
keeps them out. Counted with torch.cuda.set_sync_debug_mode("warn"), which warns at each synchronizing call.

Run on the H200 on its own: pytest -m gpu tests/gpu
"""

import collections
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

# The waits two steps run back to back may have, by file of ours: none. The batch reaches the GPU through pinned
# memory without a wait, full attention's buckets and linear attention's bounds read the batch's host copy of
# cu_seqlens (ops/common/host_copy.py), and a step's values reach the host in one copy read by waiting on its event
# (engine/train/step_values.py), after the next step is queued.
ALLOWED: dict[str, int] = {}


def our_file(filename: str) -> str | None:
    """The file's path from our package root (engine/..., ops/...), or None for anyone else's."""
    import moe_tune.engine
    import moe_tune.ops

    path = Path(filename).resolve()
    for package in (moe_tune.engine, moe_tune.ops):
        root = Path(package.__file__).resolve().parent
        if path.is_relative_to(root):
            return f"{root.name}/{path.relative_to(root).as_posix()}"
    return None


def test_a_training_step_waits_for_the_gpu_only_where_allowed():
    from moe_tune.engine.bench.steps import StepRunner
    from moe_tune.profiles import load_profile

    # The hybrid benchmark model's layer kinds (gated delta net, gated full attention, MoE with a shared expert)
    # at a small width, ZeRO stage 1 as the benchmark profiles run.
    overrides = ["model.hidden_size=256", "model.num_attention_heads=4", "model.num_key_value_heads=2",
                 "model.linear_attention.num_key_heads=2", "model.linear_attention.num_value_heads=4",
                 "model.linear_attention.key_head_dim=64", "model.linear_attention.value_head_dim=64",
                 "model.moe.expert_intermediate_size=128", "model.moe.shared_expert_intermediate_size=128",
                 "model.vocab_size=4096", "data.seq_len=1024", "data.corpus_documents=2000"]  # fmt: skip
    runner = StepRunner(load_profile("bench-qwen3-next", overrides))
    try:
        runner.step()
        runner.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                # As the trainer's loop and the profile's timed steps: the second queued before the first is read.
                first = runner.launch()
                second = runner.launch(behind=first)
                runner.finish(first)
                runner.finish(second)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        runner.close()
    ours, theirs = collections.Counter(), collections.Counter()
    for warning in caught:
        if "synchroniz" in str(warning.message):
            name = our_file(warning.filename)
            (ours if name else theirs)[name or f"{warning.filename}:{warning.lineno}"] += 1
    print(f"waits in two steps: ours {dict(ours)}, others {dict(theirs)}")  # shown with -s: what ALLOWED bounds
    over = {name: count for name, count in ours.items() if count > ALLOWED.get(name, 0)}
    assert not over, f"waits for the GPU beyond the allowed ones: {over} (ours: {dict(ours)}, others: {dict(theirs)})"
    # DeepSpeed's ZeRO-1 step waits nowhere with its norm and clip helpers replaced (engine/train/ds_sync_free.py);
    # torch's own (the loop's synchronize) are listed, not judged.
    deepspeeds = {name: count for name, count in theirs.items() if "deepspeed" in name}
    assert not deepspeeds, f"DeepSpeed waits for the GPU: {deepspeeds} (others: {dict(theirs)})"


def test_the_profile_records_a_read_of_a_device_value_where_it_is_read():
    """engine/bench/host_waits.py (the profile's `host_waits`): a value read back to the host is one wait, at the line
    that reads it; queued work is none; the debug mode is as before afterwards."""
    import traceback

    from moe_tune.engine.bench.host_waits import frame_text, recorded_host_waits

    x = torch.ones(1024, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    with recorded_host_waits() as waits:
        y = x * 2 + 1  # queued only
        value = y.sum().item()  # read on the host: the one wait
    assert value == 3 * 1024
    assert len(waits) == 1, waits
    this_file = frame_text(traceback.FrameSummary(__file__, 0, "")).rsplit(":", 1)[0]
    assert waits[0][0].startswith(f"{this_file}:") and waits[0][0].endswith(
        "(test_the_profile_records_a_read_of_a_device_value_where_it_is_read)"
    ), waits
    assert torch.cuda.get_sync_debug_mode() == before


def test_the_profile_of_a_step_lists_its_host_waits_and_the_devices_idle_time():
    """`moe-tune profile PROFILE`'s diagnostics (docs/bench.md, "MFU", "Launch sites", "Host waits" and
    "Breakdown"): the SM clocks of the GEMM peak and of the steps; no per-tensor gradient copy of DeepSpeed's among
    the launch sites, no wait listed in our files (the step's loss is read by waiting on its copy's event, which
    torch does not check), and the device-only step's busy and idle time fill its span."""
    from moe_tune.engine.bench.steps import profile_steps
    from moe_tune.profiles import load_profile

    overrides = ["model.hidden_size=256", "model.num_attention_heads=4", "model.num_key_value_heads=2",
                 "model.linear_attention.num_key_heads=2", "model.linear_attention.num_value_heads=4",
                 "model.linear_attention.key_head_dim=64", "model.linear_attention.value_head_dim=64",
                 "model.moe.expert_intermediate_size=128", "model.moe.shared_expert_intermediate_size=128",
                 "model.vocab_size=4096", "data.seq_len=1024", "data.corpus_documents=2000"]  # fmt: skip
    result = profile_steps(load_profile("bench-qwen3-next", overrides), steps=1, warmup=1)
    breakdown = result["breakdown"]
    # The clocks the GEMM peak and the steps ran at (engine/bench/clocks.py), where nvidia-smi answers for the card:
    # the peak's second of GEMMs is sampled; one short timed step may fall between two samples.
    if shutil.which("nvidia-smi"):
        peak_clocks, step_clocks = result["gpu_clocks"]["gemm_peak"], result["gpu_clocks"]["steps"]
        assert peak_clocks is not None and peak_clocks["samples"] >= 1, result["gpu_clocks"]
        for clocks in (peak_clocks, step_clocks or peak_clocks):
            assert 0 < clocks["sm_mhz_min"] <= clocks["sm_mhz"] <= clocks["sm_mhz_max"] <= clocks["max_sm_mhz"], clocks
    # Where the step's ops came from: DeepSpeed's one-rank gradient reduction (a copy per trainable tensor) is not
    # among them (engine/train/ds_sync_free.py skips it).
    launch_sites = breakdown["launch_sites"]
    assert launch_sites and not [site for site in launch_sites
                                 if any("(allreduce_and_copy)" in frame for frame in site["frames"])], launch_sites
    sites = breakdown["host_waits"]
    assert not [site for site in sites if site["frames"][0].startswith(("engine/", "ops/"))], sites
    timeline = breakdown["device_timeline"]
    assert timeline["launches"] > 100 and timeline["busy_s"] > 0, timeline
    # The span from the first device event to the last, and the host's time outside it, make up the step.
    span_s = timeline["busy_s"] + timeline["idle_s"]
    assert span_s == pytest.approx(timeline["step_s"] - timeline["outside_s"], abs=1e-5), timeline
    assert timeline["gaps"] and all(gap["idle_s"] > 0 for gap in timeline["gaps"]), timeline
    # The heaviest device work by name, heaviest first.
    kernel_s = [row["time_s"] for row in timeline["kernels"]]
    assert kernel_s == sorted(kernel_s, reverse=True) and kernel_s[-1] > 0, timeline
