"""Several gloo ranks on the CPU: ZeRO-3 for dense weights plus expert parallelism (and ZeRO-1 data parallelism)
equals one process on the same global batch (losses and trained weights), resumes exactly, and stops when a rank
dies."""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_tune.engine.parallel.launch import rank_env, rendezvous
from moe_tune.engine.train.trainer import check_world
from moe_tune.profiles import ProfileError, load_profile

FORKS = Path(__file__).with_name("dist_forks.py")
# Small rows, active clipping, no aux loss (a per-rank Switch loss is not the global one). Adam turns rounding-level
# gradient differences (ranks sum in other orders) into updates of size ~lr on parameters whose gradients are
# near zero (fresh LoRA A factors): a moderate lr keeps those below the 1e-5 that the comparison demands.
BASE = ["data.seq_len=64", "data.corpus_documents=200", "train.warmup_steps=1", "train.grad_clip=0.5",
        "model.moe.aux_loss_coef=0", "train.lr=0.002", "output.save_every=1000"]
HARD_TIMEOUT_S = 300


class Forks:
    """One dist_forks.py process, which forks the ranks of every run of this module (see its docstring)."""

    def __init__(self, env):
        self.proc = subprocess.Popen([sys.executable, str(FORKS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)  # fmt: skip

    def run(self, envs, args, logs):
        self.proc.stdin.write(json.dumps({"envs": envs, "args": args, "logs": [str(log) for log in logs]}) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], HARD_TIMEOUT_S)[0]:
            self.close()
            raise TimeoutError(f"the ranks did not end within {HARD_TIMEOUT_S} s")
        answer = self.proc.stdout.readline()
        assert answer, f"dist_forks.py ended with code {self.proc.wait()}"
        return json.loads(answer)["codes"]

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


forks: Forks | None = None


@pytest.fixture(scope="module", autouse=True)
def _close_forks():
    yield
    if forks is not None:
        forks.close()


def run_ranks(world, out, overrides, child_env, extra=(), base=BASE):
    global forks
    if forks is None or forks.proc.poll() is not None:
        forks = Forks(child_env)
    out.parent.mkdir(parents=True, exist_ok=True)
    result, logs = out / "result.json", [out.with_name(f"{out.name}-rank{r}.log") for r in range(world)]
    settings = [a for o in [*base, f"output.dir={out}", *overrides] for a in ("--set", o)]
    args = ["--result", str(result), *extra, *settings]
    codes = run_in_a_rendezvous(forks, world, child_env, args, logs)
    return codes, [log.read_text() for log in logs], (json.loads(result.read_text()) if result.exists() else None)


def run_in_a_rendezvous(forks, world, child_env, args, logs) -> list[int]:
    """The ranks' exit codes, their rendezvous in a store this process hosts (as launch_local's)."""
    with rendezvous() as port:
        return forks.run([rank_env(r, world, port, child_env) for r in range(world)], args, logs)


# Runs that several tests compare against, made once per module: (world, overrides) -> (codes, logs, result, out).
shared_runs = {}


def shared_run(world, overrides, child_env, tmp_path_factory):
    key = (world, tuple(overrides))
    if key not in shared_runs:
        out = tmp_path_factory.mktemp("shared") / "out"
        shared_runs[key] = (*run_ranks(world, out, overrides, child_env), out)
    return shared_runs[key]


def single_process(tmp_path_factory, child_env, rows, overrides):
    """The losses and output folder of one process training `rows` rows a step."""
    codes, logs, result, out = shared_run(1, [f"train.micro_batch_size={rows}", *overrides], child_env,
                                          tmp_path_factory)  # fmt: skip
    assert codes == [0], logs[0][-3000:]
    return result, out


def adapter(out):
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


LAYOUTS = [
    pytest.param(2, 2, [], id="ep2"),
    pytest.param(4, 4, [], id="ep4"),
    pytest.param(4, 2, ["parallel.offload_optimizer=true"], id="dp2xep2-offload"),
    # The benchmark profiles' stage on several ranks without expert parallelism (the profile rule refuses
    # expert_parallel > 1 below stage 3).
    pytest.param(2, 1, ["parallel.zero_stage=1"], id="dp2-zero1"),
]


@pytest.mark.dist
@pytest.mark.parametrize("world, ep, extra", LAYOUTS)
def test_expert_parallel_equals_one_process(tmp_path_factory, child_env, world, ep, extra):
    steps = ["train.steps=3", "output.save_merged=true"]
    # One process without the offload: dp2xep2-offload compares with ep4's, and the offloaded optimizer must agree.
    single_extra = [e for e in extra if not e.startswith("parallel.offload_optimizer")]
    single, single_out = single_process(tmp_path_factory, child_env, 2 * world, [*steps, *single_extra])
    multi_overrides = [*steps, *extra, "train.micro_batch_size=2", f"parallel.expert_parallel={ep}"]
    codes, logs, multi, out = shared_run(world, multi_overrides, child_env, tmp_path_factory)
    assert codes == [0] * world, logs[0][-3000:]
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)
    assert_grad_norms_equal(out, single_out, BASE)
    # The exported adapter is consolidated into the single-process layout (all experts) and equal to it. A LoRA A
    # factor's first updates follow gradients near 0 (B starts at 0) that Adam normalises: an element whose
    # gradient is rounding noise moves by up to the lr either way, so the A factors are compared through what they
    # do, the merged weights W + s B A, below.
    one, many = adapter(single_out), adapter(out)
    assert one.keys() == many.keys()
    assert any(".experts.lora_A.w_gate_up" in k for k in one)
    for key in one:
        if ".lora_A." not in key:
            torch.testing.assert_close(many[key], one[key], rtol=0, atol=1e-5, msg=key)
    one, many = (merged_weights(d) for d in (single_out, out))
    assert one.keys() == many.keys() and any(".experts.w_down" in k for k in one)
    for key in one:
        torch.testing.assert_close(many[key], one[key], rtol=0, atol=1e-5, msg=key)


def logged(out, key):
    """`key` of every step record in the run's metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [record[key] for record in records if "loss" in record]


def assert_grad_norms_equal(out, single_out, settings):
    """The logged gradient norms of a run equal one process's: the global norm before clipping, each expert's
    gradient counted once, whichever rank holds it. Clipping acts on every step (the norms exceed
    train.grad_clip), so a norm counted wrong would change the update too."""
    clip = float(next(s for s in settings if s.startswith("train.grad_clip=")).split("=")[1])
    one, many = logged(single_out, "grad_norm"), logged(out, "grad_norm")
    assert min(one) > clip
    assert many == pytest.approx(one, rel=1e-5)
    assert logged(out, "lr") == logged(single_out, "lr")


def merged_weights(out):
    """The run's weights with its adapter merged in (engine/export's merge, per tensor), in our names."""
    from moe_tune.engine.export.sources import FinalState, read_run

    with FinalState(read_run(out), merged=True) as source:
        return {name: source.read(name) for name in source.names()}


@pytest.mark.dist
def test_partitioned_lm_head_trains_as_in_one_process(tmp_path, tmp_path_factory, child_env):
    # A 2048-token vocabulary puts lm_head (2048 x 64) above ZeRO-3's persistence threshold: partitioned over the
    # ranks, so the chunked loss (ops/cross_entropy) reads, and trains, a gathered head weight outside the head's own
    # forward. The head is trained in full (modules_to_save): its gradients are not near zero, so Adam does not
    # magnify rounding there (the fresh LoRA A factors, compared in the test above, would need a smaller lr).
    overrides = ["train.steps=3", "model.vocab_size=2048"]
    single, single_out = single_process(tmp_path_factory, child_env, 4, overrides)
    out = tmp_path / "ep2"
    codes, logs, multi = run_ranks(
        2, out, [*overrides, "train.micro_batch_size=2", "parallel.expert_parallel=2"], child_env
    )
    assert codes == [0, 0], logs[0][-3000:]
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)
    one, many = adapter(single_out), adapter(out)
    heads = [key for key in one if "lm_head" in key]
    assert heads and all(one[key].shape[0] == 2048 for key in heads if key.endswith("weight"))
    for key in heads:
        torch.testing.assert_close(many[key], one[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.dist
def test_checkpoint_model_under_expert_parallel_equals_one_process(tmp_path, child_env):
    """A qwen3_moe checkpoint fine-tuned by 2 ranks (ZeRO-3, expert parallel 2): built partitioned (each rank holds
    half of every dense tensor, never the whole model), experts read per rank, and the same losses and adapter
    as one process."""
    from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe

    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(num_experts=6), tmp_path / "qwen3_moe")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} about experts {i * 3}"}) + "\n" for i in range(60)))
    profile = tmp_path / "profile.yaml"
    profile.write_text(json.dumps({
        "name": "ckpt-ep", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(data), "tokenizer": "byte", "seq_len": 48},
        "train": {"steps": 3, "lr": 0.002, "micro_batch_size": 2, "grad_clip": 0.5},
        "output": {"dir": str(tmp_path / "unused")},
    }))
    extra = ["--profile", str(profile)]
    codes, logs, single = run_ranks(1, tmp_path / "single", ["train.micro_batch_size=4"], child_env, extra, base=[])
    assert codes == [0], logs[0][-3000:]
    out = tmp_path / "ep2"
    codes, logs, multi = run_ranks(2, out, ["parallel.expert_parallel=2"], child_env, extra, base=[])
    assert codes == [0, 0], logs[0][-3000:]
    assert single["dense_share"] == 1.0 and multi["dense_share"] == pytest.approx(0.5, abs=0.01)
    assert multi["full_dense_tensors"] == 0
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)
    one, many = adapter(tmp_path / "single"), adapter(out)
    assert one.keys() == many.keys()
    for key in one:
        torch.testing.assert_close(many[key], one[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.dist
def test_images_on_one_rank_only(tmp_path, child_env):
    """tiny-vl on 2 ranks (ZeRO-3, expert parallel 2) where a step gives one rank an image row and the other a
    text row: nothing hangs (the tower runs on every rank) and the losses equal one process on the same rows."""
    import numpy as np
    from PIL import Image

    from moe_tune.engine.data.dataset import PackedDataset, load_documents, vision_input
    from moe_tune.engine.data.tokenizer import ByteTokenizer

    rng = np.random.default_rng(0)
    records = []
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        records.append({"messages": [{"role": "user", "content": "<image>name it"},
                                     {"role": "assistant", "content": f"thing {i}"}], "images": [f"{i}.png"]})
    records += [{"text": f"plain text number {i} here"} for i in range(14)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = ["train.steps=3", f"data.path={data}", "data.seq_len=96", "data.image_min_pixels=256",
                 "data.image_max_pixels=256", "train.warmup_steps=1", "train.grad_clip=0.5", "train.lr=0.002",
                 "model.moe.aux_loss_coef=0", "output.save_every=1000"]
    from moe_tune.profiles import load_profile

    job = load_profile("tiny-vl", overrides + ["output.dir=unused"])
    vision = vision_input(job.model, job.data)
    dataset = PackedDataset(load_documents(job.data, ByteTokenizer(), vision), 96, 258, job.data.seed, vision.settings)
    has_image = [[bool(dataset.row(2 * step + r).images) for r in range(2)] for step in range(3)]
    assert [True, False] in has_image or [False, True] in has_image, has_image
    extra = ["--profile", "tiny-vl"]
    codes, logs, single = run_ranks(1, tmp_path / "single", overrides + ["train.micro_batch_size=2"], child_env,
                                    extra, base=[])
    assert codes == [0], logs[0][-3000:]
    codes, logs, multi = run_ranks(2, tmp_path / "ep2", overrides + ["train.micro_batch_size=1",
                                                                     "parallel.expert_parallel=2"], child_env,
                                   extra, base=[])
    assert codes == [0, 0], logs[0][-3000:]
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.dist
def test_cli_nproc_launches_ranks(tmp_path, child_env):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", "tiny", "--nproc", "2", "--quiet",
         *[a for o in [*BASE, "train.steps=2", "train.micro_batch_size=1", "parallel.expert_parallel=2",
                       f"output.dir={out}"] for a in ("--set", o)]],
        # One intra-op thread a rank, as dist_forks.py gives the other runs' ranks.
        capture_output=True, text=True, timeout=HARD_TIMEOUT_S, env={**child_env, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Rank 0 alone reports; the run wrote one metrics record per step and a consolidated adapter.
    assert proc.stdout.count("trained steps 1-2") == 1
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.dist
def test_untagged_experts_train_wrong(tmp_path, tmp_path_factory, child_env):
    # The one-process run of test_expert_parallel_equals_one_process[ep2] (its merged export changes no loss).
    single, _ = single_process(tmp_path_factory, child_env, 4, ["train.steps=3", "output.save_merged=true"])
    codes, logs, multi = run_ranks(
        2, tmp_path / "untagged", ["train.steps=3", "train.micro_batch_size=2", "parallel.expert_parallel=2"],
        child_env, extra=["--untagged"],
    )
    # Without the tags ZeRO-3 treats different experts as one replicated tensor: training goes wrong (or fails).
    assert codes != [0, 0] or multi["losses"] != pytest.approx(single["losses"], rel=1e-4)


@pytest.mark.dist
def test_resume_under_expert_parallel(tmp_path, tmp_path_factory, child_env):
    # The straight run is test_expert_parallel_equals_one_process[ep2]'s; this one stops after 2 of its 3 steps.
    common = ["train.steps=3", "output.save_merged=true", "train.micro_batch_size=2", "parallel.expert_parallel=2"]
    codes, logs, straight, _ = shared_run(2, common, child_env, tmp_path_factory)
    assert codes == [0, 0], logs[0][-3000:]
    codes, logs, first = run_ranks(2, tmp_path / "b", common, child_env, extra=["--stop-after", "2"])
    assert codes == [0, 0], logs[0][-3000:]
    codes, logs, second = run_ranks(2, tmp_path / "b", common, child_env, extra=["--resume"])
    assert codes == [0, 0], logs[0][-3000:]
    assert second["start_step"] == 2
    assert first["losses"] + second["losses"] == straight["losses"]


@pytest.mark.dist
def test_dead_rank_stops_the_job(tmp_path, child_env):
    # Rank 1 dies abruptly after its first step; rank 0 must notice (gloo errors or parallel.timeout_s) and fail.
    started = time.time()
    codes, logs, _ = run_ranks(
        2, tmp_path / "dead", ["train.steps=50", "train.micro_batch_size=2", "parallel.expert_parallel=2",
                               "parallel.timeout_s=20"], child_env, extra=["--die-rank", "1"],
    )
    assert codes[1] == 9
    assert codes[0] != 0, "the surviving rank must not hang or report success"
    assert time.time() - started < HARD_TIMEOUT_S


def test_launcher_names_the_failed_rank(monkeypatch):
    from moe_tune.engine.parallel import launch

    class FakeProc:
        def __init__(self, code):
            self.returncode, self.code = None, code

        def poll(self):
            self.returncode = self.code if self.code is not None else self.returncode
            return self.returncode

        def terminate(self):
            self.code = -15

        def kill(self):
            self.code = -9

        send_signal = terminate

    procs = iter([FakeProc(None), FakeProc(3)])
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: next(procs))
    result = launch.launch_local(2, ["finetune", "tiny"])
    assert result.failed_rank == 1 and result.returncode == 3
    assert result.message == "rank 1 exited with code 3; the other ranks were stopped"


@pytest.mark.parametrize("ep, world, message", [
    (2, 1, r"parallel.expert_parallel \(2\) must be <= the world size \(1\)"),
    (2, 3, r"parallel.expert_parallel \(2\) must divide the world size \(3\)"),
])
def test_layout_must_fit_the_world(ep, world, message):
    with pytest.raises(ProfileError, match=message):
        check_world(load_profile("tiny", [f"parallel.expert_parallel={ep}"]), world)
