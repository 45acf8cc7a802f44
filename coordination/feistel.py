"""A pseudo-random permutation of range(n) in O(1) memory (block and random sampling's order),
and the 64-bit mixer it and the cell-id hashes use."""

from __future__ import annotations

import numpy as np

FEISTEL_ROUNDS = 6

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixing 64-bit hash (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A pseudo-random bijection of range(n) in O(1) memory: a balanced Feistel network on the
    smallest even bit width covering n, with cycle walking to stay inside [0, n)."""

    def __init__(self, n: int, key: int, rounds: int = FEISTEL_ROUNDS):
        if n < 1:
            raise ValueError("a permutation needs n >= 1")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        seq = np.random.SeedSequence(key & ((1 << 64) - 1))
        self.round_keys = [np.uint64(k) for k in seq.generate_state(rounds, dtype=np.uint64)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        with np.errstate(over="ignore"):
            for k in self.round_keys:
                left, right = right, left ^ (mix64(right ^ k) & self.mask)
        return (left << h) | right

    def __call__(self, index) -> np.ndarray:
        x = np.atleast_1d(np.asarray(index, dtype=np.uint64))
        if x.size and int(x.max()) >= self.n:
            raise IndexError("index out of range")
        y = self._encrypt(x)
        outside = y >= np.uint64(self.n)
        while outside.any():  # cycle walking: the orbit of an in-range x returns in range
            y[outside] = self._encrypt(y[outside])
            outside = y >= np.uint64(self.n)
        return y.astype(np.int64)
