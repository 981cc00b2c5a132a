"""The linear-attention kernels of one training call compiled for the H200 (sm_90) on any machine, no GPU needed: per
kernel, its registers, stack and spills (ptxas -v), shared memory, and the asynchronous copies and warpgroup MMAs in
its PTX. What a launch candidate does to a kernel's register pressure and pipelining, before a device times it
(docs/bench.md, "Kernels compiled for sm_90, without a GPU").

    python -m moe_tune.engine.bench.kernel_compile [--ops gdn,kda] [--dtype bf16|fp16|fp32] [--head-dims K,V]
        [--kernels NAME[,NAME...]] [--candidate FIELD=VALUE[,FIELD=VALUE...] ...] [--json OUT]

The call: one row of CALL_TOKENS tokens (three chunks), CALL_HEADS heads, the forward and backward as the model calls
it (the L2 norm in the kernels, the forward's passes kept for backward), with every `_*_kernel` of
ops/linear_attention recorded instead of launched, under pick_config's GPU launch and, for each candidate, its fields
over that launch. Each distinct launch (kernel, argument specialization, constexprs, warps, stages) is compiled once.
Needs Triton's compiler internals and the ptxas its NVIDIA backend bundles, and a process without TRITON_INTERPRET
(under the interpreter @triton.jit builds interpreted functions, which Triton cannot compile).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moe_tune.engine.bench.arguments import OneLineParser
from moe_tune.engine.bench.linear_attention_sweep import OPS, parse_candidate, parse_ops
from moe_tune.engine.train.checkpoint import write_json_atomic

# sm_90 (Hopper: the H100 and the H200), 32 threads a warp.
TARGET_ARCH = 90
WARP_SIZE = 32
# Three chunks (the last one partial) and a few heads: every kernel launches, and compiling does not depend on T or H.
CALL_TOKENS = 130
CALL_HEADS = 4
HEAD_DIMS = (128, 128)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# ptxas -v's lines for one entry function.
PTXAS_STACK = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<spill_stores>\d+) bytes spill stores, "
                         r"(?P<spill_loads>\d+) bytes spill loads")  # fmt: skip
PTXAS_REGISTERS = re.compile(r"Used (?P<registers>\d+) registers")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the JITFunction and the arguments it was called with."""

    name: str
    fn: Any
    args: tuple
    kwargs: dict


class CompileError(RuntimeError):
    """This Triton cannot compile for sm_90 here (no compiler internals, no ptxas, or the interpreter is on)."""


def linear_attention_kernels() -> list[tuple[types.ModuleType, str]]:
    """(module, name) of every `_*_kernel` of ops/linear_attention."""
    from moe_tune.ops.linear_attention import kernels_bwd, kernels_kda, kernels_output, kernels_state, kernels_wy

    modules = [kernels_wy, kernels_state, kernels_output, kernels_bwd, kernels_kda]
    return [(module, name) for module in modules for name in list(vars(module)) if re.fullmatch(r"_\w+_kernel", name)]


@contextlib.contextmanager
def recorded_launches(overrides: dict) -> Iterator[list[Launch]]:
    """Within the block, the linear-attention kernels are recorded into the list yielded, not launched, and the op
    takes pick_config's GPU launch with `overrides` (KernelConfig fields) over it; both restored after."""
    from triton.runtime.jit import JITFunction

    from moe_tune.ops.linear_attention import autograd, kernels_common

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise CompileError("TRITON_INTERPRET=1: kernels are interpreted functions, which Triton cannot compile")
    launches: list[Launch] = []

    class Recorder:
        def __init__(self, name: str, fn: JITFunction):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(Launch(self.name, self.fn, args, kwargs))

    saved = []
    for module, name in linear_attention_kernels():
        value = getattr(module, name)
        if isinstance(value, JITFunction):
            saved.append((module, name, value))
            setattr(module, name, Recorder(name, value))
    config = dataclasses.replace(kernels_common.pick_config(types.SimpleNamespace(is_cuda=True)), **overrides)
    pick_config = autograd.pick_config
    autograd.pick_config = lambda x: config
    try:
        yield launches
    finally:
        autograd.pick_config = pick_config
        for module, name, value in saved:
            setattr(module, name, value)


def record_call(is_per_channel: bool, dtype: torch.dtype, head_dims: tuple[int, int], overrides: dict,
                save_intermediates: bool = True, use_qk_l2norm: bool = True,
                with_states: bool = False) -> list[Launch]:  # fmt: skip
    """The launches of one forward and backward on CPU zeros (module docstring; save_intermediates False: backward
    recomputes the forward's passes); with_states: an initial state in and the final state out, whose gradients the
    kernels then take and give."""
    K, V = head_dims
    B, T, H = 1, CALL_TOKENS, CALL_HEADS
    with recorded_launches(overrides) as launches:
        from moe_tune.ops.linear_attention import autograd

        q, k = torch.zeros(B, T, H, K, dtype=dtype), torch.zeros(B, T, H, K, dtype=dtype)
        v, beta = torch.zeros(B, T, H, V, dtype=dtype), torch.zeros(B, T, H, dtype=dtype)
        g = torch.zeros(B, T, H, K) if is_per_channel else torch.zeros(B, T, H)
        initial_state = torch.zeros(B, H, K, V) if with_states else None
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta, initial_state) if x is not None]
        o, final_state = autograd.gated_delta_rule_kernel(
            q, k, v, g, beta, None, initial_state, with_states, None, use_qk_l2norm,
            save_intermediates=save_intermediates,
        )  # fmt: skip
        outputs = [o] if final_state is None else [o, final_state]
        torch.autograd.grad(outputs, leaves, [torch.zeros_like(x) for x in outputs])
    return launches


def distinct(launches: list[Launch]) -> Iterator[tuple[Launch, Any, Any, Any, dict]]:
    """Each launch compiled differently once: (launch, its ASTSource, options, backend, constexprs by name)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", TARGET_ARCH, WARP_SIZE))
    seen = set()
    for launch in launches:
        kwargs = dict(launch.kwargs, debug=False)
        binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
        bound_args, specialization, options = binder(*launch.args, **kwargs)
        key = repr((launch.name, specialization, sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        options, signature, constexprs, attrs = launch.fn._pack_args(backend, kwargs, bound_args, specialization,
                                                                     options)  # fmt: skip
        names = [param.name for param in launch.fn.params]
        constants = {names[path[0]]: value for path, value in constexprs.items()}
        yield launch, ASTSource(launch.fn, signature, constexprs, attrs), options, backend, constants


def shared_memory(source, options, backend) -> int:
    """Bytes of shared memory the kernel launches with ("ttg.shared"), from Triton's passes up to its allocation."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    module, metadata, _ = _ttgir(source, options, backend)
    pm = ir.pass_manager(module.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(
        pm, backend.target.arch, get_ptx_version_from_options(options, backend.target.arch)
    )
    pm.run(module, "shared_memory")
    return module.get_int_attr("ttg.shared")


def ptx_report(source, options, backend) -> dict:
    """shared, registers, stack, spill_stores, spill_loads (bytes a thread), async_copies and mmas (in the PTX)."""
    module, metadata, stages = _ttgir(source, options, backend)
    ptx = stages["ptx"](stages["llir"](module, metadata), metadata)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        result = subprocess.run([ptxas_path(), "-v", f"-arch=sm_{TARGET_ARCH}a", str(path), "-o", os.devnull],
                                capture_output=True, text=True)  # fmt: skip
    text = result.stdout + result.stderr
    stack, registers = PTXAS_STACK.search(text), PTXAS_REGISTERS.search(text)
    if result.returncode != 0 or stack is None or registers is None:
        raise CompileError(f"ptxas failed: {text.strip()[-500:]}")
    return dict(
        shared=metadata["shared"],
        registers=int(registers["registers"]),
        **{name: int(value) for name, value in stack.groupdict().items()},
        async_copies=ptx.count("cp.async.cg") + ptx.count("cp.async.ca") + ptx.count("cp.async.bulk.tensor"),
        mmas=ptx.count("wgmma.mma_async"),
    )


def _ttgir(source, options, backend) -> tuple[Any, dict, dict]:
    """The kernel's TritonGPU module, its compile metadata, and the backend's stages (for the ones after)."""
    from triton._C.libtriton import ir

    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(backend.target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)  # fmt: skip
    stages: dict = {}
    backend.add_stages(stages, options, source.language)
    metadata = {"hash": "kernel_compile", "target": backend.target, **options.__dict__}
    return stages["ttgir"](stages["ttir"](module, metadata), metadata), metadata, stages


def ptxas_path() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not path.is_file():
        raise CompileError(f"{path}: this Triton bundles no ptxas")
    return str(path)


def compile_rows(op: str, dtype: torch.dtype, head_dims: tuple[int, int], overrides: dict,
                 kernels: set[str] | None = None) -> list[dict]:  # fmt: skip
    """One row per distinct launch of op's call under overrides (only `kernels`' where given): {op, candidate,
    kernel, num_warps, num_stages, block sizes (BK, BV, BT where the kernel has them), and ptx_report's fields}."""
    launches = record_call(op == "kda", dtype, head_dims, overrides)
    rows = []
    for launch, source, options, backend, constants in distinct(launches):
        if kernels is not None and launch.name not in kernels:
            continue
        blocks = {name: constants[name] for name in ("BT", "BK", "BV") if name in constants}
        rows.append(dict(op=op, candidate=overrides, kernel=launch.name, num_warps=options.num_warps,
                         num_stages=options.num_stages, **blocks, **ptx_report(source, options, backend)))  # fmt: skip
    return rows


def format_rows(rows: list[dict]) -> str:
    columns = ("op", "candidate", "kernel", "num_warps", "num_stages", "BK", "BV", "registers", "stack",
               "spill_stores", "spill_loads", "shared", "async_copies", "mmas")  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        candidate = ",".join(f"{name}={value}" for name, value in row["candidate"].items()) or "pick_config"
        cells = [candidate if name == "candidate" else row.get(name, "") for name in columns]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def _head_dims(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: must be K,V, two positive integers")
    return int(parts[0]), int(parts[1])


def _names(text: str) -> set[str]:
    names = {name.strip() for name in text.split(",")}
    known = {name for _, name in linear_attention_kernels()}
    unknown = sorted(names - known)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: not a linear-attention kernel ({', '.join(sorted(known))})"
        )
    return names


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m moe_tune.engine.bench.kernel_compile",
                           description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--ops", type=parse_ops, default=list(OPS), help="comma-separated: gdn, kda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the inputs' dtype")
    parser.add_argument("--head-dims", type=_head_dims, default=HEAD_DIMS, help="K,V (default 128,128)")
    parser.add_argument("--kernels", type=_names, default=None, help="only these kernels, comma-separated")
    parser.add_argument("--candidate", type=parse_candidate, action="append", default=[],
                        help="KernelConfig fields over pick_config's (repeatable); pick_config's own comes first")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        print(f"--json ({args.json}): must be a file in an existing folder", file=sys.stderr)
        raise SystemExit(2)
    rows = []
    try:
        for op in args.ops:
            for overrides in [{}, *args.candidate]:
                rows += compile_rows(op, DTYPES[args.dtype], args.head_dims, overrides, args.kernels)
    except (CompileError, ImportError) as error:
        print(f"cannot compile for sm_{TARGET_ARCH} here: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    unlaunched = sorted((args.kernels or set()) - {row["kernel"] for row in rows})
    if unlaunched:
        print(f"--kernels ({', '.join(unlaunched)}): not launched by {', '.join(args.ops)}'s training call "
              "under these candidates", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    print(format_rows(rows))
    if args.json is not None:
        write_json_atomic(args.json, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
