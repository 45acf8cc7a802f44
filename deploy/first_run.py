"""A first real run on Modal, in a few minutes and about a dollar, scripted end to end:

    python -m deploy.first_run --bucket s3://my-bucket/cellfeed-first-run

It checks that the Modal Secret and the checkpoints Volume are there (or can be made), says what
the run will cost and asks, makes a small synthetic atlas here and uploads it under the bucket
prefix, runs a short campaign (1 GPU, 2 producers, the tiny model, 1 epoch), checks that every
cell was trained exactly once, and deletes what it made: the uploaded atlas, the run's
checkpoints in the Volume, and its queue and dicts if the campaign did not finish (--keep keeps
them). S3 settings come from this shell's AWS_* variables, the same values as the Secret's. Its
last line says "first run: ok ..." or "first run: FAILED: <why>"; the exit code is 0 or 1.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time

# the campaign: the tiny model, 2,000 cells in 32 steps of 64, 256 genes a cell
CAMPAIGN = dict(producers=2, gpus=1, preset="tiny", epochs=1, batch_size=64, max_genes=256)
CELLS, GENES = 2_000, 2_000
MINUTES = {"train": 10, "produce": 10, "setup": 3}  # expected per container, its start included
SECRET_LINE = (
    "modal secret create {name} AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_ENDPOINT_URL=... "
    "AWS_REGION=...   (deploy/README.md, step 1)"
)


class Failed(Exception):
    """Why the first run failed, in one line."""


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run, started = time.strftime("first-run-%Y%m%d-%H%M%S"), time.monotonic()
    dataset = f"{args.bucket.rstrip('/')}/{run}"
    made: set[str] = set()  # what there is to delete: "atlas", "campaign", "finished"
    outcome = "FAILED: stopped before the end"
    try:
        missing = missing_pieces(args.bucket)
        for line in missing:
            print(line)
        if missing:
            raise Failed(f"{len(missing)} thing(s) missing (above); nothing was made or started")
        confirm(estimate(args.timeout_minutes), args.yes)
        made.add("atlas")
        make_and_upload(dataset)
        made.add("campaign")
        summary = run_campaign(run, dataset, args.timeout_minutes)
        made.add("finished")
        outcome = f"ok: run {run}, {audited_cells(summary):,} cells trained exactly once"
    except Failed as exc:
        outcome = f"FAILED: {exc}"
    except KeyboardInterrupt:
        outcome = "FAILED: interrupted"
    except Exception as exc:  # noqa: BLE001 - whatever it was, in one line
        outcome = f"FAILED: {type(exc).__name__}: {last_line(exc)}"
    finally:
        if made and args.keep:
            print(f"kept (--keep): {dataset}, the Volume's /{run}, the run's queue and dicts if any")
        elif made:
            problems = clean_up(run, dataset, made)
            if problems and outcome.startswith("ok"):
                outcome = "FAILED: the run was ok, but " + "; ".join(problems)
    print(
        f"first run: {outcome} in {time.monotonic() - started:.0f} s wall time"
        if outcome.startswith("ok")
        else f"first run: {outcome}",
        flush=True,
    )
    return 0 if outcome.startswith("ok") else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.first_run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bucket",
        required=True,
        metavar="s3://BUCKET/PREFIX",
        help="where the synthetic atlas goes, under PREFIX/first-run-<timestamp> (deleted at the end)",
    )
    parser.add_argument("--yes", action="store_true", help="start without asking (after printing the cost estimate)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="delete nothing at the end: the atlas, the checkpoints, a failed run's queue and dicts",
    )
    parser.add_argument(
        "--timeout-minutes",
        type=float,
        default=30.0,
        help="stop the campaign after this long (its Modal app stops with it; default 30)",
    )
    args = parser.parse_args(argv)
    if not args.bucket.startswith("s3://") or len(args.bucket.rstrip("/")) <= len("s3://"):
        parser.error(f"--bucket {args.bucket!r}: expected s3://bucket/prefix")
    return args


def missing_pieces(bucket: str) -> list[str]:
    """One line for each thing the run needs and does not have, saying what to run."""
    import os

    import modal
    import modal.exception

    from app.modal_app import SECRET_NAME, VOLUME_NAME
    from coordination.errors import CellfeedError
    from producers.storage import location

    lines = []
    if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        lines.append(
            "S3 settings: this shell has no AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY: export them (and "
            "AWS_ENDPOINT_URL, AWS_REGION for Tigris or R2), the same values as the Modal Secret's"
        )
    else:
        try:
            location(bucket).check_reachable(for_write=True)
        except CellfeedError as exc:
            lines.append(f"the bucket: {exc}")
    try:
        modal.Secret.from_name(SECRET_NAME).hydrate()
    except modal.exception.NotFoundError:
        lines.append(f"the Modal Secret {SECRET_NAME!r} is missing: run  {SECRET_LINE.format(name=SECRET_NAME)}")
    except modal.exception.AuthError:
        return lines + ["Modal: this machine is not logged in to Modal: run  modal setup"]
    except modal.exception.Error as exc:
        return lines + [f"Modal is unreachable ({type(exc).__name__}: {last_line(exc)}): see `modal profile current`"]
    try:
        modal.Volume.from_name(VOLUME_NAME, create_if_missing=True).hydrate()
    except modal.exception.Error as exc:
        lines.append(
            f"the Modal Volume {VOLUME_NAME!r} is missing and could not be made ({type(exc).__name__}: "
            f"{last_line(exc)}): run  modal volume create {VOLUME_NAME}"
        )
    return lines


def estimate(timeout_minutes: float) -> str:
    """This run's cost, from app/costs.py's prices and what app/modal_app.py's functions ask for."""
    from app.costs import TRAINER_CPU, TRAINER_MEMORY_MB, functions_per_hour

    rate, n = functions_per_hour(CAMPAIGN["gpus"]), CAMPAIGN["producers"]
    expected = (
        rate["train"] * MINUTES["train"] + n * rate["produce"] * MINUTES["produce"] + rate["setup"] * MINUTES["setup"]
    ) / 60
    most = (rate["train"] + n * rate["produce"]) * timeout_minutes / 60 + rate["setup"] * MINUTES["setup"] / 60
    return (
        f"this run costs about ${expected:.2f}: {CAMPAIGN['gpus']} x H100 with {TRAINER_CPU:g} cores and "
        f"{TRAINER_MEMORY_MB // 1024} GiB (${rate['train']:.2f}/hour) and {n} producers "
        f"(${rate['produce']:.2f}/hour each) for ~{MINUTES['train']} minutes, setup for ~{MINUTES['setup']}; "
        f"at most ${most:.2f} if it runs until --timeout-minutes {timeout_minutes:g}"
    )


def confirm(cost: str, yes: bool) -> None:
    print(cost, flush=True)
    try:
        answer = "yes" if yes else input("start it? [y/N] ")
    except EOFError:
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise Failed("not started: not confirmed (--yes starts without asking)")


def make_and_upload(dataset: str) -> None:
    """The synthetic atlas, made in a temporary folder and uploaded as deploy/upload.py does."""
    from coordination.errors import CellfeedError
    from deploy.upload import upload
    from producers.synth import SynthSpec, synthesize

    with tempfile.TemporaryDirectory(prefix="cellfeed-first-run-") as tmp:
        print(f"making a synthetic atlas of {CELLS:,} cells x {GENES:,} genes; uploading it to {dataset}", flush=True)
        synthesize(
            f"{tmp}/atlas",
            SynthSpec(n_cells=CELLS, n_genes=GENES, median_nnz=300, seed=1),
            rows_per_fragment=200_000,
            progress=False,
        )
        try:
            upload(f"{tmp}/atlas", dataset)
        except CellfeedError as exc:
            raise Failed(f"upload: {exc}") from None


def run_campaign(run: str, dataset: str, timeout_minutes: float) -> dict:
    """The app's own `modal run` entrypoint, called inside `app.run()` as a script must, stopped
    (SIGALRM) after `timeout_minutes`."""
    import modal

    from app import modal_app
    from app.modal_calls import CallFailed

    def too_long(*_):
        raise KeyboardInterrupt  # as a Ctrl-C would: the entrypoint stops, and the app with it

    flags = dict(dataset=dataset, run=run, **CAMPAIGN)
    print("campaign: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items()), flush=True)
    previous, started = signal.signal(signal.SIGALRM, too_long), time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, timeout_minutes * 60)
    try:
        with modal.enable_output(), modal_app.app.run():
            return modal_app.main.info.raw_f(**flags)
    except BaseException as exc:  # the entrypoint printed its error (and a resume command: all is deleted instead)
        if time.monotonic() - started >= timeout_minutes * 60:
            raise Failed(f"the campaign did not finish within --timeout-minutes {timeout_minutes:g}") from None
        cause = exc.__context__ if isinstance(exc, SystemExit) and exc.__context__ else exc  # (its error, `from None`)
        if isinstance(cause, KeyboardInterrupt):
            raise Failed("interrupted") from None
        said = str(cause) if isinstance(cause, CallFailed) else f"{type(cause).__name__}: {last_line(cause)}"
        raise Failed(f"the campaign failed: {said}") from None  # (a call's end names what the call raised)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def audited_cells(summary: dict) -> int:
    """The cells trained, once each epoch's exactly-once audit is clean (trainer/exactly_once.py: audit_epoch)."""
    audits, epochs = summary.get("audits") or [], CAMPAIGN["epochs"]
    clean = [a for a in audits if a.get("audited") and a.get("missing") == 0 and a.get("duplicated") == 0]
    if not summary.get("complete") or len(audits) != epochs or len(clean) != epochs:
        raise Failed(
            f"the exactly-once audit: {len(clean)} of {epochs} epoch(s) audited clean "
            f"({'; '.join(a.get('line', '?') for a in audits) or 'no audit came back'})"
        )
    cells = sum(a["cells"] for a in clean)
    print(f"audit: {epochs} epoch(s) audited, {cells:,} cells trained, 0 missing, 0 duplicated", flush=True)
    return cells


def clean_up(run: str, dataset: str, made: set[str]) -> list[str]:
    """Delete what the run made; returns what could not be deleted (one phrase each)."""
    import modal

    from app.modal_app import VOLUME_NAME
    from coordination.modal_backend import delete_run_backends
    from producers.storage import location

    steps = [(f"the atlas at {dataset}", lambda: location(dataset).delete())]
    if "campaign" in made:
        steps.append(
            (
                f"the checkpoints /{run} in the Volume {VOLUME_NAME}",
                lambda: modal.Volume.from_name(VOLUME_NAME).remove_file(f"/{run}", recursive=True),
            )
        )
    if "campaign" in made and "finished" not in made:  # (a finished campaign deleted them itself)
        steps.append(("the run's queue and dicts", lambda: delete_run_backends(run, CAMPAIGN["epochs"], retry_s=120.0)))
    problems = []
    for what, delete in steps:
        try:
            delete()
            print(f"deleted {what}", flush=True)
        except FileNotFoundError:
            print(f"{what}: none were written", flush=True)
        except Exception as exc:  # noqa: BLE001 - say it and go on deleting the rest
            problems.append(f"{what} could not be deleted ({type(exc).__name__}: {last_line(exc)})")
            print(problems[-1], flush=True)
    return problems


def last_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[-1]


if __name__ == "__main__":
    sys.exit(main())
