"""What a dataset or a corpus file holds, said in lines (`cellfeed inspect`)."""

from __future__ import annotations


def describe(ds, n_values: int = 3) -> str:
    """A human-readable summary of a dataset."""
    straddling = ds.straddling_cells()
    sizes = [f.row_end - f.row_start for f in ds.fragments]
    lines = [
        f"dataset     {ds.uri}",
        f"format      SLAF {ds.config.get('format_version', '?')}",
        f"cells       {ds.n_cells:,}",
        f"genes       {ds.n_genes:,}",
        f"non-zeros   {ds.n_rows:,} ({ds.n_rows / max(1, ds.n_cells):,.0f} per cell, values {ds.value_type})",
        f"fragments   {len(sizes)} (rows per fragment: min {min(sizes, default=0):,}, max {max(sizes, default=0):,})",
        f"straddling  {len(straddling):,} cells cut by a fragment boundary",
    ]
    # var too: its columns are what `--gene-column` (a corpus's `gene_column`) may name, and the
    # example values show which one holds the identifiers a vocabulary uses (Ensembl ids, symbols)
    for title, table, names in (
        ("obs columns:", ds.cells, ds.obs_columns),
        ("var columns (gene_column names one):", ds.genes, ds.genes.schema.names),
    ):
        lines.append(title)
        head = table.head(max(n_values, 1)).to_pydict()
        for name in names:
            shown = ", ".join(repr(v) for v in head[name][:n_values])
            lines.append(f"  {name:<20} {str(table.schema.field(name).type):<10} {shown}".rstrip())
    return "\n".join(lines)


def describe_corpus(path: str) -> str:
    """Per source of a corpus file: cells, genes in the vocabulary, non-zeros kept, quota per epoch."""
    from coordination.corpus_file import CorpusSpec, quotas
    from producers.sources import attach_vocab, campaign_vocab, coverage, open_sources

    spec = CorpusSpec.read(path)
    sources = open_sources(spec)
    vocab = campaign_vocab(spec, sources)
    attach_vocab(sources, vocab)
    size = spec.epoch_cells or sum(s.n_selected for s in sources)
    shares = quotas([s.spec.weight for s in sources], size)
    lines = [
        f"corpus      {path}: {len(sources)} sources, {size:,} cells per epoch",
        f"vocabulary  {vocab.origin}: {vocab.n_genes:,} genes, {vocab.size:,} token ids",
        f"{'source':<16} {'weight':>6} {'cells':>12} {'selected':>12} {'genes matched':>18} "
        f"{'non-zeros kept':>14} {'per epoch':>12} {'passes':>7}",
    ]
    for s, q in zip(sources, shares):
        c = coverage(s)
        lines.append(
            f"{s.spec.name:<16} {s.spec.weight:>6g} {s.ds.n_cells:>12,} {s.n_selected:>12,} "
            f"{f'{c.genes_matched:,} / {c.genes:,}':>18} {c.nonzeros_kept:>14.1%} {int(q):>12,} "
            f"{q / max(1, s.n_selected):>7.2f}"
        )
    return "\n".join(lines)
