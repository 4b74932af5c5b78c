"""The CPU backend's kernels: small C files (built on first use by build.py) and their ctypes bindings."""
