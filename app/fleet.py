"""A local campaign's producer processes: started, restarted when one dies (as Modal retries a
producer call), stopped at the end; and the producer process itself (`python -m app.fleet`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from app.config import CampaignConfig
from coordination.backends import connect
from coordination.errors import CellfeedError
from coordination.local_backend import ServerProcess
from coordination.net import exit_when_parent_goes, freeze_setup, keep_freed_memory
from coordination.routing import stop_key

STOP_GRACE_S = 10.0  # how long producers together get to stop at the end before being killed
PRODUCER_RETRIES = 3  # as the Modal producer function's retries=3
RESTART_BACKOFF_S = 1.0
USER_ERROR_EXIT = 2  # a producer or rank that stopped on a CellfeedError (restarting it would not help)


def start_producer(config_path: Path, where: dict, name: str) -> subprocess.Popen:
    """A producer process for the campaign config at `config_path`, reaching the queue server at
    `where` (`ServerProcess.where`). Its own session: a terminal's Ctrl-C reaches only the
    campaign. It ends when this process does, however this one ends (a pipe on its stdin)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.fleet",
            "--produce",
            str(config_path),
            "--address",
            where["address"],
            "--token-file",
            where.get("token_file", ""),
            "--name",
            name,
        ],
        start_new_session=True,
        stdin=subprocess.PIPE,
    )


class ProducerFleet:
    """The local producers, restarted when one dies, as Modal retries a producer call (`retries`
    times each, after RESTART_BACKOFF_S, doubling). Nothing is lost meanwhile: the driver re-issues
    the dead producer's unit once it falls silent, and consumers drop any duplicate."""

    def __init__(self, config_path: Path, where: dict, n: int, workdir: Path, retries: int = PRODUCER_RETRIES):
        self.config_path, self.where, self.workdir, self.retries = config_path, where, workdir, retries
        self.names = [f"producer-{i}" for i in range(n)]
        self.procs = [start_producer(config_path, where, name) for name in self.names]
        self.restarts = [0] * n
        self._due: list[float | None] = [None] * n  # when a dead producer is started again

    def codes(self) -> list[int | None]:
        """Each producer's exit code, None while it runs."""
        return [p.poll() for p in self.procs]

    def check(self) -> None:
        """Restart the producers that died; raise once one has died more than `retries` times."""
        now = time.monotonic()
        for i, (name, proc) in enumerate(zip(self.names, self.procs)):
            code = proc.poll()
            if code in (None, 0):
                continue
            if code == USER_ERROR_EXIT:  # a damaged or changed dataset does not mend on a restart
                raise CellfeedError(
                    f"{name} stopped on the error above; the campaign stops (checkpoints are in {self.workdir.parent})"
                )
            if self.restarts[i] >= self.retries:
                raise CellfeedError(
                    f"{name} died {self.restarts[i] + 1} times (last exit code {code}); the campaign "
                    f"stops (its output is above; checkpoints are in {self.workdir.parent})"
                )
            if self._due[i] is None:
                wait = RESTART_BACKOFF_S * 2 ** self.restarts[i]
                self._due[i] = now + wait
                print(
                    f"{name} exited with code {code}: restarting it in {wait:.0f}s "
                    f"({self.restarts[i] + 1} of {self.retries} restarts)",
                    flush=True,
                )
            elif now >= self._due[i]:
                self.procs[i] = start_producer(self.config_path, self.where, name)
                self.restarts[i] += 1
                self._due[i] = None


def stop_campaign(store, run: str, producers: list[subprocess.Popen], server: ServerProcess) -> None:
    """Stop the producers, then the queue server. Producers are stateless (a unit they hold is
    issued again by the lease), so SIGTERM ends them at once rather than after their next look at
    the stop key (a heartbeat away: seconds of every local campaign's end); the key still stops
    one that a restart brings up meanwhile."""
    try:
        store.put(stop_key(run), "stop")
    except CellfeedError:
        pass  # the server is already gone
    for p in producers:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S  # one deadline for all
    for p in producers:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    server.close()


def _produce_main(config_path: str, address: str, token_file: str, name: str) -> None:
    from producers.producer import Producer
    from producers.storage import StorageUnavailable

    keep_freed_memory()
    cfg = CampaignConfig(**json.loads(Path(config_path).read_text()))
    queue, store = connect(cfg.backend_spec("local", address=address, token_file=token_file))
    try:
        producer = Producer(cfg.producer_config(), queue, store, name=name)
        freeze_setup()
        producer.run()
    except CellfeedError as exc:  # one line; bad data or settings exit with a code that says "do not retry"
        print(f"cellfeed: error: {name}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1 if isinstance(exc, StorageUnavailable) else USER_ERROR_EXIT)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A local campaign's producer process (started by `cellfeed local`).")
    parser.add_argument("--produce", required=True, help="campaign config JSON")
    parser.add_argument("--address", required=True, help="the local queue server")
    parser.add_argument("--token-file", default="", help="the file holding the queue server's token")
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    exit_when_parent_goes()  # (started with a pipe on stdin by `start_producer`)
    try:
        _produce_main(args.produce, args.address, args.token_file, args.name)
    except CellfeedError as exc:
        print(f"cellfeed producer: error: {exc}", file=sys.stderr)
        sys.exit(2)
