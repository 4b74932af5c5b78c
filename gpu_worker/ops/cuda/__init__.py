"""The CUDA backend's kernels: the .cu sources (NVRTC-compiled through CuPy) and the ops that launch them."""
