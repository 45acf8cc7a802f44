"""The trainer's settings, without torch: what `trainer.launch` writes for each rank and the
orchestrators (`cellfeed local`, the Modal app) build, so they start ranks without importing torch."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from coordination.backends import BackendSpec
from coordination.driver import LEASE_S
from coordination.vocab import CLS, EOS, MASK, PAD

STOP_SIGNAL = signal.SIGUSR2  # "checkpoint and stop after this step" (`trainer.ranks.ask_to_stop`)


@dataclass
class TrainConfig:
    run: str
    backend: BackendSpec  # where the run's queue and map are (a dict when read from JSON)
    vocab_size: int  # the gene vocabulary's size (`coordination.vocab.GeneVocab`)
    preset: str = "tiny"
    objective: str = "bins"
    n_bins: int = 51
    batch_size: int = 64
    grad_accum: int = 1
    lr: float = 3e-4
    warmup_steps: int = 10
    warmup_cells: int | None = None  # the warm-up in cells (None: warmup_steps steps of batch_size cells, every rank's)
    max_steps: int | None = None  # None: train the epochs through
    epochs: int = 1
    mask_ratio: float = 0.4
    seed: int = 0
    compile: bool = False
    pad_to: int | None = None
    tokens_per_row: int | None = None  # packed rows of this many tokens (`trainer.packing`); None: a row per cell
    tokens_per_batch: int | None = None  # a batch: the drawn cells that fit this many tokens (None: batch_size cells)
    # attention over padded or packed rows (`model.ModelConfig`): "dense", "flex", "varlen", or "auto":
    # varlen on a GPU with the kernel (no pair between cells: a padding mask sent SDPA to a kernel that took a padded
    # batch 290 ms against 230 ms full length on an H200), dense elsewhere
    packed_attention: str = "auto"
    buffer_cells: int = 4096
    run_driver: bool = True  # rank 0 drives the producers (so a detached campaign needs no laptop)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 2  # the last k are kept, and the best by held-out loss
    resume: bool = False
    lease_s: float = LEASE_S  # rank 0's driver issues a unit again after its producer is silent this long
    log_path: str | None = None  # JSON lines, one per step (rank 0)
    tb_dir: str | None = None  # TensorBoard event files (rank 0): loss, lr, cells/s, data wait per rank, MFU, audits
    wandb_project: str | None = (
        None  # the same scalars to W&B too (rank 0; `cellfeed local --wandb`), run files in tb_dir/..
    )
    cells_log: str | None = None  # per rank, JSON lines of the cell ids each step trained on (tests, audits)
    no_data_timeout_s: float = 600.0
    eval_every: int | None = None  # masked-bin accuracy on the held-out set every N steps (rank 0)
    eval_cells: int = 0  # how many held-out cells the setup put in the "eval" partition
    progress_bar: bool = True
    pad_token: int = PAD  # the vocabulary's special tokens
    mask_token: int = MASK
    special_tokens: tuple = (PAD, CLS, EOS, MASK)
    vocab_fingerprint: str = ""  # checkpoints record it: a resume under another vocabulary is refused
    data_id: str = ""  # the data's identity (`SetupFacts.data_id`): a resume onto other data is refused

    def __post_init__(self):
        self.backend = BackendSpec.of(self.backend)
