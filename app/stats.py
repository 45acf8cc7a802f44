"""`cellfeed stats`: Geneformer's gene medians of a dataset (stored with it) or of a corpus (a
median dictionary), or with --balance-by the class mix balanced sampling would plan."""

from __future__ import annotations

import numpy as np

from coordination.errors import CellfeedError


def cmd_stats(args) -> int:
    from producers.dataset import open_dataset
    from producers.gene_stats import compute_gene_medians, store_gene_stats

    if args.balance_by:
        return class_stats(args)
    if args.subset_filter:  # (it was dropped: gene medians are of every cell)
        raise CellfeedError(f"--subset-filter {args.subset_filter}: only with --balance-by (medians are of every cell)")
    if args.dataset.endswith(".toml"):
        return corpus_stats(args)
    if args.out:  # (it was dropped: a dataset's medians are stored in it)
        raise CellfeedError(f"--out {args.out}: only with a corpus; a dataset's medians are stored in it")
    ds = open_dataset(args.dataset)
    medians = compute_gene_medians(ds, progress=not args.quiet)
    store_gene_stats(ds, medians)
    expressed = medians > 0
    typical = float(np.median(medians[expressed])) if expressed.any() else 0.0
    print(
        f"stored the non-zero medians of normalised counts (x / cell total * 10,000) of {int(expressed.sum()):,} "
        f"expressed genes (of {ds.n_genes:,}) in {ds.uri}/gene_stats.lance; median of medians {typical:.3g}"
    )
    return 0


def class_stats(args) -> int:
    """The class mix balanced sampling would plan: per class of --balance-by, its cells in the data
    (after --subset-filter, or each corpus source's filters) and its cells per epoch at
    --balance-power, with how often each of its cells comes per epoch."""
    from coordination.balance import Balance
    from coordination.corpus_file import CorpusSpec, Mixtures
    from producers.sources import balance_strata, open_sources, source_quotas

    balance = Balance(args.balance_by, args.balance_power).validate()
    corpus = args.dataset.endswith(".toml")
    if corpus and args.subset_filter:  # (as `cellfeed local` refuses it: a corpus's sources carry their own)
        raise CellfeedError(
            f"--subset-filter {args.subset_filter}: with a corpus, give it per source in the corpus file"
        )
    spec = CorpusSpec.read(args.dataset) if corpus else CorpusSpec.single(args.dataset, args.subset_filter)
    sources = open_sources(spec, verify=False)
    strata = balance_strata(sources, balance)
    mixtures = Mixtures([(0, spec)]) if corpus else None
    planned = strata.class_mix(source_quotas(sources, mixtures, 0))
    in_data = strata.class_totals(strata.counts)
    total, epoch = int(in_data.sum()), sum(n for _, n in planned)
    print(
        f"{args.dataset}: {len(planned)} classes of {args.balance_by}, ALPHA {balance.power:g}, "
        f"{epoch:,} cells per epoch"
    )
    width = max(len("class"), *(len(name) for name, _ in planned))
    print(f"{'class':<{width}} {'in data':>12} {'share':>7} {'per epoch':>12} {'share':>7} {'x per epoch':>11}")
    for (name, n), d in sorted(zip(planned, in_data.tolist()), key=lambda t: -t[1]):
        print(f"{name:<{width}} {d:>12,} {d / total:>7.2%} {n:>12,} {n / epoch:>7.2%} {n / d:>11.2f}")
    return 0


def corpus_stats(args) -> int:
    """Geneformer's medians over a whole corpus, per vocabulary gene, as a median dictionary
    (JSON, identifier -> median) for `--gene-medians`."""
    import json
    from pathlib import Path

    from coordination.corpus_file import CorpusSpec
    from producers.gene_stats import compute_gene_medians
    from producers.sources import attach_vocab, campaign_vocab, open_sources

    if not args.out:
        raise CellfeedError(
            "over a corpus, give --out FILE.json: the median dictionary to write (then train with "
            "--gene-medians FILE.json)"
        )
    spec = CorpusSpec.read(args.dataset)
    sources = open_sources(spec)
    vocab = campaign_vocab(spec, sources)
    attach_vocab(sources, vocab)
    medians = compute_gene_medians([(s.ds, s.gene_tokens) for s in sources], progress=not args.quiet, n_out=vocab.size)
    names = {i: g for g, i in vocab.ids.items()}
    out = {names[i]: float(m) for i, m in enumerate(medians) if m > 0 and i in names}
    Path(args.out).write_text(json.dumps(out))
    print(
        f"wrote the non-zero medians of normalised counts of {len(out):,} expressed vocabulary genes over "
        f"{len(sources)} sources to {args.out} (use it with --gene-medians)"
    )
    return 0
