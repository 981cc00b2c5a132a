"""`moe-tune profile PROFILE`: real training steps of a profile on the CPU, the memory metrics, one-line errors."""

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from moe_tune.cli.profile import app
from moe_tune.engine.bench.steps import RESULT_KEYS

runner = CliRunner()

# A few seconds on 2 cores: one packed row of 32 tokens, two warm-up steps and one timed step.
TINY_STEPS = ["--steps", "1", "--set", "data.seq_len=32", "--set", "train.micro_batch_size=1",
              "--set", "data.corpus_documents=50"]  # fmt: skip


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_profile_runs_steps_and_reports_the_memory_metrics(tmp_path):
    out = tmp_path / "steps.json"
    memory = ["--set", "memory.preset=max-context", "--set", "memory.min_offload_mb=0"]
    result = runner.invoke(app, ["tiny", *TINY_STEPS, *memory, "--set", f"output.dir={tmp_path}", "--json", str(out)])
    assert result.exit_code == 0, result.output
    for label in ("tokens/s", "step latency", "host's launch of a step", "peak memory", "saved in host memory",
                  "recomputed", "cache hit rate", "swap host -> GPU", "backward waited for swap-in"):  # fmt: skip
        assert label in result.stdout
    data = json.loads(out.read_text())
    assert list(data) == list(RESULT_KEYS)
    assert data["steps"] == 1 and data["tokens_per_s"] > 0 and data["step_time_s"] > 0
    assert data["complete"] is True and data["against"] is None
    # On the CPU a step runs as the host launches it: its time is its launch's.
    assert data["host_launch_s"] == data["step_time_s"]
    # No GPU: no clocks sampled, and the rows say so.
    assert data["gpu_clocks"] is None
    assert "SM clock: steps / GEMM peak" in result.stdout and "power: steps / GEMM peak" in result.stdout
    # Where one more step's ops came from: ranked, our model's forward among them, autograd's formulas frameless.
    sites = data["breakdown"]["launch_sites"]
    counts = [site["count"] for site in sites]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1
    assert any(site["frames"] and site["frames"][0].startswith(("engine/", "ops/")) for site in sites), sites
    assert any(not site["frames"] for site in sites), sites
    assert "where one more step's ops were dispatched from" in result.stdout
    assert data["memory_policy"].startswith("max-context: linear=offload")
    memory_metrics = data["memory"]
    assert memory_metrics["host_saved_bytes"] > 0 and memory_metrics["recomputations"] > 0
    assert memory_metrics["cache_hit_rate"] == 1.0 and memory_metrics["h2d_gb_per_s"] > 0
    # Nothing of a training run is written: the profile command only measures.
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_the_clock_rows_give_both_parts_the_cards_maximum_and_its_power_limit():
    from moe_tune.cli.profile_steps import clocks_cell

    def part(sm_mhz, power_w, power_limit_w=700.0):
        return dict(samples=3, sm_mhz=sm_mhz, sm_mhz_min=sm_mhz, sm_mhz_max=sm_mhz, max_sm_mhz=1980.0,
                    power_w=power_w, power_limit_w=power_limit_w, temperature_c=50.0)  # fmt: skip

    clocks = dict(steps=part(1980.0, 512.4), gemm_peak=part(1755.0, 399.6, power_limit_w=400.0))
    assert clocks_cell(clocks, "sm_mhz", "MHz") == "1,980 / 1,755 MHz (the card's maximum 1,980)"
    assert clocks_cell(clocks, "power_w", "W") == "512 / 400 W (limit 400)"
    # No part reports a limit, or a result from before the limit was sampled: the draws alone.
    assert clocks_cell(dict(steps=part(1980.0, 512.4, None), gemm_peak=None), "power_w", "W") == "512 / - W"
    older = {key: value for key, value in part(1980.0, 512.4).items() if key != "power_limit_w"}
    assert clocks_cell(dict(steps=older, gemm_peak=older), "power_w", "W") == "512 / 512 W"
    # A part without samples (no nvidia-smi answer), a field no sample reports, no GPU.
    one_part = dict(steps=None, gemm_peak=part(1755.0, None))
    assert clocks_cell(one_part, "sm_mhz", "MHz") == "- / 1,755 MHz (the card's maximum 1,980)"
    assert clocks_cell(one_part, "power_w", "W") == "-"
    assert clocks_cell(None, "sm_mhz", "MHz") == "-"


@pytest.mark.parametrize("stopped_in", ["baseline", "ours"])
def test_a_run_stopped_in_the_baseline_keeps_our_steps(monkeypatch, tmp_path, stopped_in):
    """SIGINT (a time limit) while the baseline runs: our steps are printed and --json holds them, complete: false.
    Stopped in our own steps: the old file is as it was."""
    from moe_tune.engine.bench import against, flops

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if stopped_in == "baseline":
        monkeypatch.setattr(against, "run_transformers", interrupted)
    else:
        # After our timed steps, before the breakdown.
        monkeypatch.setattr(flops, "gemm_peak_tflops", interrupted)
    # qwen3_moe-like (transformers builds it): tiny's sparse layer has no transformers form.
    profile = tmp_path / "moe-like.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "moe-like",
        "model": {"vocab_size": 300, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 8, "attention_output_gate": False, "layers": [{"attention": "full"}] * 2,
                  "moe": {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 16}},
        "data": {"seq_len": 32, "corpus_documents": 50},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "experts": True},
        "train": {"steps": 4, "micro_batch_size": 1, "lr": 1e-3},
        "output": {"dir": str(tmp_path / "out")},
    }))  # fmt: skip
    out = tmp_path / "steps.json"
    out.write_text('{"kept": true}\n')
    result = runner.invoke(app, [str(profile), "--steps", "1", "--against", "transformers", "--json", str(out)])
    # The shell's code for SIGINT, no traceback.
    assert result.exit_code == 130 and "Traceback" not in result.output, result.output
    # Our timed step ran in both cases: the interrupt came after it.
    assert "moe-tune step 3: " in result.output, result.output
    stopped = f"stopped (KeyboardInterrupt) before the transformers baseline finished; {out} keeps our steps"
    if stopped_in == "ours":
        assert out.read_text() == '{"kept": true}\n' and "stopped (KeyboardInterrupt)" not in result.output
        return
    assert f"{stopped} (complete: false)" in result.output
    assert f"our steps written to {out} (complete: false until the transformers baseline's are in)" in result.output
    assert "tokens/s" in result.stdout and "per-operator breakdown" in result.stdout
    data = json.loads(out.read_text())
    assert list(data) == list(RESULT_KEYS)
    assert data["complete"] is False and data["against"] is None
    assert data["steps"] == 1 and data["tokens_per_s"] > 0


def test_profile_of_the_multimodal_default_feeds_its_images(tmp_path, monkeypatch):
    """tiny-vl: the generated pictures go to a temporary directory (nothing to output.dir) and reach the vision
    tower (the profile path shares the trainer's data and step)."""
    from moe_tune.engine.model.vision import VisionTower

    grids = []
    forward = VisionTower.forward
    monkeypatch.setattr(VisionTower, "forward", lambda self, pixels, grid: grids.append(grid.tolist()) or
                        forward(self, pixels, grid))  # fmt: skip
    out = tmp_path / "steps.json"
    result = runner.invoke(app, ["tiny-vl", "--steps", "1", "--set", "data.corpus_documents=8",
                                 "--set", "train.micro_batch_size=2", "--set", f"output.dir={tmp_path / 'o'}",
                                 "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["tokens_per_s"] > 0
    # Pictures of 32-48 pixels in 4-pixel patches: grids of 8 to 12 a side (a blank stand-in would be 2 x 2).
    assert any(h >= 8 for call in grids for _, h, _ in call)
    assert not (tmp_path / "o").exists()


def test_bad_memory_setting_is_one_line_exit_2():
    result = runner.invoke(app, ["tiny", "--set", "memory.norm=drop"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: memory.norm ('drop'): input should be 'save', 'recompute' or 'offload'"
    ]


def test_a_model_too_large_for_this_rank_is_one_line_exit_2(tmp_path):
    # ~3 TB of weights and optimizer state: refused before the dataset or the model is built.
    result = runner.invoke(app, ["tiny", *TINY_STEPS, "--set", "model.vocab_size=2000000000",
                                 "--set", f"output.dir={tmp_path}"])  # fmt: skip
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: model (vocab_size 2000000000, hidden_size 64, 4 layers) needs ~")


@pytest.mark.parametrize(
    "args, message",
    [
        (["tiny", "--baseline", "old.json"], "error: --baseline (old.json) does not apply with a PROFILE"),
        (["--kernels", "--steps", "5"], "error: --steps (5) does not apply with --kernels"),
    ],
)
def test_options_of_the_other_mode_are_refused(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.startswith(message)


@pytest.mark.parametrize(
    "args, message",
    [
        (["tiny", "--against", "bf16-base"],
         "error: model.base_precision ('bf16'): --against bf16-base needs 'fp8' (it trains the FP8 base against the "
         "same weights dequantized into a bf16 base)"),
        (["tiny", "--set", "model.base_precision=bf16", "--against", "bf16-base"],
         "error: model.base_precision ('bf16'): --against bf16-base needs 'fp8' (it trains the FP8 base against the "
         "same weights dequantized into a bf16 base)"),
        (["tiny", "--set", "model.base_precision=fp8", "--against", "bf16-base", "--load-checkpoint", "ckpt"],
         "error: --against (bf16-base) does not apply with --load-checkpoint"),
        (["--kernels", "--against", "bf16-base"], "error: --against (bf16-base) does not apply with --kernels"),
        (["tiny", "--set", "model.base_precision=fp8", "--against", "bf16"],
         "error: --against ('bf16') must be one of: transformers, bf16-base"),
    ],
    ids=["bf16-profile", "bf16-explicit", "load-checkpoint", "kernels-mode", "unknown-baseline"],
)  # fmt: skip
def test_bad_against_bf16_base_is_one_line_exit_2(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [message]


def bf16_base_result(**against) -> dict:
    """A result of `--against bf16-base` as profile_steps returns it (the fields the printed lines read)."""
    row = dict(impl="moe-tune, bf16 base", baseline="bf16-base", dequantized_modules=13, model_type=None,
               out_of_memory=None, speedup=1.25, memory_ratio=0.6,
               loss_gap=dict(steps=50, max=0.0123, mean=0.00456))  # fmt: skip
    return {"machine": "NVIDIA H200", "against": dict(row, **against)}


def test_bf16_base_lines_name_both_bases_and_the_loss_gap():
    from moe_tune.cli.profile_steps import against_header, against_line, out_of_memory_line

    result = bf16_base_result()
    assert against_header(result["against"]).startswith(
        "against moe-tune, bf16 base (model.base_precision bf16 holding the FP8 base's 13 FP8 modules dequantized;")
    assert against_line(result) == ("moe-tune, fp8 base / moe-tune, bf16 base: 1.25x the tokens/s, 0.60x the peak "
                                    "memory; losses 1.23% (max), 0.46% (mean) from the moe-tune, bf16 base's over "
                                    "50 steps")  # fmt: skip
    oom = bf16_base_result(out_of_memory="building the model: model (...) needs ~160.2 GB", loss_gap=None)
    assert out_of_memory_line(oom) == ("against moe-tune, bf16 base: out of memory (building the model: model (...) "
                                       "needs ~160.2 GB) on NVIDIA H200; no row to compare")  # fmt: skip


@pytest.mark.parametrize(
    "args, line",
    [
        (["--json", "{tmp}"], "error: --json ('{tmp}') is a folder: name a file to write"),
        (["--json", "{tmp}/missing/o.json"], "error: --json ('{tmp}/missing/o.json'): its folder '{tmp}/missing' does "
         "not exist"),
        (["--plot", "{tmp}"], "error: --plot ('{tmp}') is a folder: name a file to write"),
        # The formats listed after the colon are those of the installed matplotlib.
        (["--plot", "{tmp}/p.xyz"], "error: --plot ('{tmp}/p.xyz') must end in a format matplotlib writes: "),
        (["--plot", "{tmp}/p"], "error: --plot ('{tmp}/p') must end in a format matplotlib writes: "),
        (["--json", "{tmp}/old.json", "--plot", "{tmp}/old.json"], "error: --plot ('{tmp}/old.json') is the --json "
         "file: the run would overwrite it; name another file"),
    ],
    ids=["json-folder", "json-missing-folder", "plot-folder", "plot-format", "plot-no-suffix", "plot-is-json"],
)  # fmt: skip
def test_bad_output_paths_are_one_line_exit_2_before_any_step(monkeypatch, tmp_path, args, line):
    if "--plot" in args:
        pytest.importorskip("matplotlib")

    def no_steps(*args, **kwargs):
        raise AssertionError("the steps ran")

    monkeypatch.setattr("moe_tune.engine.bench.steps.profile_steps", no_steps)
    old = tmp_path / "old.json"
    old.write_text('{"kept": true}\n')
    result = runner.invoke(app, ["tiny", *TINY_STEPS, *(arg.format(tmp=tmp_path) for arg in args)])
    assert result.exit_code == 2, result.output
    (printed,) = result.stderr.strip().splitlines()
    assert printed.startswith(line.format(tmp=tmp_path)) and "Traceback" not in result.output
    assert old.read_text() == '{"kept": true}\n'


def test_an_output_without_write_permission_is_one_line_exit_2(monkeypatch, tmp_path):
    # os.access stands in for a read-only file: as root, chmod does not stop a write.
    import os

    def no_steps(*args, **kwargs):
        raise AssertionError("the steps ran")

    monkeypatch.setattr("moe_tune.engine.bench.steps.profile_steps", no_steps)
    old = tmp_path / "old.json"
    old.write_text("{}\n")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: (
        real_access(path, mode, **kwargs) and not (str(path) == str(old) and mode & os.W_OK)))
    result = runner.invoke(app, ["tiny", *TINY_STEPS, "--json", str(old)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: --json ('{old}'): no permission to write it"]


def test_a_json_over_the_profile_file_is_one_line_exit_2(monkeypatch, tmp_path):
    from moe_tune.profiles import SHIPPED_DIR

    def no_steps(*args, **kwargs):
        raise AssertionError("the steps ran")

    monkeypatch.setattr("moe_tune.engine.bench.steps.profile_steps", no_steps)
    profile = tmp_path / "mine.yaml"
    profile.write_text((SHIPPED_DIR / "tiny.yaml").read_text())
    text = profile.read_text()
    result = runner.invoke(app, [str(profile), *TINY_STEPS, "--json", str(tmp_path / "." / "mine.yaml")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --json ('{profile}') is the PROFILE file: the run would overwrite it; name another file"
    ]
    assert profile.read_text() == text


def test_a_json_write_that_fails_keeps_the_old_file(monkeypatch, tmp_path):
    # A full disk while the results are written: the file truncated, then the write refused.
    import errno
    from pathlib import Path

    from moe_tune.engine.bench import load_op

    def disk_full(path, *args, **kwargs):
        path.open("w").close()
        raise OSError(errno.ENOSPC, "No space left on device")

    fake = dict.fromkeys(load_op.RESULT_KEYS, 1)
    monkeypatch.setattr(load_op, "run_load_benchmark", lambda *args, **kwargs: dict(fake, write_s=None))
    old = tmp_path / "old.json"
    old.write_bytes(b'{"kept": true}\n')
    monkeypatch.setattr(Path, "write_text", disk_full)
    monkeypatch.setattr(Path, "write_bytes", disk_full)
    result = runner.invoke(app, ["tiny", "--load-checkpoint", str(tmp_path / "ck"), "--json", str(old)])
    assert old.read_bytes() == b'{"kept": true}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --json ('{old}'): cannot write the results (No space left on device); the file is as it was"
    ]


@pytest.mark.parametrize("args, lines", [
    (["tiny", "--compare-launch", "moe_down_fwd.one_dot=true"],
     ["error: --compare-launch entry 'moe_down_fwd.one_dot=true': moe_down_fwd has no field 'one_dot' (its fields: "
      "block_n, block_k, num_warps, num_stages, maxnreg, tma)"]),
    (["tiny", "--compare-launch", " "],
     ["error: --compare-launch: empty: name at least one FAMILY.FIELD=VALUE (docs/bench.md)"]),
    (["tiny", "--compare-launch", "causal_conv.block_t=32", "--against", "transformers", "--launch",
      "causal_conv.block_t=64"],
     ["error: --against (transformers) does not apply with --compare-launch",
      "error: --launch (causal_conv.block_t=64) does not apply with --compare-launch"]),
    (["--kernels", "--compare-launch", "causal_conv.block_t=32"],
     ["error: --compare-launch does not apply with --kernels (it times a PROFILE's steps)"]),
], ids=["unknown-field", "empty", "other-options", "kernels-mode"])  # fmt: skip
def test_bad_compare_launch_is_one_line_each_exit_2_before_any_step(monkeypatch, args, lines):
    from moe_tune.engine.bench import launch_turns

    monkeypatch.setattr(launch_turns, "compare_launches", lambda *a, **k: pytest.fail("a step ran"))
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == lines


def turns_result(rows: list[dict], steps_per_turn: int, complete: bool) -> dict:
    """A result of compare_launches (engine/bench/launch_turns.py) with these launch rows, on an H100."""
    machine = dict(device="cuda", machine="NVIDIA H100 80GB HBM3", driver="580", torch="2.11", triton="3.7.1",
                   commit="abc1234", date="2026-12-06T16:00:00+00:00", launch=None)  # fmt: skip
    return dict(profile="tiny", seq_len=32, micro_batch_size=1, rounds=3, steps_per_turn=steps_per_turn,
                launches=rows, complete=complete, **machine)  # fmt: skip


def test_compare_launch_stopped_after_its_warm_up_prints_and_writes_the_steps_timed(monkeypatch, tmp_path):
    # A time limit's SIGINT in the second launch's first turn: the defaults' steps are kept, the launch has none.
    from moe_tune.engine.bench import launch_turns

    rows = [dict(launch=None, step_times_s=[0.071, 0.072], step_time_s=0.0715, tokens_per_s=1.0, losses=[1.0, 1.0],
                 device_busy_s=None, kernels=None),
            dict(launch="moe_down_fwd.tma=true", step_times_s=[], step_time_s=None, tokens_per_s=None, losses=[],
                 device_busy_s=None, kernels=None)]  # fmt: skip
    result = turns_result(rows, steps_per_turn=2, complete=False)

    def stopped(*args, **kwargs):
        raise launch_turns.TurnsStopped(result)

    monkeypatch.setattr(launch_turns, "compare_launches", stopped)
    out = tmp_path / "turns.json"
    printed = runner.invoke(app, ["tiny", "--compare-launch", "moe_down_fwd.tma=true", "--json", str(out)])
    assert printed.exit_code == 130 and "Traceback" not in printed.output, printed.output
    assert json.loads(out.read_text()) == result
    assert (f"stopped (KeyboardInterrupt) before the 3 rounds finished: the steps timed until then; {out} keeps them "
            "(complete: false)") in printed.output  # fmt: skip
    assert "71.50" in printed.stdout and "moe_down_fwd.tma=true" in printed.stdout


def test_compare_launch_prints_each_launch_and_writes_its_rows(monkeypatch, tmp_path):
    # The turns themselves: tests/engine/bench/test_launch_turns.py. Here what the command prints and writes.
    from moe_tune.engine.bench import launch_turns

    def row(launch, times, kernels):
        return dict(launch=launch, step_times_s=times, step_time_s=sorted(times)[1], tokens_per_s=1.0, losses=[1.0] * 3,
                    device_busy_s=sum(k["time_s"] for k in kernels), kernels=kernels)  # fmt: skip

    result = turns_result([
        row(None, [0.071, 0.073, 0.072], [dict(kernel="_moe_down_fwd_kernel", calls=8, time_s=0.0037)]),
        row("moe_down_fwd.tma=true", [0.070, 0.0705, 0.069], [dict(kernel="_moe_down_fwd_kernel", calls=8,
                                                                    time_s=0.0034)]),
    ], steps_per_turn=1, complete=True)  # fmt: skip
    asked = []
    monkeypatch.setattr(launch_turns, "compare_launches", lambda job, launches, rounds, **k: asked.append(
        (job.name, launches, rounds)) or result)  # fmt: skip
    out = tmp_path / "turns.json"
    args = ["tiny", "--compare-launch", "moe_down_fwd.tma=true", "--steps", "3", "--json", str(out)]
    printed = runner.invoke(app, args)
    assert printed.exit_code == 0, printed.output
    assert asked == [("tiny", ["moe_down_fwd.tma=true"], 3)]
    assert json.loads(out.read_text()) == result
    lines = printed.stdout
    assert "tiny: 3 rounds of 1 timed steps a launch, in turns; NVIDIA H100 80GB HBM3, commit abc1234" in lines
    assert "72.00" in lines and "70.00" in lines and "0.972x" in lines
    assert "_moe_down_fwd_kernel: 3.700 -> 3.400 (-0.300)" in lines


@pytest.mark.parametrize("option, target", [("--json", "data.jsonl"), ("--plot", "run/adapter/steps.png"),
                                            ("--json", "saved/config.json")])  # fmt: skip
def test_an_output_over_what_the_profile_reads_or_its_run_keeps_is_one_line_exit_2(monkeypatch, tmp_path, option,
                                                                                   target):
    """The data file, a file a run keeps in output.dir, a file of the --load-checkpoint folder: refused before any
    step runs, the files as they were."""

    def no_steps(*args, **kwargs):
        raise AssertionError("the steps ran")

    monkeypatch.setattr("moe_tune.engine.bench.steps.profile_steps", no_steps)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "a document"}) + "\n")
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.json").write_text("{}")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    out = tmp_path / target
    loading = ["--load-checkpoint", str(tmp_path / "saved")] if target.startswith("saved/") else []
    steps = [] if loading else TINY_STEPS
    result = runner.invoke(app, ["tiny", *steps, *loading, "--set", f"data.path={data}", "--set",
                                 f"output.dir={tmp_path / 'run'}", option, str(out)])  # fmt: skip
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    if target.startswith("run/"):
        assert line == (f"error: {option} ({str(out)!r}) lies in the run's {str(tmp_path / 'run' / 'adapter')!r} "
                        "(output.dir): it would replace what a run keeps there; name a file elsewhere")
    else:
        field, read = ("data.path", data) if target == "data.jsonl" else ("--load-checkpoint", tmp_path / "saved")
        assert line == (f"error: {option} ({str(out)!r}) would overwrite what {field} ({str(read)!r}) reads; "
                        "name a file elsewhere")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_the_os_refuses_is_refused_before_any_step(monkeypatch, option):
    """/proc takes no new file even where permissions say root may write: refused before the steps, not after."""

    def no_steps(*args, **kwargs):
        raise AssertionError("the steps ran")

    monkeypatch.setattr("moe_tune.engine.bench.steps.profile_steps", no_steps)
    out = "/proc/moe-tune-steps." + ("json" if option == "--json" else "png")
    result = runner.invoke(app, ["tiny", *TINY_STEPS, option, out])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {option} ({out!r}): no file can be created in '/proc' (")
