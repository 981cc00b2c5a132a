"""Fused ops: one folder per op, each with a pure-PyTorch reference and a fast path behind one public function:
Triton kernels (linear_attention, sparse_attention, moe, rms_norm, causal_conv, and cross_entropy's per-chunk
softmax inside its chunked loop)."""
