"""A producer's settings (`ProducerConfig`): which data, which run, how to sample and tokenize,
and the loop's timing. Checked once, up front (`validate`); every producer of a campaign gets the
same one (`app.config` makes it from the campaign's settings)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from coordination.balance import Balance
from coordination.corpus_file import CorpusSpec, Mixtures
from coordination.driver import LEASE_S, heartbeat_interval
from coordination.errors import CellfeedError
from coordination.plan import Sampling
from producers.storage import REMOTE_READS_MAX


@dataclass(frozen=True)
class ProducerConfig:
    dataset: str  # one dataset ("" with a corpus)
    run: str
    seed: int = 0
    corpus: str | None = None  # a corpus file (TOML, `coordination.corpus_file.CorpusSpec`) instead of one dataset
    vocabulary: str | None = None  # a gene vocabulary file; None: built from the sources (or the corpus file's)
    gene_column: str = "gene_id"  # the var column naming genes in the vocabulary
    gene_medians: str | None = None  # geneformer: a median dictionary (identifier -> median) over the corpus
    mixtures: str | None = (
        None  # the run's corpus over its epochs (`coordination.corpus_file.Mixtures`, JSON): over `corpus`
    )
    sampling: Sampling = field(default_factory=Sampling)
    tokenizer: str = "scgpt"
    max_genes: int | None = None  # None: the tokenizer's own length (producers.tokenizers.LAYOUTS)
    tokenizer_params: dict = field(default_factory=dict)
    world_size: int = 1
    cells_per_item: int = 128
    label_column: str | None = None  # an obs column carried as int labels (e.g. "plate")
    balance: Balance | None = None  # balanced sampling by an obs column (`coordination.balance`)
    subset_filter: str | None = None  # a Lance SQL filter on obs, e.g. "plate != 'plate14'"
    subset_ids: tuple[int, ...] | None = None
    exclude_filter: str | None = None  # cells never to produce for training, e.g. the held-out split
    threads: int | None = None  # tokenizing threads; None: one per CPU this process may use
    read_ahead: int | None = None  # units read ahead of the one tokenized; None: as many as the read latency needs
    # slice reads in flight per dataset on object storage; None: as many as the producer's pace needs (ReadSlots)
    reads_in_flight: int | None = None
    heartbeat_s: float = heartbeat_interval(LEASE_S)  # how often it says what it holds (`coordination.driver`)
    read_retry_s: float = 180.0  # how long a unit's read is tried again while storage does not answer
    put_timeout_s: float = 600.0
    idle_timeout_s: float = 10.0
    trace_units: bool = False  # a line on stdout as each unit is taken: "NAME: took unit U of epoch E"

    def corpus_mixtures(self) -> Mixtures | None:
        """The corpus over the run's epochs (None: one dataset); a vocabulary given on the command
        line wins over the corpus file's."""
        if not (self.mixtures or self.corpus):
            return None
        mixtures = (
            Mixtures.from_json(Path(self.mixtures).read_text(), self.mixtures)
            if self.mixtures
            else Mixtures([(0, self.corpus_spec())])
        )
        if self.vocabulary:
            mixtures.union = replace(mixtures.union, vocabulary=self.vocabulary)
        return mixtures

    def corpus_spec(self) -> CorpusSpec:
        """The campaign's sources: the corpus file's, or the one dataset as a corpus of one."""
        if self.corpus:
            spec = CorpusSpec.read(self.corpus)
            if self.vocabulary:  # a vocabulary given on the command line wins over the file's
                spec = CorpusSpec(spec.sources, self.vocabulary, spec.gene_column, spec.epoch_cells, spec.path)
            return spec
        return CorpusSpec.single(
            self.dataset, self.subset_filter, self.exclude_filter, self.gene_column, self.vocabulary
        )

    def validate(self) -> "ProducerConfig":
        self.sampling.validate()
        if (self.corpus or self.mixtures) and (
            self.subset_filter or self.exclude_filter or self.subset_ids or self.label_column
        ):
            raise CellfeedError(
                "with a corpus, give each source's subset_filter / eval_filter in the corpus file "
                "(labels and id lists are for one dataset)"
            )
        if self.balance is not None:
            self.balance.validate()
            if self.label_column:
                raise CellfeedError("balanced sampling carries each cell's class as its label: give no label_column")
        if self.world_size < 1:
            raise CellfeedError(f"world_size must be >= 1, got {self.world_size}")
        if self.threads is not None and self.threads < 1:
            raise CellfeedError(f"threads must be >= 1, got {self.threads}")
        if self.read_ahead is not None and self.read_ahead < 1:
            raise CellfeedError(f"read_ahead must be >= 1, got {self.read_ahead}")
        if self.reads_in_flight is not None and not 1 <= self.reads_in_flight <= REMOTE_READS_MAX:
            raise CellfeedError(f"reads_in_flight must be 1..{REMOTE_READS_MAX}, got {self.reads_in_flight}")
        if self.cells_per_item < 1:
            raise CellfeedError(f"cells_per_item must be >= 1, got {self.cells_per_item}")
        if not self.run or "/" in self.run:
            raise CellfeedError(f"run id must be non-empty and without '/', got {self.run!r}")
        return self


def usable_cpus() -> int:
    """CPUs this process may run on (a container's share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
