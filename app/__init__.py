"""Entry points: the `cellfeed` CLI, the local campaign and the Modal app. Importing any of them gives
NumPy's OpenBLAS one thread, before NumPy loads (`coordination/net.py:one_blas_thread` says why)."""

from coordination.net import one_blas_thread

one_blas_thread()
