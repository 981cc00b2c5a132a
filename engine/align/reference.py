"""The reference stays the reference: transformers' own PyTorch paths, whatever kernels are importable.

transformers picks an external implementation (flash-linear-attention's Triton kernels, causal-conv1d) for some
functions of its modeling files when it imports them (`use_kernel_func_from_hub_with_fallback` in
transformers/integrations/hub_kernels.py): the module-level name then calls the external package, and the pure
PyTorch function it decorates is only reachable as the wrapper's `__wrapped__`. Where the `kernels` package is
installed (transformers >= 5.25 requires it), that wrapper is itself wrapped in a kernels function module (an
nn.Module whose forward calls it). `pure_torch_paths()` rebinds those names to the PyTorch functions for as long as
it is held, so `moe-tune align` compares against the model's own definition (and runs on a CPU with FLA installed),
and restores them on exit.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

# The modeling modules of the supported families that route functions through the fallback wrapper; imported on
# entry so their names exist before the reference model is built (a model built inside the context is covered).
KERNEL_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.kimi_linear.modeling_kimi_linear",
    "transformers.models.qwen4_exp.modeling_qwen4_exp",
)


# The names a held pure_torch_paths() has rebound, {(module name, name): the value it replaced}: external_paths()
# still sees what a module would call outside it.
_held: dict[tuple[str, str], Any] = {}


def closure_cells(function: FunctionType) -> dict[str, Any]:
    """{free variable: value} of `function`'s closure (empty cells left out)."""
    cells = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        with contextlib.suppress(ValueError):
            cells[name] = cell.cell_contents
    return cells


def kernel_function(value: object) -> FunctionType | None:
    """The function a kernels function module calls (kernels' use_kernel_forward_from_hub applied to a function: an
    nn.Module instance named after it, whose class's forward closes over it), None for anything else."""
    forward = getattr(type(value), "forward", None)
    if not hasattr(value, "kernel_layer_name") or not isinstance(forward, FunctionType):
        return None
    function = closure_cells(forward).get("func")
    return function if isinstance(function, FunctionType) else None


def fallback_wrapper(value: object) -> FunctionType | None:
    """The function made by transformers' use_kernel_func_from_hub_with_fallback (its inner `wrapped`) that `value`
    is or, as a kernels function module, calls; None for anything else."""
    value = kernel_function(value) or value
    if not isinstance(value, FunctionType) or not hasattr(value, "__wrapped__"):
        return None
    code = value.__code__
    return value if code.co_name == "wrapped" and code.co_filename.endswith("hub_kernels.py") else None


def torch_function(value: object) -> object:
    """transformers' own PyTorch function behind `value`'s fallback wrapper (fallback_wrapper); `value` when it has
    none."""
    wrapper = fallback_wrapper(value)
    return value if wrapper is None else inspect.unwrap(wrapper)


def called_function(value: object) -> object:
    """What calling `value` runs: through a kernels function module to the function it calls, through transformers'
    fallback wrapper to the implementation it chose when its modeling module was imported; `value` otherwise."""
    wrapper = fallback_wrapper(value)
    if wrapper is None:
        return kernel_function(value) or value
    implementation = closure_cells(wrapper).get("implementation")
    return implementation if callable(implementation) else wrapper


def external_paths(modules: list[ModuleType] | None = None) -> dict[tuple[str, str], str]:
    """{(module, name): the implementing function's module} for every wrapped name whose implementation is not
    transformers' own PyTorch function (FLA or causal-conv1d was importable when the module was imported)."""
    found = {}
    for module in modules if modules is not None else _modeling_modules():
        for name, value in list(vars(module).items()):
            wrapper = fallback_wrapper(_held.get((module.__name__, name), value))
            if wrapper is None:
                continue
            closure = closure_cells(wrapper)
            implementation = closure.get("implementation")
            if closure.get("is_new_implementation") and implementation is not None:
                found[(module.__name__, name)] = getattr(implementation, "__module__", None) or "?"
    return found


def _modeling_modules() -> list[ModuleType]:
    for name in KERNEL_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return [m for n, m in list(sys.modules.items())
            if n.startswith("transformers.models.") and ".modeling_" in n and isinstance(m, ModuleType)]


@contextlib.contextmanager
def pure_torch_paths() -> Iterator[dict[tuple[str, str], str]]:
    """Within: every fallback-wrapped name of transformers' modeling modules calls transformers' PyTorch function.
    Yields what the names would call outside it ({(module, name): external module}, empty when nothing external
    is importable), an enclosing pure_torch_paths' replacements included."""
    modules = _modeling_modules()
    replaced = external_paths(modules)
    saved = []
    try:
        for module in modules:
            for name, value in list(vars(module).items()):
                if fallback_wrapper(value) is not None:
                    saved.append((module, name, value))
                    _held[(module.__name__, name)] = value
                    setattr(module, name, torch_function(value))
        yield replaced
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
            _held.pop((module.__name__, name), None)


# Import names of the external packages, as their distributions are called (what a user installs).
DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}


def describe(replaced: dict[tuple[str, str], str]) -> str:
    """One line for the align report: which paths the reference ran."""
    if not replaced:
        return "transformers' PyTorch paths"
    packages = sorted({DISTRIBUTIONS.get(p, p) for p in (origin.split(".")[0] for origin in replaced.values())})
    return f"transformers' PyTorch paths ({', '.join(packages)} importable, not used)"


def write_dequantized_checkpoint(directory: Path, out: Path) -> Path:
    """The FP8 checkpoint at `directory` with every FP8 weight dequantized to fp32 (ops.fp8.dequantize_weight of the
    stored bits and block scales) and its `_scale_inv` dropped, config.json without quantization_config, in `out`:
    what transformers' model runs as the reference (its FP8 layers have no CPU path), on exactly the weights the
    FP8 bits stand for. One shard per source shard, written as it is read."""
    import json

    from safetensors.torch import save_file

    from moe_tune.engine.families.checkpoint import SCALE_SUFFIX, CheckpointReader, WeightGetter, read_config

    out.mkdir(parents=True, exist_ok=True)
    config = read_config(directory)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weight_map: dict[str, str] = {}
    with CheckpointReader(directory) as reader:
        get = WeightGetter(reader)
        by_file: dict[str, list[str]] = {}
        for key in reader.keys():
            if not key.endswith(SCALE_SUFFIX):
                by_file.setdefault(reader.file_of(key).name, []).append(key)
        for index, (name, keys) in enumerate(sorted(by_file.items())):
            shard = f"model-{index + 1:05d}-of-{len(by_file):05d}.safetensors"
            save_file({key: get(key).contiguous() for key in keys}, str(out / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(keys, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out
