"""Checkpoints: model, optimizer, scheduler, step, epoch, and per rank what it has trained on.

Layout: `DIR/step-00000120/` holds `state.pt` (tensors only; loaded with weights_only=True) and
`progress-rank{r}.json` per rank (the current epoch's fully consumed item keys, the cells
already trained of partly consumed items, and how many cells the rank has trained this epoch).
Every rank writes its file into a hidden `.step-…tmp` folder; after a barrier rank 0 writes the
state, renames the folder into place and then points `DIR/latest` at it, so a crash at any
moment leaves the previous checkpoint intact. A copy made file by file while a checkpoint is written
(a Volume commit beside the ranks) can carry the new pointer without its whole folder: a resume
then continues from the newest whole checkpoint and says which one it passed over (`newest_whole`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from coordination.audit import cells_hash
from coordination.errors import CellfeedError
from coordination.summary import load_summary


def _key(k) -> tuple:
    return tuple(k)


@dataclass
class RankProgress:
    """What one rank has trained on in the current epoch."""

    epoch: int = 0
    trained: int = 0
    consumed: set = field(default_factory=set)  # item keys whose every cell was trained on
    partial: dict = field(default_factory=dict)  # item key -> cell ids trained so far
    cells_hash: int | None = 0  # `coordination.audit.cells_hash` of the cells trained (None: unknown, not audited)
    unit_items: dict = field(default_factory=dict)  # unit -> how many items it has (seen complete ones)
    plan_id: str = ""  # the epoch's plan (a resume must find the same)
    unit_trained: dict = field(default_factory=dict)  # unit -> its cells trained (stitched cells apart)
    # cells trained in this epoch before a resume, and their hash (rank 0 holds them; 0 elsewhere):
    # the epoch's audit then checks every rank's cells together
    carried: int = 0
    carried_hash: int | None = 0
    data_id: str = (
        ""  # the data the run trains on (`Dataset.identity`, every source's): a resume onto other data is refused
    )
    labels: dict = field(default_factory=dict)  # label (balanced: class) -> cells trained; totals, as `trained`

    def record(self, batch) -> None:
        self.trained += batch.size
        self.unit_items.update(batch.unit_items)
        for unit, n in batch.unit_cells.items():
            self.unit_trained[unit] = self.unit_trained.get(unit, 0) + n
        if self.cells_hash is not None:
            self.cells_hash = (self.cells_hash + cells_hash(batch.cell_ids.numpy())) % 2**64
        if batch.labels is not None:  # the class mix trained (balanced sampling carries each cell's class)
            for label, n in Counter(batch.labels.tolist()).items():
                self.labels[label] = self.labels.get(label, 0) + n
        for key in batch.completed:
            self.consumed.add(key)
            self.partial.pop(key, None)
        for key, cells in batch.cells_of_partial.items():
            self.partial.setdefault(key, set()).update(cells)

    def next_epoch(self, epoch: int) -> None:
        self.epoch, self.trained, self.consumed, self.partial, self.cells_hash = epoch, 0, set(), {}, 0
        self.unit_items, self.plan_id, self.unit_trained, self.carried, self.carried_hash = {}, "", {}, 0, 0
        self.labels = {}
        # (data_id stays: it is the run's, not the epoch's)

    @classmethod
    def merged(cls, ranks: list["RankProgress"]) -> "RankProgress":
        """What a resumed run starts the epoch from, whatever the number of ranks that wrote the
        checkpoint: all their item keys and partial items (a unit's items now go to rank u mod the
        new world size), the cells trained per unit, and the cells trained in all with their hash,
        carried for the epoch's audit (`without_totals` for every rank but one)."""
        out = cls(ranks[0].epoch, plan_id=ranks[0].plan_id, data_id=ranks[0].data_id)
        hashes = [r.cells_hash for r in ranks] + [r.carried_hash for r in ranks]
        for r in ranks:  # (after an earlier resume every rank holds the keys it started from: sets)
            out.consumed |= r.consumed
            for key, cells in r.partial.items():
                out.partial.setdefault(key, set()).update(cells)
            out.unit_items.update(r.unit_items)
            for unit, n in r.unit_trained.items():
                out.unit_trained[unit] = out.unit_trained.get(unit, 0) + n
            for label, n in r.labels.items():
                out.labels[label] = out.labels.get(label, 0) + n
        for key in out.consumed & out.partial.keys():
            del out.partial[key]
        out.carried = sum(r.trained + r.carried for r in ranks)
        out.carried_hash = None if None in hashes else sum(hashes) % 2**64
        return out

    def without_totals(self) -> "RankProgress":
        """The same keys and partial items, no counts: what ranks other than 0 resume from (the
        counts are summed once, so one rank carries them)."""
        return replace(self, unit_trained={}, carried=0, carried_hash=0, labels={})

    def done_units(self) -> set[int]:
        """Units of this epoch whose every item was trained on."""
        return {
            u
            for u, n in self.unit_items.items()
            if all((self.epoch, "unit", u, seq) in self.consumed for seq in range(n))
        }

    def trained_stitched(self) -> set[int]:
        """Stitched (boundary) cells of this epoch that were trained on."""
        return {k[2] for k in self.consumed if k[1] == "cell"}

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "trained": self.trained,
                "cells_hash": self.cells_hash,
                "unit_items": sorted(self.unit_items.items()),
                "plan_id": self.plan_id,
                "unit_trained": sorted(self.unit_trained.items()),
                "carried": self.carried,
                "carried_hash": self.carried_hash,
                "data_id": self.data_id,
                "labels": sorted(self.labels.items()),
                "consumed": sorted(list(k) for k in self.consumed),
                "partial": [[list(k), sorted(v)] for k, v in self.partial.items()],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "RankProgress":
        d = json.loads(text)
        return cls(
            d["epoch"],
            d["trained"],
            {_key(k) for k in d["consumed"]},
            {_key(k): set(v) for k, v in d["partial"]},
            d.get("cells_hash"),  # a checkpoint from before the audit: this epoch is not audited
            dict((u, n) for u, n in d.get("unit_items", [])),
            d.get("plan_id", ""),
            dict((u, n) for u, n in d.get("unit_trained", [])),
            d.get("carried", 0),
            d.get("carried_hash", 0),
            d.get("data_id", ""),
            dict((k, n) for k, n in d.get("labels", [])),
        )


@dataclass
class Checkpoint:
    step: int
    epoch: int
    state: dict
    ranks: list[RankProgress]


def save(
    directory: str | os.PathLike,
    step: int,
    epoch: int,
    rank: int,
    world: int,
    progress: RankProgress,
    state_fn,
    gather,
    barrier,
    *,
    keep: int = 2,
    eval_loss: float | None = None,
) -> None:
    """Collective: every rank calls it. Rank 0 writes the whole checkpoint: every rank's progress
    (`gather(text)`: every rank's text, a collective) and `state_fn()`'s tensors. Only rank 0
    writes, because on several nodes the ranks of another node write to another container's copy
    of the Volume, which this one sees only after that container commits and this one reloads
    (modal/volume.py: commit, reload). Afterwards only the last `keep` checkpoints and the one with
    the lowest `eval_loss` (the held-out loss when it was written, if any) are kept."""
    root = Path(directory)
    texts = gather(progress.to_json())
    if rank == 0:
        import torch  # (here: orchestrators read checkpoints' progress without importing torch)

        tmp = root / f".step-{step:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for r, text in enumerate(texts):
            (tmp / f"progress-rank{r}.json").write_text(text)
        torch.save({"step": step, "epoch": epoch, "world": world, **state_fn()}, tmp / "state.pt")
        meta = {"step": step, "epoch": epoch, "eval_loss": eval_loss, "world": len(texts)}
        (tmp / "meta.json").write_text(json.dumps(meta))
        final = root / f"step-{step:08d}"
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        prune(root, keep)
    barrier()


def prune(root: Path, keep: int) -> list[str]:
    """Remove checkpoints but the last `keep` and the best by held-out loss; returns the removed."""
    folders = sorted(root.glob("step-*"))
    losses = {}
    for f in folders:
        meta = f / "meta.json"
        loss = json.loads(meta.read_text()).get("eval_loss") if meta.exists() else None
        if loss is not None:
            losses[f] = loss
    kept = set(folders[-keep:]) | ({min(losses, key=losses.get)} if losses else set())
    removed = [f for f in folders if f not in kept]
    for f in removed:
        shutil.rmtree(f, ignore_errors=True)
    return [f.name for f in removed]


@dataclass
class Latest:
    """Where the latest checkpoint is and what it holds, read without loading its tensors."""

    folder: Path
    step: int
    epoch: int
    trained: list[int]  # cells trained this epoch, per rank
    plan_id: str = ""  # the plan of the epoch it was trained on
    data_id: str = ""  # the data it was trained on (`RankProgress.data_id`)
    passed_over: str = ""  # a line naming a newer checkpoint that was not whole (`newest_whole`)


def whole(folder: Path) -> bool:
    """Every file `save` writes is in `folder` (the ranks' files counted by its meta.json)."""
    try:
        world = json.loads((folder / "meta.json").read_text()).get("world", 1)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return False
    return (folder / "state.pt").exists() and all((folder / f"progress-rank{r}.json").exists() for r in range(world))


def newest_whole(root: Path) -> tuple[Path | None, str]:
    """The checkpoint a resume continues from: the one `latest` names, or if that one is not whole (a
    commit that copied the pointer before the folder) the newest whole one, with a line saying so.
    None if there is no pointer; an error if no checkpoint is whole."""
    pointer = root / "latest"
    if not pointer.exists():
        return None, ""
    named = root / pointer.read_text().strip()
    if whole(named):
        return named, ""
    older = [f for f in sorted(root.glob("step-*"), reverse=True) if f.name < named.name and whole(f)]
    if not older:
        raise CellfeedError(
            f"the latest checkpoint, {named}, is incomplete and no earlier one is whole: its files were "
            "not all saved or copied; start the run again without --resume, or under a new --run"
        )
    return older[0], f"the latest checkpoint, {named.name}, is incomplete: resuming from {older[0].name}"


def latest(directory: str | os.PathLike) -> Latest | None:
    folder, passed_over = newest_whole(Path(directory))
    if folder is None:
        return None
    ranks = [RankProgress.from_json(f.read_text()) for f in sorted(folder.glob("progress-rank*.json"))]
    step = int(folder.name.removeprefix("step-"))
    return Latest(
        folder,
        step,
        ranks[0].epoch if ranks else 0,
        [r.trained + r.carried for r in ranks],
        ranks[0].plan_id if ranks else "",
        ranks[0].data_id if ranks else "",
        passed_over,
    )


def latest_meta(directory: str | os.PathLike) -> Latest | None:
    """The latest checkpoint's folder, step and epoch from its pointer and meta.json alone (no rank's
    progress: a monitor reads this every few seconds); None if there is none, or it was just pruned."""
    root = Path(directory)
    try:
        folder = root / (root / "latest").read_text().strip()
        meta = json.loads((folder / "meta.json").read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    return Latest(folder, int(meta["step"]), int(meta["epoch"]), [])


def check_same_data(step: int, trained_on: str, this: str) -> None:
    """A resume continues on the data its checkpoint was trained on (`Dataset.identity`): refused
    in one line otherwise, whatever the epoch (a run's plan id is empty between epochs). Checked by
    `cellfeed local` before it starts any process, and by every rank."""
    if trained_on and this and trained_on != this:
        raise CellfeedError(
            f"--resume: the checkpoint at step {step:,} was trained on other data ({trained_on}); this "
            f"campaign's is {this}: resume with the data it was trained on, or start a new --run"
        )


def check_same_plan(step: int, epoch: int, trained_on: str, store, run: str, epochs: int) -> None:
    """A resume continues the plan its checkpoint (at `step`, inside `epoch`) was trained on: the
    run's published plan of that epoch must be the same (same dataset, sampling, seed, splits).
    Checked by `cellfeed local` before it starts any process, and by every rank."""
    if trained_on and epoch < epochs and load_summary(store, run, epoch).plan_id != trained_on:
        raise CellfeedError(
            f"--resume: epoch {epoch}'s plan differs from the one the checkpoint at step {step} was "
            "trained on: the dataset, sampling, seed or splits changed; resume with the run's own "
            "settings, or start a new --run"
        )


def load(directory: str | os.PathLike, device) -> Checkpoint | None:
    """The checkpoint to resume from (`newest_whole`: its ranks' progress, as many as wrote it), or None."""
    folder, _ = newest_whole(Path(directory))
    if folder is None:
        return None
    import torch

    state = torch.load(folder / "state.pt", map_location=device, weights_only=True)
    ranks = [RankProgress.from_json((folder / f"progress-rank{r}.json").read_text()) for r in range(state["world"])]
    return Checkpoint(int(state["step"]), int(state["epoch"]), state, ranks)
