"""One rank of a multi-process test run, with the rendezvous variables set: run as a script (tests/engine/
test_export_zero.py) or forked by tests/engine/dist_forks.py (tests/engine/test_distributed.py). Trains `tiny` with
the given overrides and, on rank 0, writes the losses as JSON."""

import argparse
import json
import os

from moe_tune.profiles import load_profile

parser = argparse.ArgumentParser()
parser.add_argument("--result", required=True)
parser.add_argument("--profile", default="tiny")
parser.add_argument("--set", dest="overrides", action="append", default=[])
parser.add_argument("--stop-after", type=int, default=None)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--untagged", action="store_true", help="skip the expert tags (the test that they matter)")
parser.add_argument("--die-rank", type=int, default=None, help="this rank dies abruptly after its first step")
parser.add_argument("--profile-steps", type=int, default=None,
                    help="run this many steps of `moe-tune profile`'s step runner instead of training")  # fmt: skip


def profile_steps(args) -> None:
    """`moe-tune profile`'s step runner on this rank; rank 0 writes the steps' losses."""
    from moe_tune.engine.bench.steps import StepRunner

    runner = StepRunner(load_profile(args.profile, args.overrides))
    try:
        losses = [runner.step()["loss"] for _ in range(args.profile_steps)]
    finally:
        runner.close()
    if runner.dist.is_main:
        os.makedirs(os.path.dirname(args.result), exist_ok=True)  # the runner writes nothing to output.dir
        with open(args.result, "w") as f:
            json.dump({"losses": losses}, f)


def main(argv: list[str] | None = None) -> None:
    args = parser.parse_args(argv)
    if args.profile_steps is not None:
        profile_steps(args)
        return
    import moe_tune.engine.train.trainer as trainer

    if args.untagged:
        trainer.tag_expert_parameters = lambda model, layout: 0
    if args.die_rank is not None and int(os.environ["RANK"]) == args.die_rank:
        from moe_tune.engine.train import metrics

        def die(self, record):
            os._exit(9)

        metrics.ProgressReporter.update = die

    # The share of the dense weights this rank held right after a partitioned build (checkpoint models).
    held = {}
    build_partitioned = trainer.build_partitioned

    def recording_build(*a, **k):
        model = build_partitioned(*a, **k)
        dense = [p for p in model.parameters() if hasattr(p, "ds_id")]
        held["dense_share"] = sum(p.ds_tensor.numel() for p in dense) / sum(p.ds_numel for p in dense)
        held["full_dense_tensors"] = sum(p.numel() > 0 for p in dense)
        return model

    trainer.build_partitioned = recording_build
    result = trainer.finetune(load_profile(args.profile, args.overrides), show_progress=False,
                              stop_after=args.stop_after, resume=args.resume)  # fmt: skip
    if result.is_main:
        with open(args.result, "w") as f:
            json.dump({"losses": result.losses, "start_step": result.start_step, **held}, f)


if __name__ == "__main__":
    main()
