"""The CPU half: dataset access (local and S3), conversion, synthetic data, sampling plans,
gene ranking, tokenizers, packing, boundary stitching and the producer loop."""

# what a conversion's worker imports before its first slice (producers/convert.py), imported once by the
# forkserver the workers fork from; first producers.heap, whose import tunes malloc before any thread starts
# (its docstring says why); not Lance: its import hook warns at every fork, and it imports fast; not anndata
# (~0.3 s): a worker reads CSR with h5py alone (producers/h5ad.py:Matrix), CSC and dense import it when needed
CONVERT_WORKER_MODULES = ("producers.heap", "numpy", "pyarrow", "h5py", "scipy.sparse", "pandas")
