"""What runs on the CPU only: the kernels behind the reference runtime's float32 linear layers.

- ``packing``: each linear layer's weight reordered once, at load, for the kernel that runs it
  (``pack_cpu_linears``);
- ``panel_gemm``: the batch-invariant panel GEMM, built from ``kernels/panel_gemm.cpp`` on first
  use (``python -m dflash_trt.runtime.cpu.panel_gemm`` builds it ahead, as ``make setup`` does);
- ``kernel_caches``: bounds on oneDNN's kernel caches where the panel kernel cannot be built.

The forward passes these layers sit in run on every device: runtime/targets/.
"""
