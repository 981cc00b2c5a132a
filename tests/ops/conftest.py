"""Shared by the tests of ops/: one intra-op thread; the Triton interpreter's fix."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Tensors here are tiny: intra-op threads only add synchronisation, and CI runs two test workers on two cores
    # (test_linear_attention_reference.py ran 4x slower with 2 threads on a busy 2-core machine).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def interpreter_scalar_index():
    """numpy >= 2.4 refuses int() of a 1-element 1-d array, which Triton 3.6's interpreter does for every scalar
    used as a loop bound (triton-lang/triton#9171, fixed upstream after 3.6): register __index__ the fixed way."""
    import triton.runtime.interpreter as triton_interpreter

    patch_lang_tensor = triton_interpreter._patch_lang_tensor

    def patch_lang_tensor_fixed(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_interpreter, "_patch_lang_tensor", patch_lang_tensor_fixed)
        yield
