"""The CPU half: dataset access (local and S3), conversion, synthetic data, sampling plans,
gene ranking, tokenizers, packing, boundary stitching and the producer loop."""
