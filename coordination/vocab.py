"""The gene vocabulary: gene identifiers -> token ids, with the special tokens, defined once for
producers (which map each source's genes to tokens) and the trainer (which pads, masks and sizes
its embedding by it). Which special tokens frame a cell is the tokenizer's layout
(`producers.tokenizers.Layout`); their ids are the vocabulary's.

Three ways to get one:
- built from the corpus (the default): the special tokens first (`<pad>` 0, `<cls>` 1, `<eos>` 2,
  `<mask>` 3: `PAD`, `CLS`, `EOS`, `MASK` below), then every source's gene identifiers, the
  first source's in its own order, then each further source's new ones in theirs: a one-dataset
  run's tokens are what they always were (gene g -> g + `GENE_OFFSET`);
- scGPT's `vocab.json` / `default_gene_vocab.json` (a JSON object symbol -> id): scGPT appends
  `<pad>`, `<cls>`, `<eoc>` after the highest id when they are missing (scgpt/tokenizer/
  gene_tokenizer.py, `GeneVocab.append_token`), and so does this; `<eoc>` is its end-of-cell
  token, cellfeed's `eos`. cellfeed's masked modelling needs a `<mask>` too: appended the same way;
- Geneformer's token dictionary (Ensembl id -> id with `<pad>`, `<mask>`, and in V2 `<cls>`,
  `<eos>`), a pickle: read with an unpickler that admits dicts, strings and numbers and refuses
  anything else (`read_mapping`), or the same as JSON.

A vocabulary is written into the run folder as JSON (`to_json`); checkpoints record its
fingerprint, so a resume or a start from weights under another vocabulary is refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from coordination.errors import CellfeedError

# cellfeed's roles for special tokens -> the names a vocabulary may give them, preferred first
SPECIAL_NAMES = {"pad": ("<pad>",), "cls": ("<cls>",), "eos": ("<eos>", "<eoc>"), "mask": ("<mask>",)}
APPENDED_NAMES = {"pad": "<pad>", "cls": "<cls>", "eos": "<eoc>", "mask": "<mask>"}  # scGPT's names (+ <mask>)
OUTSIDE_16 = np.iinfo(np.uint16).max  # a uint16 lookup's "outside the vocabulary" (ids stay below it)
MIN_MATCHED_SHARE = 0.5  # a source whose non-zeros fall below this share inside the vocabulary is refused

# The special tokens' ids in the vocabulary built from a corpus (`GeneVocab.build`, SPECIAL_NAMES' order), and
# its first gene's: the defaults of whatever has no vocabulary at hand (a vocabulary file has its own ids)
PAD, CLS, EOS, MASK = 0, 1, 2, 3
GENE_OFFSET = 4


@dataclass(frozen=True)
class GeneVocab:
    """Identifier -> token id, special tokens included (their names in `SPECIAL_NAMES`)."""

    ids: dict[str, int] = field(repr=False)
    origin: str = "built from the corpus"

    def __post_init__(self):
        values = np.fromiter(self.ids.values(), dtype=np.int64, count=len(self.ids))
        if len(values) and (values.min() < 0 or len(np.unique(values)) != len(values)):
            raise CellfeedError(f"gene vocabulary ({self.origin}): token ids must be distinct and >= 0")
        for role in SPECIAL_NAMES:
            self.special(role)  # every role present

    def special(self, role: str) -> int:
        for name in SPECIAL_NAMES[role]:
            if name in self.ids:
                return self.ids[name]
        raise CellfeedError(f"gene vocabulary ({self.origin}) has no {SPECIAL_NAMES[role][0]} token")

    @property
    def pad(self) -> int:
        return self.special("pad")

    @property
    def mask(self) -> int:
        return self.special("mask")

    @cached_property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(sorted({self.special(role) for role in SPECIAL_NAMES}))

    @property
    def size(self) -> int:
        """Embedding rows a model needs: the highest id + 1."""
        return max(self.ids.values()) + 1

    @property
    def n_genes(self) -> int:
        return len(self.ids) - sum(1 for k in self.ids if _is_special_name(k))

    @cached_property
    def fingerprint(self) -> str:
        return hashlib.blake2b(json.dumps(sorted(self.ids.items())).encode(), digest_size=8).hexdigest()

    def lookup(self, identifiers) -> np.ndarray:
        """Token ids of gene identifiers, in order; -1 for those outside the vocabulary."""
        return np.fromiter((self.ids.get(str(g), -1) for g in identifiers), dtype=np.int64, count=len(identifiers))

    def lookup_array(self, identifiers) -> np.ndarray:
        """A dataset's gene id -> token id array, as compact as the vocabulary allows: uint16 when
        every id fits under 65,535 (scGPT's, Geneformer's, one Tahoe's: the rows stay 2 bytes a
        gene, as stored), else int32; a gene outside the vocabulary holds `outside_marker`."""
        ids = self.lookup(identifiers)
        if self.size <= OUTSIDE_16:
            return np.where(ids < 0, OUTSIDE_16, ids).astype(np.uint16)
        return ids.astype(np.int32)

    # ---- construction and files

    @classmethod
    def build(cls, gene_lists) -> "GeneVocab":
        """The default vocabulary of a corpus: specials 0..3, then the sources' identifiers
        (first source's order, then each further source's new ones)."""
        ids = {names[0]: i for i, names in enumerate(SPECIAL_NAMES.values())}
        for genes in gene_lists:
            for g in genes:
                ids.setdefault(str(g), len(ids))
        return cls(ids)

    @classmethod
    def read(cls, path: str | Path) -> "GeneVocab":
        """A vocabulary file (JSON, or a Geneformer pickle), with missing specials appended after the
        highest id as scGPT does."""
        mapping = read_mapping(path, "gene vocabulary")
        bad = next(((k, v) for k, v in mapping.items() if not isinstance(v, int) or isinstance(v, bool)), None)
        if bad is not None:
            raise CellfeedError(f"gene vocabulary {path}: {bad[0]!r} maps to {bad[1]!r}, not a token id")
        ids = dict(mapping)
        for role, names in SPECIAL_NAMES.items():
            if not any(n in ids for n in names):
                ids[APPENDED_NAMES[role]] = max(ids.values(), default=-1) + 1
        return cls(ids, origin=str(path))

    def to_json(self) -> str:
        return json.dumps({"origin": self.origin, "ids": self.ids})

    @classmethod
    def from_json(cls, text: str) -> "GeneVocab":
        data = json.loads(text)
        return cls(data["ids"], origin=data["origin"])


def inside(tokens: np.ndarray) -> np.ndarray:
    """Which entries of a lookup (`GeneVocab.lookup_array`) or its gathered tokens are in the vocabulary."""
    return tokens != OUTSIDE_16 if tokens.dtype == np.uint16 else tokens >= 0


def _is_special_name(name: str) -> bool:
    return name.startswith("<") and name.endswith(">")


class _DataOnly(pickle.Unpickler):
    """Builds dicts, lists, strings and numbers (opcodes, no globals). The one global admitted is
    NumPy's scalar reconstructor with a numeric dtype: Geneformer's median dictionary holds
    float64 scalars. Anything else names itself and is refused."""

    def find_class(self, module, name):
        if (module, name) in (("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")):
            return _numeric_scalar
        if (module, name) == ("numpy", "dtype"):
            return _numeric_dtype
        raise pickle.UnpicklingError(f"refusing {module}.{name}: only dicts of strings and numbers are read")


def _numeric_dtype(name, *args):
    dtype = np.dtype(name)
    if dtype.kind not in "iuf":
        raise pickle.UnpicklingError(f"refusing numpy dtype {name!r}: only numbers are read")
    return dtype


def _numeric_scalar(dtype, data=b""):
    if not isinstance(dtype, np.dtype) or dtype.kind not in "iuf" or not isinstance(data, bytes):
        raise pickle.UnpicklingError("refusing a numpy object that is not a number")
    return np.frombuffer(data, dtype=dtype)[0].item()


def read_mapping(path: str | Path, what: str) -> dict:
    """A JSON object, or a pickled dict of strings and numbers read without running code."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CellfeedError(f"cannot read {what} {path}: {exc.strerror}") from None
    if path.suffix in (".pkl", ".pickle"):
        try:
            data = _DataOnly(io.BytesIO(raw)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
            raise CellfeedError(f"{what} {path}: not a plain pickled dict ({exc})") from None
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CellfeedError(f"{what} {path}: not JSON ({exc}); a Geneformer pickle needs a .pkl name") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise CellfeedError(f"{what} {path}: expected an object of gene identifier -> value")
    return data


def publish_vocab(store, run: str, vocab: GeneVocab) -> None:
    """The campaign's vocabulary into its map (zstd JSON: scGPT's is ~0.3 MB, under a map value's
    1 MiB), where producers and the trainer read it (`published_vocab`)."""
    import zstandard

    from coordination.routing import vocab_key

    store.put(vocab_key(run), zstandard.compress(vocab.to_json().encode(), 19))


def published_vocab(store, run: str) -> GeneVocab | None:
    import zstandard

    from coordination.routing import vocab_key

    data = store.get(vocab_key(run))
    return None if data is None else GeneVocab.from_json(zstandard.decompress(data).decode())
