"""Chaos: a producer SIGKILLed and one SIGSTOPped past its lease, the trainer paused past the lease
(queue full, producers on backpressure) in a real local campaign (`benchmarks/chaos.py --tiny`,
run and checked by tests/test_benchmarks.py: every epoch trains exactly the training set, the
run finishes by itself); all ranks killed and resumed (tests/test_trainer.py); a unit produced
twice at once (tests/test_producer.py); and here, a stitching piece lost from the map."""

from __future__ import annotations

import pytest


def test_a_stitching_piece_deleted_from_the_map_fails_the_cell_with_one_line():
    """A piece lost from the map cannot be made up by the last holder: it stops with one line (the
    local campaign then stops on it, keeping its checkpoint), and a resume drops the epoch's map and
    produces every unit holding a piece of an untrained boundary cell again
    (test_trainer: test_killed_on_two_ranks_resumed_on_three_killed_again_resumed_on_one_...[sequential])."""
    import numpy as np

    from coordination.errors import CellfeedError
    from coordination.queues import MemoryMap
    from producers.stitch import offer_piece, piece_key

    store = MemoryMap()
    genes, values = np.array([3, 9], dtype=np.uint16), np.array([1, 2], dtype=np.uint16)
    assert offer_piece(store, 0, "7.1", 42, 0, 2, genes, values) is None  # the first holder waits
    store.pop(piece_key(42, 0))  # the piece is lost
    with pytest.raises(CellfeedError, match=r"^cell 42 of epoch 0: pieces \[0\] missing at the last arrival$"):
        offer_piece(store, 0, "8.0", 42, 1, 2, genes, values)
