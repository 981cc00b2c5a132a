"""Starts the ranks of tests/engine/test_distributed.py's runs by fork, from one process that imported torch,
DeepSpeed and moe-tune once: each rank would otherwise spend seconds of CI's two cores importing them.

    python tests/engine/dist_forks.py   (one JSON request per line on stdin)

A request {"envs": [rank r's environment, ...], "args": [dist_worker's arguments], "logs": [rank r's log, ...]}
forks one child per rank, which runs dist_worker.main(args) in exactly its environment, its stdout and stderr going
to its log; once every child has ended, the answer is one line {"codes": [rank r's exit code, ...]} (negative:
killed by that signal). This process runs no torch op, so the children start clean.
"""

import atexit
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

# What a run imports on its way, imported once here and shared by every forked rank.
for module in ("deepspeed", "peft", "torch._dynamo", "torch._inductor.compile_fx",
               "deepspeed.runtime.zero.muon.original_muon", "moe_tune.engine.lora", "moe_tune.engine.lora.experts",
               "moe_tune.engine.model.model", "moe_tune.engine.data.dataset", "moe_tune.engine.memory",
               "moe_tune.engine.train.trainer", "moe_tune.engine.export.sources", "dist_worker"):  # fmt: skip
    importlib.import_module(module)

import dist_worker  # noqa: E402
import torch  # noqa: E402


def run_rank(env: dict[str, str], args: list[str], log: str) -> None:
    """In the forked child: become rank `env["RANK"]` and never return."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        null, out = os.open(os.devnull, os.O_RDONLY), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        # One intra-op thread per rank: up to four ranks share CI's two cores.
        torch.set_num_threads(1)
        dist_worker.main(args)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pids = []
        for env, log in zip(request["envs"], request["logs"], strict=True):
            pid = os.fork()
            if pid == 0:
                run_rank(env, request["args"], log)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps({"codes": codes}), flush=True)


if __name__ == "__main__":
    main()
