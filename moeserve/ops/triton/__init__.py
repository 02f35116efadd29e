"""Triton kernels; each takes the same arguments as its reference in `moeserve.ops.reference`.

Kernels also run under TRITON_INTERPRET=1 on CPU tensors, which is how CI checks them without a GPU.
"""
