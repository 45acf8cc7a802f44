"""The token layout, shared by the tokenizers (producers), the consumer stream and the model (trainer).

Token ids come from the campaign's gene vocabulary (`coordination.vocab`). The vocabulary built
from a corpus (the default) numbers PAD 0, CLS 1, EOS 2, MASK 3 and gene g of a one-dataset run
g + GENE_OFFSET; a vocabulary read from a file (scGPT's, Geneformer's) has its own ids. A
tokenizer's `Layout` says which special tokens frame a cell (by role: "cls", "eos"), how many
genes it keeps by default, and what rides beside the tokens:

| tokenizer       | a cell's tokens                         | default genes | values beside tokens |
|-----------------|-----------------------------------------|---------------|----------------------|
| `scgpt`         | CLS g1 .. gn                            | 1,024         | expression bins      |
| `geneformer-v1` | g1 .. gn            (Geneformer V1)     | 2,048         | none                 |
| `geneformer-v2` | CLS g1 .. gn EOS    (Geneformer V2)     | 4,094         | none                 |
| `raw`           | g1 .. gn in gene order                  | 1,024         | raw values (float32) |

`geneformer` is another name for `geneformer-v2`. An empty cell (no non-zero value) keeps only
its special tokens: CLS for scgpt, CLS EOS for V2, and no token at all for V1 and raw; it is still
delivered, trained on as a sequence with nothing to predict.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordination.errors import CellfeedError

PAD, CLS, EOS, MASK = 0, 1, 2, 3  # in the vocabulary built from a corpus (`GeneVocab.build`)
GENE_OFFSET = 4


@dataclass(frozen=True)
class Layout:
    name: str
    head: str | None  # the role of the token before the genes ("cls") or None
    tail: str | None  # the role of the token after the genes ("eos") or None
    default_genes: int
    values: str | None  # "bins", "raw" or None: what the `values` stream beside the tokens holds

    def sequence_length(self, max_genes: int) -> int:
        """The longest token sequence of a cell: the genes plus the special tokens around them."""
        return max_genes + (self.head is not None) + (self.tail is not None)

    @property
    def objective(self) -> str | None:
        """What masked modelling predicts: expression bins, gene ids, or None (not trainable here)."""
        return {"bins": "bins", None: "genes"}.get(self.values)


LAYOUTS = {
    "scgpt": Layout("scgpt", "cls", None, 1024, "bins"),
    "geneformer-v1": Layout("geneformer-v1", None, None, 2048, None),
    "geneformer-v2": Layout("geneformer-v2", "cls", "eos", 4094, None),
    "raw": Layout("raw", None, None, 1024, "raw"),
}
ALIASES = {"geneformer": "geneformer-v2"}
TOKENIZER_NAMES = tuple(LAYOUTS) + tuple(ALIASES)


def layout(tokenizer: str) -> Layout:
    """The layout of a tokenizer by name (aliases accepted)."""
    name = ALIASES.get(tokenizer, tokenizer)
    if name not in LAYOUTS:
        raise CellfeedError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZER_NAMES)}")
    return LAYOUTS[name]
