"""An scGPT-style transformer encoder for masked expression modelling.

Input per position: gene-token embedding + expression-bin embedding (no positions: a cell is a
set of genes). Pre-LayerNorm blocks with `scaled_dot_product_attention` (flash / memory-efficient
kernels on GPU), bidirectional; padded or packed rows through flash attention's varlen kernel on
CUDA (each cell a sequence of its own), a mask elsewhere. Objective: a fraction of gene positions
have their bin hidden (bin id `n_bins`, "masked") and the model predicts the bins there; with
token streams that carry no values (geneformer) it predicts the masked gene ids instead, and has
no bin embedding at all (DDP requires every parameter to receive a gradient).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from coordination.vocab import CLS, EOS, MASK, PAD
from trainer.packing import MAX_CELLS_PER_ROW
from trainer.presets import preset_shape


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # the gene vocabulary's size (`coordination.vocab.GeneVocab.size`)
    n_bins: int = 51
    d_model: int = 512
    n_layers: int = 12
    n_heads: int = 8
    d_ff: int = 512
    dropout: float = 0.0
    objective: str = "bins"  # "bins": predict masked expression bins; "genes": predict masked gene ids
    pad_token: int = PAD  # the vocabulary's special tokens (a vocabulary file has its own ids)
    mask_token: int = MASK
    special_tokens: tuple[int, ...] = (PAD, CLS, EOS, MASK)
    # attention where rows hold padding or several cells: "dense" (a mask through
    # scaled_dot_product_attention: every pair of a row computed), "flex" (packed rows: FlexAttention's
    # block mask, only blocks holding a cell's own pairs) or "varlen" (padded and packed rows: each cell
    # a sequence of its own to flash attention's varlen kernel, padding in short pieces). Rows of one whole
    # cell each have no mask: flash (or cuDNN) attention. (Named before padded rows used it too.)
    packed_attention: str = "dense"

    @classmethod
    def preset(cls, name: str, vocab_size: int, n_bins: int = 51, objective: str = "bins", **tokens) -> "ModelConfig":
        return cls(vocab_size=vocab_size, n_bins=n_bins, objective=objective, **preset_shape(name), **tokens)


ATTENTION = ("dense", "flex", "varlen")  # ModelConfig.packed_attention's choices


def attention_on(name: str, device: torch.device) -> str:
    """The attention a run's `packed_attention` setting means on `device`: "auto" is varlen where its
    kernel runs, else the dense mask; a name not in ATTENTION is refused (ValueError, the choices named)."""
    if name == "auto":
        return "varlen" if varlen_runs_on(device) else "dense"
    if name not in ATTENTION:
        raise ValueError(f"packed_attention {name!r}: choose auto or one of {', '.join(ATTENTION)}")
    return name


def varlen_runs_on(device: torch.device) -> bool:
    """Whether flash attention's varlen kernel runs on `device`: torch >= 2.9, an Ampere or newer GPU."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


@dataclass(frozen=True)
class Spans:
    """Padded or packed rows as sequences of their own (`trainer.packing.spans_of`): `bounds` (int32
    [n + 1]) cut the flattened rows into each cell's positions and pieces of each row's padding tail;
    `longest` is the longest span, known on the host."""

    bounds: torch.Tensor
    longest: int


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans) -> torch.Tensor:
    """Attention within each span of [positions, heads, head dim] q, k, v: flash attention's varlen
    kernel on CUDA; on the CPU, which has none, each span through scaled_dot_product_attention (the
    reference the tests compare with)."""
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn  # (torch >= 2.9)

        return varlen_attn(q, k, v, spans.bounds, spans.bounds, spans.longest, spans.longest)
    out = torch.empty_like(q)
    bounds = spans.bounds.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a:b] = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    return out


def cell_blocks(segments: torch.Tensor) -> BlockMask:
    """FlexAttention's block mask of packed rows: a position attends to its own cell's positions
    (padding to padding), and blocks that hold no such pair are skipped."""

    def same_cell(b, h, q, kv):
        return segments[b, q] == segments[b, kv]

    rows, width = segments.shape
    return create_block_mask(same_cell, rows, None, width, width, device=segments.device, _compile=segments.is_cuda)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """flex_attention, compiled on CUDA (its eager form computes every score: a reference, as on CPU)."""
    kernel = compiled_flex() if q.is_cuda else flex_attention
    return kernel(q, k, v, block_mask=block_mask)


@functools.cache
def compiled_flex():
    # dynamic left to torch: a packed batch's row count varies, and the first change of it compiles a
    # kernel for any count (dynamic=False compiled one per count, ~15 s each, then fell back to eager)
    return torch.compile(flex_attention)


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads = c.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ff = nn.Sequential(nn.Linear(c.d_model, c.d_ff), nn.GELU(), nn.Linear(c.d_ff, c.d_model))
        self.dropout = c.dropout

    def forward(self, x: torch.Tensor, attn_mask) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, n, 3, self.n_heads, d // self.n_heads)
        if isinstance(attn_mask, Spans):  # (packed rows, varlen: positions of all rows in one sequence axis)
            y = varlen(*(t.flatten(0, 1) for t in qkv.unbind(2)), attn_mask).view(b, n, d)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            if isinstance(attn_mask, BlockMask):  # (packed rows, FlexAttention: no dropout there)
                y = flex(q, k, v, attn_mask)
            else:
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0
                )
            y = y.transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(y)
        return x + self.ff(self.ln2(x))


class CellTransformer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        if c.dropout and c.packed_attention != "dense":  # (their kernels are called without it)
            raise ValueError(f"attention dropout is the dense path's only; packed_attention {c.packed_attention!r}")
        self.config = c
        self.gene = nn.Embedding(c.vocab_size, c.d_model, padding_idx=c.pad_token)
        # + the "masked" bin; only when bins are an input (a parameter without gradient breaks DDP)
        self.bin = nn.Embedding(c.n_bins + 1, c.d_model) if c.objective == "bins" else None
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.n_bins if c.objective == "bins" else c.vocab_size)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(
        self,
        tokens: torch.Tensor,
        bins: torch.Tensor | None,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        padded: bool = True,
        segments: torch.Tensor | None = None,
        spans: Spans | None = None,
    ) -> torch.Tensor:
        """Logits [B, K, classes] at `positions` ([B, K] indices into each cell: `masked_loss` puts
        the hidden ones first, then filler it weighs 0); inputs there are already hidden by the
        caller. A fixed K keeps every shape independent of the data, so the forward compiles to one
        graph. `padded`: whether any position is padding, decided on the host (`Batch.padded`).
        `segments` (packed rows, `trainer.packing`): each position's cell; a position attends only
        to its own cell's, so each cell is computed as it would be alone; `spans`: the rows cut into
        cells and padding, for packed_attention "varlen"."""
        x = self.gene(tokens)
        if bins is not None:  # None: a model of gene ids, or an empty batch (a rank that ran out of cells)
            x = x + self.bin(bins)
        # every query may attend to every real token; with no padding at all, no mask (flash kernels).
        # A cell with no token at all (an empty cell in a layout without specials) attends to its
        # first (padding) slot, so softmax sees one key instead of none (which would be NaN).
        mask = None
        if spans is not None and self.config.packed_attention == "varlen" and (segments is not None or padded):
            mask = spans
        elif segments is not None and self.config.packed_attention == "flex":
            mask = cell_blocks(segments)
        elif segments is not None:  # (padding attends to padding: softmax needs a key, and nothing reads it)
            mask = (segments[:, :, None] == segments[:, None, :])[:, None]
        elif padded:
            keys = attention_mask.clone()
            keys[:, 0] |= ~attention_mask.any(dim=1)
            mask = keys[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x.gather(1, positions[..., None].expand(-1, -1, x.shape[-1]))))

    def n_params(self, embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - sum(e.weight.numel() for e in (self.gene, self.bin) if e is not None)


def mask_positions(
    tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    ratio: float,
    generator: torch.Generator,
    special_tokens=(PAD, CLS, EOS, MASK),
    segments: torch.Tensor | None = None,
    n_cells: int = 0,
) -> torch.Tensor:
    """A `ratio` of each cell's gene positions (never a special token, never padding), at random:
    round(ratio x its genes), at least 1. A cell is a row, or with `segments` (packed rows) the
    positions of one segment; `n_cells`: the batch's cells (an empty cell has a number but no
    position, so there may be more cells than positions)."""
    scores = torch.rand(attention_mask.shape, generator=generator, device="cpu")  # (the same masks on any device)
    if attention_mask.is_cuda:  # (from pinned memory: a pageable copy would wait for the GPU's queued work)
        scores = scores.pin_memory().to(attention_mask.device, non_blocking=True)
    candidates = attention_mask.clone()
    for special in special_tokens:  # (scalars: a tensor of them made on the GPU would wait for its queued work)
        candidates &= tokens != special
    scores = scores.masked_fill(~candidates, 2.0)
    if segments is None:
        n = candidates.sum(dim=1, keepdim=True)
        k = (n.float() * ratio).round().clamp(min=1).minimum(n)
        return candidates & (scores.argsort(dim=1).argsort(dim=1) < k)
    # packed: rank each position within its cell, candidates first by score (one sort of cell + score)
    cell = segments.clamp(min=0).flatten()  # (padding is no candidate: its cell does not matter)
    order = (cell.double() * 4 + scores.flatten().double()).argsort()
    in_order = cell[order]
    rank = torch.empty_like(cell)
    rank[order] = torch.arange(len(cell), device=cell.device) - torch.searchsorted(in_order, in_order)
    n = torch.zeros(max(len(cell), n_cells), dtype=torch.long, device=cell.device)
    n.scatter_add_(0, cell, candidates.flatten().long())
    k = (n.float() * ratio).round().clamp(min=1).minimum(n)
    return candidates & (rank < k[cell]).view(candidates.shape)


def masked_loss(
    model: nn.Module, batch, ratio: float, generator: torch.Generator, n_bins: int, config: ModelConfig | None = None
):
    """(sum of cross-entropy over masked positions, their count, correct predictions); `config`
    names the special tokens (default: the built vocabulary's). The model predicts at K positions
    per cell, K = ceil(ratio x width) (no cell has more hidden: `mask_positions` hides round(ratio x
    its genes) <= that): the hidden ones first, then filler whose loss is set to 0. No shape here
    depends on the data (a boolean gather's would, which breaks torch.compile's graph)."""
    config = config or getattr(getattr(model, "module", model), "config", None) or ModelConfig(0)
    segments = getattr(batch, "segments", None)
    masked = mask_positions(
        batch.tokens, batch.attention_mask, ratio, generator, config.special_tokens, segments, batch.size
    )
    return loss_at(model, batch, masked, n_bins, config, ratio)


def predicted_positions(masked: torch.Tensor, ratio: float, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The K positions of each row the model predicts at ([rows, K]: the hidden ones first, then
    filler) and which of them are hidden. K depends on the width and `ratio` alone, never on the data:
    ceil(ratio x width), and for a packed row + MAX_CELLS_PER_ROW (each cell hides at most ratio x its
    genes + 1, the "at least 1")."""
    width = masked.shape[1]
    k = min(width, max(1, math.ceil(width * ratio)) + (MAX_CELLS_PER_ROW if packed else 0))
    positions = masked.to(torch.uint8).argsort(dim=1, descending=True, stable=True)[:, :k]
    return positions, masked.gather(1, positions)


def loss_at(model: nn.Module, batch, masked: torch.Tensor, n_bins: int, config: ModelConfig, ratio: float):
    """`masked_loss` at given hidden positions (`masked`, [rows, width])."""
    segments = getattr(batch, "segments", None)
    positions, hidden = predicted_positions(masked, ratio, segments is not None)
    if batch.values is not None:  # hide the bin, predict it
        tokens, bins, truth = batch.tokens, batch.values.masked_fill(masked, n_bins), batch.values
    else:  # hide the gene, predict it
        tokens, bins, truth = batch.tokens.masked_fill(masked, config.mask_token), None, batch.tokens
    target = truth.gather(1, positions)
    padded, spans = getattr(batch, "padded", True), getattr(batch, "spans", None)
    logits = model(tokens, bins, batch.attention_mask, positions, padded, segments, spans)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="none")
    loss_sum = losses.masked_fill(~hidden.flatten(), 0.0).sum()  # (masked_fill: a filler's NaN would not spread)
    correct = ((logits.argmax(dim=-1) == target) & hidden).sum()
    return loss_sum, masked.sum(), correct


def train_flops(config: ModelConfig, lengths: torch.Tensor, n_masked: int) -> float:
    """Honest training FLOPs of one step (forward + backward = 3x forward): 6 x the block matmul
    parameters x real tokens, + 6 x head parameters x masked positions (the head runs only
    there), + attention: QK^T and AV cost 4·L·d per token per layer forward, over real lengths L.
    Embedding lookups are not matmuls and are not counted."""
    d, layers = config.d_model, config.n_layers
    head = config.n_bins if config.objective == "bins" else config.vocab_size
    lengths = lengths.double()
    tokens = float(lengths.sum())
    block_params = layers * (4 * d * d + 2 * d * config.d_ff)
    attention = 3 * 4 * layers * d * float((lengths * lengths).sum())
    return 6.0 * block_params * tokens + 6.0 * d * head * n_masked + attention
