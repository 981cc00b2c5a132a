"""Fused ops: one folder per op, each with a pure-PyTorch reference and a fast path behind one public function:
Triton kernels (linear_attention, sparse_attention, moe, rms_norm, causal_conv) or a chunked PyTorch loop
(cross_entropy)."""
