"""Entry points: the `cellfeed` CLI, the local campaign and the Modal app."""
