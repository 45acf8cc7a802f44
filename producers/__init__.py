"""The CPU half: dataset access (local and S3), conversion, synthetic data, sampling plans,
gene ranking, tokenizers, packing, boundary stitching and the producer loop."""

# what a conversion's worker imports before its first slice (producers/convert.py), imported once by the
# forkserver the workers fork from; not Lance: its import hook warns at every fork, and it imports fast
CONVERT_WORKER_MODULES = ("numpy", "pyarrow", "h5py", "scipy.sparse", "anndata", "tqdm")
