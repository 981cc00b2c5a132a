"""The GPU's SM clock, power draw and temperature while a part of a benchmark runs: nvidia-smi's query loop
(`--query-gpu ... --loop-ms`) read in the background, one summary per part (`profile PROFILE`'s `gpu_clocks`: its
timed steps, and the GEMM peak that divides MFU; docs/bench.md, "MFU").

The peak is a sustained 8192^3 GEMM, which runs at the clock the card's power and temperature allow at that moment;
a training step, tensor-core and memory-bound kernels in turn, may run at another. The two summaries say which clock
each ran at. Without CUDA or without nvidia-smi nothing is sampled and the summary is None.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import threading
from dataclasses import dataclass

import torch

# nvidia-smi's names of what a sample holds, in its order (power.limit: the draw the card holds its clocks under).
QUERY_FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu")
# 20 ms between samples: a handful over a 70 ms step's three timed repeats, while each sample costs the host one NVML
# query in another process.
SAMPLE_MS = 20
# A part starts once nvidia-smi's first sample is in (its start-up is not part of what is sampled), or after this.
FIRST_SAMPLE_TIMEOUT_S = 10.0
# After a part, how long nvidia-smi gets to exit on SIGINT (Ctrl+C: the stop its manual gives the loop) before it is
# killed; lines it writes as it stops are kept.
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ClockSample:
    """One nvidia-smi line; a field the card does not report ("[N/A]", "[Not Supported]") is None."""

    sm_mhz: float | None
    max_sm_mhz: float | None
    power_w: float | None
    power_limit_w: float | None
    temperature_c: float | None


def parse_sample(line: str) -> ClockSample | None:
    """One line of `--format=csv,noheader,nounits` output (`1980, 1980, 512.34, 700.00, 45`), or None for a line that
    is not one (a header, an error message, another field count)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != len(QUERY_FIELDS):
        return None
    values = []
    for field in fields:
        try:
            values.append(float(field))
        except ValueError:
            if not (field.startswith("[") or field == "N/A"):
                return None
            values.append(None)
    return ClockSample(*values)


def summarize(samples: list[ClockSample]) -> dict | None:
    """The samples of one part: the median SM clock with its range, the card's maximum SM clock, the median power
    draw, the lowest power limit and the highest temperature (None where no sample reports one); None without
    samples."""
    if not samples:
        return None

    def reported(name: str) -> list[float]:
        return [value for sample in samples if (value := getattr(sample, name)) is not None]

    sm, max_sm, power, limit, temperature = (
        reported(name) for name in ("sm_mhz", "max_sm_mhz", "power_w", "power_limit_w", "temperature_c")
    )
    return dict(
        samples=len(samples),
        sm_mhz=statistics.median(sm) if sm else None,
        sm_mhz_min=min(sm) if sm else None,
        sm_mhz_max=max(sm) if sm else None,
        max_sm_mhz=max(max_sm) if max_sm else None,
        power_w=statistics.median(power) if power else None,
        power_limit_w=min(limit) if limit else None,
        temperature_c=max(temperature) if temperature else None,
    )


def nvidia_smi_id(device: torch.device) -> str | None:
    """The id nvidia-smi knows `device` by (`GPU-<uuid>`, whatever CUDA_VISIBLE_DEVICES renumbers), or None for a
    device that is not CUDA or does not report its UUID."""
    if device.type != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


class ClockSampler:
    """`with ClockSampler(gpu_id) as sampler:` samples the GPU while the block runs; `sampler.mark()` starts the part
    the summary covers (else the whole block); after the block, `sampler.summary` (None when nothing was sampled:
    no such command, a refused id). Never raises for the sampling itself."""

    def __init__(self, gpu_id: str | None, command: str = "nvidia-smi", interval_ms: int = SAMPLE_MS):
        self.gpu_id = gpu_id
        self.command = command
        self.interval_ms = interval_ms
        self.samples: list[ClockSample] = []
        self.summary: dict | None = None
        self._start = 0
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._first = threading.Event()

    def mark(self) -> None:
        """From here on is the part the summary covers."""
        self._start = len(self.samples)

    def __enter__(self) -> ClockSampler:
        if self.gpu_id is None or shutil.which(self.command) is None:
            return self
        args = [self.command, f"--id={self.gpu_id}", f"--query-gpu={','.join(QUERY_FIELDS)}",
                "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}"]  # fmt: skip
        try:
            self._process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._first.wait(FIRST_SAMPLE_TIMEOUT_S)
        self.mark()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            if (sample := parse_sample(line)) is not None:
                self.samples.append(sample)
                self._first.set()
        # The command ended (refused, or stopped): nothing more will come.
        self._first.set()

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGINT)
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._reader.join()
        self.summary = summarize(self.samples[self._start :])


def sampled_clocks(device: torch.device) -> ClockSampler:
    """A sampler of `device` (idle, summary None, where it is not a CUDA device nvidia-smi can name)."""
    return ClockSampler(nvidia_smi_id(device))
