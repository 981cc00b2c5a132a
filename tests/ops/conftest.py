"""Shared by the tests of ops/: the Triton interpreter's fix."""

import pytest


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
