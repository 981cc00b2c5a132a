"""The plain progress lines of finetune (stdout not a terminal): the ETA counts the mean time of the steps after the
first this process ran, so that one slow step moves it by its share."""

import io
import re

import pytest
from rich.console import Console

from moe_tune.engine.train.metrics import ProgressReporter


def etas(step_times: list[float], total: int, start: int = 0) -> list[int]:
    out = io.StringIO()
    reporter = ProgressReporter(total, start, log_every=1, enabled=True, console=Console(file=out, width=200))
    for step, seconds in enumerate(step_times, start=start + 1):
        reporter.update({"step": step, "loss": 1.0, "lr": 1e-3, "step_time_s": seconds, "tokens_per_s": 1.0,
                         "processed_tokens_per_s": 1.0, "tokens": 1, "processed_tokens": 1})
    return [int(m) for m in re.findall(r"ETA (\d+)s", out.getvalue())]


def test_one_slow_step_moves_the_eta_by_its_share():
    # 100 steps: the first (warm-up) 20 s, then 1 s a step but one of 51 s at step 4.
    assert etas([20, 1, 1, 51, 1], 100) == [99 * 20, 98 * 1, 97 * 1, round(96 * 53 / 3), round(95 * 54 / 4)]


@pytest.mark.parametrize("start", [0, 40])
def test_the_first_step_of_the_process_counts_alone_until_a_second_comes(start):
    # A resumed run's first step in this process warms up as a fresh one does.
    assert etas([7, 2], 100, start) == [(100 - start - 1) * 7, (100 - start - 2) * 2]
