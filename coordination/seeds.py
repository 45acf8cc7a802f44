"""Every seed in one place: which generator a piece of randomness comes from, derived from the
campaign seed and what it is for, so a unit, a cell, a plan or a step is random the same way each
time it is produced (and a re-run after a crash reproduces it byte for byte)."""

from __future__ import annotations

import hashlib
import json

import numpy as np


def derive_key(*parts: int | str) -> int:
    """A 64-bit key from seed/epoch/purpose: the same parts always give the same key."""
    text = json.dumps([str(p) for p in parts]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def unit_rng(seed: int, epoch: int, unit: int) -> np.random.Generator:
    """Shuffles a unit's cells (and draws scgpt's random gene subsets): the same every time it is produced."""
    return np.random.default_rng(derive_key(seed, epoch, "unit", unit))


def cell_rng(seed: int, epoch: int, cell: int) -> np.random.Generator:
    """A stitched boundary cell's generator."""
    return np.random.default_rng(derive_key(seed, epoch, "cell", cell))


def held_out_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(derive_key(seed, "held-out"))


def plan_key(seed: int, epoch: int, purpose: str) -> int:
    """Keys of an epoch's plan: the block permutation ("blocks"), the scanner rounds ("scanners")."""
    return derive_key(seed, epoch, purpose)


def batch_rng(seed: int, epoch: int, rank: int) -> np.random.Generator:
    """A rank's mixing of its buffer into batches, per epoch."""
    return np.random.default_rng([seed, epoch, rank])


def mask_seed(seed: int, rank: int, step: int, micro: int) -> int:
    """The masked positions of one (micro)batch: a torch seed."""
    return derive_key(seed, rank, step, micro) % 2**63
