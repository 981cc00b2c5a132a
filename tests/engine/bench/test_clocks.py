"""engine/bench/clocks.py: nvidia-smi's query lines parsed, summarized per part, and the sampler's life (a fake
nvidia-smi on the CPU: what it is asked, what the part keeps, a command that fails or is absent)."""

import stat
import sys
import threading

import pytest
import torch

from moe_tune.engine.bench import clocks
from moe_tune.engine.bench.clocks import ClockSample, ClockSampler, parse_sample, sampled_clocks, summarize


@pytest.mark.parametrize(("line", "expected"), [
    ("1980, 1980, 512.34, 700.00, 45\n", ClockSample(1980.0, 1980.0, 512.34, 700.0, 45.0)),
    ("1755,1980,699.9,700,71", ClockSample(1755.0, 1980.0, 699.9, 700.0, 71.0)),
    # A field the card does not report.
    ("1410, 1410, [N/A], [N/A], 38", ClockSample(1410.0, 1410.0, None, None, 38.0)),
    ("1410, [Not Supported], N/A, 400, 38", ClockSample(1410.0, None, None, 400.0, 38.0)),
    # Not a sample: a header, an error, another field count, a word where a number goes.
    ("clocks.current.sm [MHz], clocks.max.sm [MHz], power.draw [W], power.limit [W], temperature.gpu", None),
    ("No devices were found", None),
    ("1980, 1980, 512.34, 45", None),
    ("1980, 1980, 512.34, 700, 45, 3", None),
    ("1980, fast, 512.34, 700, 45", None),
])  # fmt: skip
def test_a_query_line_is_parsed_into_its_five_fields(line, expected):
    assert parse_sample(line) == expected


def test_a_part_is_summarized_by_medians_ranges_and_maxima():
    # The power limit: the lowest any sample reports (a limit lowered during the part holds the clocks after it).
    samples = [ClockSample(1980.0, 1980.0, 500.0, 700.0, 50.0), ClockSample(1755.0, 1980.0, 700.0, 400.0, 61.0),
               ClockSample(1800.0, 1980.0, None, None, 55.0), ClockSample(None, None, 600.0, 700.0, None)]  # fmt: skip
    assert summarize(samples) == dict(samples=4, sm_mhz=1800.0, sm_mhz_min=1755.0, sm_mhz_max=1980.0,
                                      max_sm_mhz=1980.0, power_w=600.0, power_limit_w=400.0,
                                      temperature_c=61.0)  # fmt: skip
    assert summarize([ClockSample(None, None, None, None, None)]) == dict(
        samples=1, sm_mhz=None, sm_mhz_min=None, sm_mhz_max=None, max_sm_mhz=None, power_w=None, power_limit_w=None,
        temperature_c=None,
    )
    assert summarize([]) is None


def fake_smi(tmp_path, lines=(), stop_lines=(), wait_for=None, then=(), exit_code=None):
    """A stand-in nvidia-smi: writes its arguments, prints `lines`, then (with `wait_for`) waits for that file and
    prints `then`, and loops until SIGINT, which prints `stop_lines`; or exits at once with `exit_code`. In Python, not
    bash: a shell cannot trap a signal its parent ignored (pytest-xdist's workers ignore SIGINT), a program can."""
    path = tmp_path / "nvidia-smi"
    path.write_text(f"""#!{sys.executable}
import pathlib, signal, sys, time
pathlib.Path({str(tmp_path / 'args')!r}).write_text(" ".join(sys.argv[1:]))
def stop(*_):
    for line in {list(stop_lines)!r}:
        print(line, flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
for line in {list(lines)!r}:
    print(line, flush=True)
if {exit_code!r} is not None:
    sys.exit({exit_code!r})
if {str(wait_for) if wait_for else None!r} is not None:
    while not pathlib.Path({str(wait_for) if wait_for else ''!r}).exists():
        time.sleep(0.02)
    for line in {list(then)!r}:
        print(line, flush=True)
while True:
    time.sleep(0.05)
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_sampler_keeps_what_comes_after_its_mark_and_what_the_stop_writes_out(tmp_path):
    # One sample before the part starts; two written as the loop stops on SIGINT (the stop and what it writes then
    # are the sampler's: a SIGTERM or SIGKILL would leave the part without samples).
    smi = fake_smi(tmp_path, lines=["1980, 1980, 100, 700, 30"],
                   stop_lines=["1410, 1980, 300.5, 700, 40", "1500, 1980, 350.5, 700, 45"])  # fmt: skip
    with ClockSampler("GPU-0123", command=str(smi)) as sampler:
        assert len(sampler.samples) == 1
    assert (tmp_path / "args").read_text().split() == [
        "--id=GPU-0123", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu",
        "--format=csv,noheader,nounits", f"--loop-ms={clocks.SAMPLE_MS}",
    ]  # fmt: skip
    assert sampler.summary == dict(samples=2, sm_mhz=1455.0, sm_mhz_min=1410.0, sm_mhz_max=1500.0,
                                   max_sm_mhz=1980.0, power_w=325.5, power_limit_w=700.0,
                                   temperature_c=45.0)  # fmt: skip


def test_a_mark_starts_the_part_at_the_samples_in_so_far(tmp_path):
    # A second sample once the test says so (a file appears), then the mark: only the stop's sample is the part's.
    go = tmp_path / "go"
    smi = fake_smi(tmp_path, lines=["1980, 1980, 100, 700, 30"], wait_for=go, then=["1900, 1980, 200, 700, 35"],
                   stop_lines=["1500, 1980, 350, 400, 45"])  # fmt: skip
    with ClockSampler("GPU-0", command=str(smi)) as sampler:
        go.touch()
        for _ in range(500):
            if len(sampler.samples) == 2:
                break
            threading.Event().wait(0.02)
        assert [sample.sm_mhz for sample in sampler.samples] == [1980.0, 1900.0]
        sampler.mark()
    assert sampler.summary == dict(samples=1, sm_mhz=1500.0, sm_mhz_min=1500.0, sm_mhz_max=1500.0,
                                   max_sm_mhz=1980.0, power_w=350.0, power_limit_w=400.0,
                                   temperature_c=45.0)  # fmt: skip


@pytest.mark.parametrize(("lines", "exit_code"), [(["No devices were found"], 6), ([], 0)], ids=["refused", "silent"])
def test_a_sampler_whose_command_ends_without_samples_sums_up_nothing(tmp_path, lines, exit_code):
    with ClockSampler("GPU-0", command=str(fake_smi(tmp_path, lines=lines, exit_code=exit_code))) as sampler:
        pass
    assert sampler.samples == [] and sampler.summary is None


def test_no_command_or_no_device_samples_nothing(tmp_path):
    with ClockSampler("GPU-0", command=str(tmp_path / "absent")) as sampler:
        pass
    assert sampler.summary is None
    with sampled_clocks(torch.device("cpu")) as sampler:
        pass
    assert sampler.gpu_id is None and sampler.summary is None
