"""engine/bench/launch_sites.py: each dispatched op is counted at the Python frames that asked for it, metadata-only
ops are left out, autograd's own backward formulas are one frameless site, a Python autograd Function's backward is
its own site, and the sites are ranked by count."""

from pathlib import Path

import torch

from moe_tune.engine.bench import launch_sites as sites
from moe_tune.engine.bench.launch_sites import TOP_SITES, launch_sites, recorded_ops

# A frame's path is relative to the package root or site-packages (an installed package: the tests are under
# neither): frames are matched by the file's name.
THIS_FILE = "test_launch_sites.py"


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2  # <- twice forward

    @staticmethod
    def backward(ctx, grad):
        return grad.mul(2)  # <- twice backward


def _line_of(mark: str) -> int:
    """The line of this file that ends with the comment `# <- mark` (once)."""
    text = "# <- " + mark
    lines = [i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.endswith(text)]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def _site(frame: str) -> str:
    """`file:line (function)` of a frame text, the file's folders left out."""
    return frame.rsplit("/", 1)[-1]


def _step(x):
    y = _Twice.apply(x.view(-1).reshape(2, 3)).transpose(0, 1)
    loss = (y.exp() + 1.0).sum()  # <- forward
    loss.backward()


def test_ops_are_counted_at_their_frames_and_metadata_is_left_out():
    x = torch.randn(3, 2, requires_grad=True)
    with recorded_ops() as ops:
        _step(x)
    names = [op for op, _ in ops]
    assert not set(names) & sites.METADATA_OPS, names
    forward_line = f"{THIS_FILE}:{_line_of('forward')} (_step)"
    by_op = {op: frames for op, frames in ops if frames and _site(frames[0]) == forward_line}
    assert set(by_op) == {"exp", "add", "sum"}, ops
    # Called from the test: the next frame out is the test function's own.
    test_name = "test_ops_are_counted_at_their_frames_and_metadata_is_left_out"
    assert _site(by_op["exp"][1]).startswith(f"{THIS_FILE}:") and by_op["exp"][1].endswith(f"({test_name})")
    # The Function's forward and backward are sites of their own; the built-in formulas' ops have no frames.
    twice_forward = f"{THIS_FILE}:{_line_of('twice forward')} (forward)"
    twice_backward = f"{THIS_FILE}:{_line_of('twice backward')} (backward)"
    assert ("mul", twice_forward) in [(op, _site(frames[0])) for op, frames in ops if frames]
    backward_ops = [(op, frames) for op, frames in ops if frames and _site(frames[0]) == twice_backward]
    assert [(op, len(frames)) for op, frames in backward_ops] == [("mul", 1)], ops
    builtin = [op for op, frames in ops if not frames]
    assert "exp" not in builtin and "mul" in builtin, builtin  # exp's backward multiplies by its output
    torch.testing.assert_close(x.grad, 2 * (2 * x).exp())


def test_sites_are_ranked_by_count_first_seen_first_and_cut_at_the_top():
    ops = [("mm", ("a.py:1 (f)",)), ("add", ()), ("mm", ("a.py:1 (f)",)), ("mm", ("a.py:2 (f)",)), ("add", ())]
    assert launch_sites(ops) == [
        dict(count=2, op="mm", frames=["a.py:1 (f)"]),
        dict(count=2, op="add", frames=[]),
        dict(count=1, op="mm", frames=["a.py:2 (f)"]),
    ]
    many = [("mul", (f"a.py:{i} (f)",)) for i in range(TOP_SITES + 5) for _ in range(i + 1)]
    ranked = launch_sites(many)
    assert len(ranked) == TOP_SITES and ranked[0]["count"] == TOP_SITES + 5
    assert [row["count"] for row in ranked] == sorted((row["count"] for row in ranked), reverse=True)
