"""The GPU half: consumer stream, model, DDP loop, metrics, checkpoints. Never imports Lance or Polars."""
