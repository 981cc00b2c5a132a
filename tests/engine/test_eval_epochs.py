"""Evaluation on held-out rows and epoch-based schedules: the eval loss equals a hand computation, is reported in
metrics.jsonl and summary.json, the best checkpoint by eval loss survives pruning and resumes, train.epochs derives
the step count from the packed rows, and a run stopped mid-epoch resumes onto the same losses bit for bit."""

import json
import math
from pathlib import Path

import pytest
import torch

from moe_tune.engine.data import dataset as data_module
from moe_tune.engine.data.dataset import IGNORE_INDEX, PackedDataset, collate, load_documents, pack_rows, text_document
from moe_tune.engine.data.tokenizer import load_tokenizer
from moe_tune.engine.lora import load_adapter
from moe_tune.engine.model.model import build_model
from moe_tune.engine.train import trainer
from moe_tune.engine.train.checkpoint import best_checkpoint, checkpoint_name, complete_checkpoints, save_checkpoint
from moe_tune.engine.train.distributed import DistInfo
from moe_tune.engine.train.graphs import moe_blocks
from moe_tune.profiles import ProfileError, load_profile

TOK = load_tokenizer("byte")
# 3 documents of about 117 tokens pack into 7 rows of 56 a epoch; 1 row a micro-batch, 2 micro-batches a step: an
# epoch is 3.5 steps, so step 4 takes the last row of epoch 0 and the first of epoch 1.
SMALL = ["data.seq_len=56", "data.corpus_documents=3", "train.micro_batch_size=1", "train.gradient_accumulation_steps=2",
         "train.steps=null", "train.epochs=2", "train.warmup_steps=1"]
EVAL_TEXTS = [f"held-out line {i}: the quick brown fox" for i in range(4)]


CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def eval_documents():
    return [text_document(text, TOK) for text in EVAL_TEXTS]


def write_eval_file(folder):
    path = folder / "eval.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in EVAL_TEXTS))
    return path


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    return write_eval_file(tmp_path_factory.mktemp("data"))


def profile_at(out, eval_path, *extra):
    return load_profile("tiny", [*SMALL, f"output.dir={out}", f"data.eval_path={eval_path}", *extra])


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, eval_file):
    """Two epochs (7 steps) in one go, evaluations every 4 steps and after the last."""
    out = tmp_path_factory.mktemp("straight")
    profile = profile_at(out, eval_file, "train.eval_every=4")
    return out, profile, trainer.finetune(profile, show_progress=False)


# Constructed eval losses by step: the best (step 2) is older than every checkpoint keep_last would keep.
CONSTRUCTED = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 2.0, 6: 6.0, 7: 7.0}


@pytest.fixture(scope="module")
def split(tmp_path_factory, eval_file):
    """The same run stopped after step 5 (mid-epoch 1) and resumed, evaluating every step with constructed losses,
    a checkpoint every step and keep_last 1."""
    out = tmp_path_factory.mktemp("split")
    profile = profile_at(out, eval_file, "train.eval_every=1", "output.save_every=1", "output.keep_last=1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "evaluate", lambda engine, data, train, dist: (CONSTRUCTED[engine.global_steps], 10, 1))
        first = trainer.finetune(profile, show_progress=False, stop_after=5)
        kept_first = [p.name for p in complete_checkpoints(out / "checkpoints")]
        second = trainer.finetune(profile, show_progress=False, resume=True)
    return out, first, kept_first, second


def hand_eval_loss(profile, adapter_dir):
    """The trained model (base + adapter, one process, no DeepSpeed) over the eval rows with plain cross-entropy."""
    model = load_adapter(build_model(profile.model), adapter_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in pack_rows(eval_documents(), profile.data.seq_len, TOK.pad_id):
            batch = collate([row])
            logits = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens).logits
            labels = batch.labels.reshape(-1)
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), labels,
                                                       ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((labels != IGNORE_INDEX).sum())
    return total / count


def test_eval_loss_equals_a_hand_computation(straight):
    _, profile, result = straight
    assert result.eval_step == 7
    assert result.eval_loss == pytest.approx(hand_eval_loss(profile, result.adapter), rel=1e-5)


def test_eval_records_in_metrics_and_summary(straight):
    out, _, result = straight
    records = read_metrics(out)
    evals = [r for r in records if "eval_loss" in r]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7]
    # Every eval_every steps and after the last step.
    assert [r["step"] for r in evals] == [4, 7]
    rows = len(pack_rows(eval_documents(), 56, TOK.pad_id))
    labelled = sum(len(d.labels) for d in eval_documents())
    for record in evals:
        assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]))
        assert record["eval_tokens"] == labelled and record["eval_batches"] == rows
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss"] == evals[-1]["eval_loss"] and summary["eval_step"] == 7
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    best = min(evals, key=lambda r: r["eval_loss"])
    assert (summary["best_eval_loss"], summary["best_eval_step"]) == (best["eval_loss"], best["step"])
    assert summary["total_steps"] == 7 and summary["epochs"] == 2 and summary["eval_rows"] == rows
    # Epochs done after each step: 2 rows a step, 7 rows an epoch.
    assert [r["epoch"] for r in steps] == pytest.approx([2 / 7, 4 / 7, 6 / 7, 8 / 7, 10 / 7, 12 / 7, 2.0], abs=1e-6)


def test_epochs_derive_the_step_count():
    profile = load_profile("tiny", [*SMALL, "output.dir=unused"])
    dataset = PackedDataset(load_documents(profile.data, TOK), 56, TOK.pad_id, profile.data.seed)
    # By hand: each epoch's shuffle packed, the rows of both epochs over 2 rows a step (1 row x 2 micro-batches).
    import random

    rows = 0
    for epoch in range(2):
        order = list(range(len(dataset.documents)))
        random.Random(profile.data.seed + epoch).shuffle(order)
        rows += len(pack_rows([dataset.documents[i] for i in order], 56, TOK.pad_id))
    assert trainer.run_steps(profile.train, dataset, world_size=1) == math.ceil(rows / 2) == 7
    assert trainer.run_steps(profile.train, dataset, world_size=2) == math.ceil(rows / 4)
    one = load_profile("tiny", [*SMALL, "train.epochs=1", "train.gradient_accumulation_steps=3", "output.dir=x"])
    assert trainer.run_steps(one.train, dataset, world_size=1) == math.ceil(dataset.epoch_length(0) / 3)
    # train.steps profiles keep their steps whatever the data.
    steps = load_profile("tiny", ["train.steps=11", "train.warmup_steps=1", "output.dir=x"])
    assert trainer.run_steps(steps.train, dataset, world_size=4) == 11
    # warmup_ratio: a share of the derived steps.
    ratio = load_profile("tiny", [*SMALL, "train.warmup_steps=0", "train.warmup_ratio=0.3", "output.dir=x"])
    assert trainer.warmup_steps_of(ratio.train, 7) == 2
    assert trainer.lr_factor(0, ratio.train, 7) == 0.5 and trainer.lr_factor(1, ratio.train, 7) == 1.0


@pytest.mark.parametrize("overrides, message", [
    (["train.steps=10", "train.epochs=2"], r"train\.steps \(10\) and train\.epochs \(2\): set exactly one of them"),
    (["train.steps=null"], r"train\.steps \(None\) and train\.epochs \(None\): set exactly one of them"),
    (["train.steps=null", "train.epochs=0"], r"train\.epochs"),
    (["train.warmup_steps=2", "train.warmup_ratio=0.1"],
     r"train\.warmup_ratio \(0\.1\) and train\.warmup_steps \(2\): set at most one of them"),
    (["train.warmup_ratio=1.0"], r"train\.warmup_ratio"),
    (["train.eval_every=0"], r"train\.eval_every"),
    (["train.eval_batches=0"], r"train\.eval_batches"),
])
def test_schedule_fields_are_refused(overrides, message):
    with pytest.raises(ProfileError, match=message):
        load_profile("tiny", overrides)


@pytest.mark.parametrize("warmup", [7, 8])
def test_warmup_longer_than_the_derived_steps_is_refused(warmup):
    profile = load_profile("tiny", [*SMALL, f"train.warmup_steps={warmup}", "output.dir=x"])
    dataset = PackedDataset(load_documents(profile.data, TOK), 56, TOK.pad_id, profile.data.seed)
    with pytest.raises(ProfileError, match=rf"train\.warmup_steps \({warmup}\) must be < the 7 steps that "
                                           r"train\.epochs \(2\) gives \(14 rows / 2 rows a step"):
        trainer.run_steps(profile.train, dataset, world_size=1)


def test_resume_mid_epoch_equals_the_uninterrupted_run(straight, split):
    _, _, reference = straight
    _, first, _, second = split
    assert first.last_step == 5 and second.start_step == 5
    # Bit for bit: the rows of every step, the lr schedule over the derived steps and the RNG are replayed.
    assert first.losses + second.losses == reference.losses


def test_best_checkpoint_survives_pruning_and_resume(split):
    out, first, kept_first, second = split
    best = checkpoint_name(2)
    # keep_last 1 keeps the newest and the best (by eval loss), in the first part and after the resume.
    assert kept_first == [best, checkpoint_name(5)]
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == [best, checkpoint_name(7)]
    assert first.best_checkpoint.name == best and second.best_checkpoint.name == best
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["best_eval_loss"], summary["best_eval_step"]) == (1.0, 2)
    assert (summary["eval_loss"], summary["eval_step"]) == (7.0, 7)
    assert summary["best_checkpoint"].endswith(best)
    # One eval record per step, as one uninterrupted run writes them.
    evals = [(r["step"], r["eval_loss"]) for r in read_metrics(out) if "eval_loss" in r]
    assert evals == sorted(CONSTRUCTED.items())


class FakeEngine:
    """What save_checkpoint needs of a DeepSpeed engine: a save_checkpoint that writes a file."""

    device = "cpu"

    def save_checkpoint(self, directory, tag, save_latest):
        (Path(directory) / tag).mkdir(parents=True)
        (Path(directory) / tag / "weights.pt").write_bytes(b"w")



@pytest.mark.parametrize("losses, keep_last, kept", [
    ([2.0, 1.0, 3.0, 4.0], 1, [2, 4]),  # the best is old: kept beside the newest
    ([2.0, 1.0, 3.0, 4.0], 2, [2, 3, 4]),
    ([4.0, 3.0, 2.0, 1.0], 1, [4]),  # the best is the newest: nothing more is kept
    ([None, None, None, None], 1, [4]),  # no eval: plain keep_last
    ([1.0, None, None, None], 2, [1, 3, 4]),
    ([1.0, 1.0, None, None], 1, [1, 4]),  # equal losses: the earliest is the best
])
def test_pruning_keeps_the_best_checkpoint(tmp_path, losses, keep_last, kept):
    root = tmp_path / "checkpoints"
    for step, loss in enumerate(losses, start=1):
        save_checkpoint(FakeEngine(), root, step, {"step": step, "eval_loss": loss}, keep_last, is_main=True)
    assert [p.name for p in complete_checkpoints(root)] == [checkpoint_name(s) for s in kept]
    best = best_checkpoint(root, len(losses))
    finite = [(loss, step) for step, loss in enumerate(losses, start=1) if loss is not None]
    assert (best[0].name if best else None) == (checkpoint_name(min(finite)[1]) if finite else None)


class PlainEngine:
    """A plain model called as trainer.evaluate calls a DeepSpeed engine."""

    def __init__(self, model):
        self.module = model

    def eval(self):
        self.module.eval()

    def train(self, mode=True):
        self.module.train(mode)

    def __call__(self, **kwargs):
        return self.module(**kwargs)


@pytest.fixture(scope="module")
def plain_model():
    """The tiny model in one process, and each eval row's summed cross-entropy and labelled tokens by hand."""
    torch.manual_seed(0)
    model = build_model(load_profile("tiny", SMALL).model).eval()
    per_row = []
    with torch.no_grad():
        for row in pack_rows(eval_documents(), 56, TOK.pad_id):
            batch = collate([row])
            logits = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens).logits
            loss = torch.nn.functional.cross_entropy(logits[0].double(), batch.labels[0], reduction="sum").item()
            per_row.append((loss, batch.num_label_tokens))
    return model, per_row


@pytest.mark.parametrize("rows_per_rank, eval_batches", [
    (1, None),
    (2, None),  # the last micro-batch holds an empty row
    (2, 1),
    (1, 50),  # more than there are: all
])
def test_evaluate_reads_the_first_eval_batches(plain_model, rows_per_rank, eval_batches):
    model, per_row = plain_model
    profile = load_profile("tiny", [*SMALL, f"train.micro_batch_size={rows_per_rank}",
                                    *([f"train.eval_batches={eval_batches}"] if eval_batches else [])])
    data = PackedDataset(eval_documents(), 56, TOK.pad_id, seed=0, shuffle=False)
    model.train()
    loss, tokens, batches = trainer.evaluate(PlainEngine(model), data, profile.train, CPU)
    assert model.training  # the training mode is restored
    model.eval()
    expected_batches = math.ceil(len(per_row) / rows_per_rank)
    expected_batches = min(expected_batches, eval_batches or expected_batches)
    read = per_row[: expected_batches * rows_per_rank]
    assert batches == expected_batches
    assert tokens == sum(count for _, count in read)
    assert loss == pytest.approx(sum(total for total, _ in read) / tokens, rel=1e-5)
    # No expert loads counted, no capacity drops left for the selection-bias update.
    for block in moe_blocks(model):
        assert not block.load_counts.any() and not block.dropped_slots.any()


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("rows_per_rank", [1, 2])
def test_eval_micro_batches_hold_each_row_once(world_size, rows_per_rank):
    data = PackedDataset(eval_documents(), 56, TOK.pad_id, seed=0, shuffle=False)
    rows = data.rows_of_epoch(0)
    assert data.rows_of_epoch(0) is rows and PackedDataset(eval_documents(), 56, TOK.pad_id, 5, shuffle=False)\
        .rows_of_epoch(3) == rows  # never shuffled, whatever the seed or epoch
    num_batches = math.ceil(len(rows) / (world_size * rows_per_rank))
    seen = []
    for index in range(num_batches):
        for rank in range(world_size):
            batch = data.eval_micro_batch(index, rows_per_rank, rank, world_size)
            assert batch.input_ids.shape == (1, rows_per_rank * 56)
            for r in range(rows_per_rank):
                ids = batch.input_ids[0, r * 56:(r + 1) * 56].tolist()
                labels = batch.labels[0, r * 56:(r + 1) * 56].tolist()
                if all(label == IGNORE_INDEX for label in labels):
                    assert ids == [TOK.pad_id] * 56  # an empty row past the end
                else:
                    seen.append(ids)
    assert seen == [row.input_ids for row in rows]


def test_eval_without_labelled_tokens_is_refused():
    profile = load_profile("tiny", [*SMALL])
    masked = [data_module.Document(d.input_ids, [IGNORE_INDEX] * len(d.labels)) for d in eval_documents()]
    data = PackedDataset(masked, 56, TOK.pad_id, seed=0, shuffle=False)
    with pytest.raises(ProfileError, match=r"^data: the eval rows hold no token to evaluate"):
        trainer.check_eval_tokens(data, profile.train, world_size=1)


@pytest.mark.dist
def test_eval_on_two_ranks_equals_one_process(tmp_path, child_env):
    """ZeRO-3 and expert parallel 2 on 2 gloo ranks, the eval rows odd in number (rank 1 runs an empty row last):
    the same eval loss as one process on the same rows."""
    from test_distributed import Forks

    from moe_tune.engine.parallel.launch import rank_env, rendezvous

    assert len(pack_rows(eval_documents(), 56, TOK.pad_id)) % 2 == 1
    base = [*SMALL, "train.steps=1", "train.epochs=null", "train.warmup_steps=0", "model.moe.aux_loss_coef=0",
            "train.gradient_accumulation_steps=1", f"data.eval_path={write_eval_file(tmp_path)}"]
    summaries = []
    forks = Forks(child_env)
    try:
        for world, overrides in ((1, ["train.micro_batch_size=2"]),
                                 (2, ["train.micro_batch_size=1", "parallel.expert_parallel=2"])):
            out = tmp_path / f"world{world}"
            logs = [tmp_path / f"world{world}-rank{r}.log" for r in range(world)]
            args = ["--result", str(tmp_path / f"world{world}.json"),
                    *[a for o in [*base, *overrides, f"output.dir={out}"] for a in ("--set", o)]]
            with rendezvous() as port:
                codes = forks.run([rank_env(r, world, port, child_env) for r in range(world)], args, logs)
            assert codes == [0] * world, logs[0].read_text()[-3000:]
            summaries.append(json.loads((out / "summary.json").read_text()))
    finally:
        forks.close()
    one, two = summaries
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5, abs=1e-6)
    assert two["eval_step"] == one["eval_step"] == 1


@pytest.mark.parametrize("overrides, has_eval, interval, notes", [
    ([], False, None, []),
    (["train.eval_every=5", "train.eval_batches=2"], False, None,
     ["note: train.eval_every (5) is ignored: there is no eval data (data.eval_path or data.eval_fraction)",
      "note: train.eval_batches (2) is ignored: there is no eval data (data.eval_path or data.eval_fraction)"]),
    ([], True, 100, []),  # by default every checkpoint (output.save_every) has its eval
    (["train.eval_every=25"], True, 25, []),
    (["train.eval_every=30"], True, 30,
     ["note: train.eval_every (30) does not divide output.save_every (100): checkpoints at steps without an eval "
      "cannot be kept as the best"]),
])
def test_eval_interval_and_notes(overrides, has_eval, interval, notes):
    profile = load_profile("tiny", ["output.save_every=100", *overrides])
    eval_data = PackedDataset(eval_documents(), 56, TOK.pad_id, seed=0, shuffle=False) if has_eval else None
    assert trainer.eval_interval(profile, eval_data) == interval
    assert trainer.eval_notes(profile, eval_data) == notes


def test_processed_tokens_and_the_model_card(straight, tmp_path):
    """metrics.jsonl's processed tokens are the step's rows counted by hand (every position but a row's closing
    padding), and the adapter's model card names the data sources, the steps and summary.json's final loss."""
    out, profile, _ = straight
    dataset, _, data_summary, _ = trainer.build_dataset(profile, TOK, tmp_path)
    steps = [r for r in read_metrics(out) if "loss" in r]
    for record in steps:
        rows = [dataset.row((record["step"] - 1) * 2 + i) for i in range(2)]
        hand = 0
        for row in rows:
            tail = slice(row.starts[-1], None)
            is_padding = set(row.input_ids[tail]) == {TOK.pad_id} and set(row.labels[tail]) == {IGNORE_INDEX}
            hand += row.starts[-1] if is_padding else len(row.input_ids)
        assert record["processed_tokens"] == hand, record["step"]
        assert record["processed_tokens_per_s"] == pytest.approx(hand / record["step_time_s"], rel=1e-9)
    # 7 steps of 2 rows are the two epochs' 14 rows: every document's tokens twice, the padding not at all.
    assert sum(r["processed_tokens"] for r in steps) == 2 * sum(len(d.input_ids) for d in dataset.documents)
    assert sum(r["processed_tokens"] for r in steps) < 14 * 56
    summary = json.loads((out / "summary.json").read_text())
    card = (out / "adapter" / "README.md").read_text().splitlines()
    data_lines = card[card.index("## Data") + 2:][:len(data_summary.lines())]
    assert data_lines == [f"- {line}" for line in data_summary.lines()]
    assert any("built-in corpus (stories)" in line for line in card)
    assert any(str(profile.data.eval_path) in line for line in card)
    assert f"- steps: {summary['last_step']} of {summary['total_steps']} (2 epochs)" in card
    assert summary["last_step"] == 7
    assert any(line.startswith(f"- final train loss: {summary['final_loss']:.4f} (perplexity ") for line in card)
