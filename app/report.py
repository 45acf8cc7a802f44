"""`cellfeed report`: one self-contained HTML page about a run (inline SVG plots drawn by matplotlib,
no script or network needed to view it): loss; cells/s and each rank's data wait; queue depth;
producer throughput; the campaign's events (starts, resumes, stops, producer restarts, failures) on
a timeline; the per-epoch exactly-once audit; then the campaign's settings and its cost at Modal's
prices.

It reads what the run wrote in its folder: the TensorBoard event files (tb/: the trainer's and the
monitor's scalars, read with TensorBoard's own reader), events.jsonl and state.json (`app.journal`),
and campaign.json. A Modal campaign keeps the same files in its checkpoint folder on the Volume:
`modal volume get cellfeed-checkpoints RUN runs/RUN`, then `cellfeed report RUN`."""

from __future__ import annotations

import html
import io
import json
import time
from pathlib import Path

from app.status import steps_of
from coordination.errors import CellfeedError


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in `tb_dir` (a resumed run's steps trained again
    replace their first values)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every value
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: sorted(values.items()) for tag, values in out.items()}


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # (inline: without the XML prologue)


def _lines(title: str, ylabel: str, series: dict[str, list[tuple[int, float]]], xlabel: str = "step") -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    for label, points in series.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=label, linewidth=1.2, marker="." if len(xs) < 60 else None)  # (sparse: its points)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if not any(series.values()):
        ax.text(0.5, 0.5, "no data recorded", ha="center", va="center", transform=ax.transAxes)
    elif len(series) > 1:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _svg(fig)


def _timeline(events: list[dict]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.4))
    kinds = sorted({e["event"] for e in events})
    t0 = events[0]["t"] if events else 0.0
    for e in events:
        y = kinds.index(e["event"])
        ax.plot([(e["t"] - t0) / 60], [y], "o", color="C3" if e["event"] in ("failed", "interrupted") else "C0")
        ax.annotate(
            f"step {e.get('step', '')}", ((e["t"] - t0) / 60, y), fontsize=6, xytext=(3, 3), textcoords="offset points"
        )
    ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
    ax.set(title="events: starts, resumes, stops, producer restarts, failures", xlabel="minutes since the first start")
    ax.grid(alpha=0.3)
    return _svg(fig)


def _audits(audits: list[dict], planned: int) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.6))
    epochs = [a["epoch"] for a in audits]
    ax.bar(
        epochs,
        [a["cells"] for a in audits],
        color=["C2" if a.get("missing") == 0 and a.get("duplicated") == 0 else "C3" for a in audits],
    )
    ax.axhline(planned, color="k", linestyle="--", linewidth=1, label=f"planned: {planned:,} cells")
    for a in audits:
        ax.annotate(
            f"{a.get('missing', '?')} missing, {a.get('duplicated', '?')} dup.",
            (a["epoch"], a["cells"]),
            ha="center",
            fontsize=7,
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.set(title="exactly-once audit per epoch", xlabel="epoch", ylabel="cells trained")
    ax.set_xticks(epochs or [0])
    ax.legend(fontsize=7, loc="lower right")
    return _svg(fig)


def write_report(folder: Path, out: Path) -> int:
    """Write the page; returns the number of plots."""
    import matplotlib

    matplotlib.use("svg")  # (no display needed)

    state_path = folder / "state.json"
    if not state_path.exists():
        raise CellfeedError(f"{folder} has no state.json: it is not a run folder, or the run predates reports")
    state = json.loads(state_path.read_text())
    events = (
        [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
        if (folder / "events.jsonl").exists()
        else []
    )
    settings = json.loads((folder / "campaign.json").read_text()) if (folder / "campaign.json").exists() else {}
    values = scalars(folder / "tb") if (folder / "tb").is_dir() else {}

    def pick(prefix: str) -> dict:
        return {tag.removeprefix(prefix): pts for tag, pts in values.items() if tag.startswith(prefix)}

    plots = [
        _lines(
            "loss",
            "masked-token loss",
            {"train": values.get("train/loss", []), "held-out": values.get("eval/eval_loss", [])},
        ),
        _lines("throughput", "cells/s", {"cells/s (all ranks)": values.get("train/cells_per_s", [])}),
        _lines("data wait per rank", "ms waiting for the batch", pick("data_wait_ms/")),
        _lines("queue depth (and cells decoded in the ranks' buffers)", "items / tasks / cells", pick("queue/")),
        _lines("producer throughput", "cells made per second", pick("producers/")),
        _timeline(events),
        _audits(state.get("audits", []), state.get("cells_per_epoch", 0)),
    ]
    cost = modal_cost(events, state, settings)
    rows = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in sorted(settings.items())
        if v not in (None, "", [], {})
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>cellfeed report: {html.escape(state["run"])}</title>
<style>body{{font-family:sans-serif;max-width:60rem;margin:2rem auto;color:#222}} figure{{margin:1rem 0}}
table{{border-collapse:collapse;font-size:.8rem}} td{{border:1px solid #ccc;padding:.15rem .4rem}}</style></head>
<body>
<h1>cellfeed run {html.escape(state["run"])}: {html.escape(state["state"])}</h1>
<p>{state["epochs"]} epoch(s) of {state["cells_per_epoch"]:,} cells; step {state["step"]:,} of {steps_of(state)};
report written {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}.</p>
{"".join(f'<figure class="plot">{svg}</figure>' for svg in plots)}
<h2>Cost at Modal's prices</h2><p>{html.escape(cost)}</p>
<h2>Settings</h2><table>{rows}</table>
</body></html>
"""
    out.write_text(page)
    return len(plots)


def modal_cost(events: list[dict], state: dict, settings: dict) -> str:
    """What the run's wall time would cost on Modal (app/costs.py): `train` on its GPUs and its producers."""
    from app.costs import functions_per_hour

    spans, start = 0.0, None
    for e in events:  # a run's time: from each start or resume to its next event that ends one (or the next start)
        if start is not None and e["event"] not in ("stop asked", "producer restarted"):
            spans, start = spans + e["t"] - start, None
        if e["event"] in ("started", "resumed"):
            start = e["t"]
    gpus, nodes, producers = settings.get("gpus", 1), settings.get("nodes", 1), settings.get("producers", 1)
    rate = functions_per_hour(gpus)
    per_hour = nodes * rate["train"] + producers * rate["produce"]
    return (
        f"{spans / 60:.1f} min of campaign time; on Modal, {nodes} x {gpus} H100 train and {producers} producers cost "
        f"${per_hour:.2f}/hour: about ${per_hour * spans / 3600:.2f} for this run's time (an estimate: a GPU "
        "runs faster than the ranks of a local run)."
    )
