"""A step that leaves a trainable weight inf or NaN stops the run before it is checkpointed, naming the parameter
and the last checkpoint that is truly intact (engine/train/trainer.py: check_finite_weights)."""

import json

import pytest
import torch

import moe_tune.engine.train.trainer as trainer
from moe_tune.engine.train.checkpoint import checkpoint_name, complete_checkpoints
from moe_tune.engine.train.distributed import DistInfo
from moe_tune.engine.train.trainer import TrainingDiverged, check_finite_weights, finetune, watched_weights
from moe_tune.profiles import load_profile

SMALL = ["data.seq_len=64", "train.micro_batch_size=2", "train.warmup_steps=0", "data.corpus_documents=200"]
ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def small_profile(out, *extra):
    return load_profile("tiny", [*SMALL, f"output.dir={out}", *extra])


def module_with(values_by_name):
    module = torch.nn.Module()
    for name, values in values_by_name.items():
        module.register_parameter(name, torch.nn.Parameter(torch.tensor(values, dtype=torch.float32)))
    return module


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_the_first_non_finite_parameter_is_named(bad, where):
    values = {"a": [1.0, 2.0], "b": [3.0, 4.0, 5.0], "c": [6.0]}
    names = list(values)
    # The parameter at `where` and every later one are bad: the first is named.
    for name in names[where:]:
        values[name][-1] = bad
    module = module_with(values)
    message = rf"^step 7: parameter {names[where]} is not finite after the optimizer step .*no checkpoint was written"
    with pytest.raises(TrainingDiverged, match=message + r"\); lower train.lr$"):
        check_finite_weights(7, watched_weights(module), ONE, None)


def test_large_finite_and_frozen_weights_pass():
    # 3e38 squared overflows fp32: an L2 norm would call these weights infinite.
    module = module_with({"big": [3e38, -3e38], "small": [1e-45, 0.0]})
    module.register_parameter("frozen", torch.nn.Parameter(torch.tensor([float("nan")]), requires_grad=False))
    check_finite_weights(1, watched_weights(module), ONE, None)


def test_zero3_partitions_are_read_up_to_their_padding():
    # A ZeRO-3 parameter as DeepSpeed leaves it: p.data empty, this rank's partition in ds_tensor, its tail beyond
    # ds_numel uninitialised padding (NaN here), which must not stop the run.
    module = module_with({"w": []})
    param = module.w
    param.ds_tensor = torch.tensor([1.0, 2.0, 3.0, float("nan")])
    param.ds_numel, param.ds_process_group = 3, None
    watched = watched_weights(module)
    assert watched == [("w", param, 3)]
    check_finite_weights(1, watched, ONE, None)
    param.ds_tensor[1] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"parameter w is not finite"):
        check_finite_weights(1, watched, ONE, None)


def poison_after(calls: int, monkeypatch):
    """micro_step that, on its `calls`-th call, leaves an inf in a LoRA weight as a diverging update would."""
    real = trainer.micro_step
    seen = []

    def poisoned(engine, batch, dist, denominator):
        out = real(engine, batch, dist, denominator)
        seen.append(1)
        if len(seen) == calls:
            name, param = next((n, p) for n, p in engine.module.named_parameters() if "lora_B" in n)
            with torch.no_grad():
                getattr(param, "ds_tensor", param).view(-1)[0] = float("inf")
            poisoned.name = name
        return out

    monkeypatch.setattr(trainer, "micro_step", poisoned)
    return poisoned


def test_a_resumed_run_names_the_checkpoint_it_resumed_from(tmp_path, monkeypatch):
    profile = small_profile(tmp_path, "train.steps=3", "output.save_every=1")
    finetune(profile, show_progress=False, stop_after=1)
    poisoned = poison_after(1, monkeypatch)
    intact = tmp_path / "checkpoints" / checkpoint_name(1)
    with pytest.raises(TrainingDiverged) as err:
        finetune(profile, show_progress=False, resume=True)
    assert str(err.value) == (
        f"step 2: parameter {poisoned.name} is not finite after the optimizer step (loss and gradient norm were): "
        f"training stopped before saving it (the last checkpoint, {intact}, is intact); lower train.lr"
    )
    assert complete_checkpoints(tmp_path / "checkpoints") == [intact]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
