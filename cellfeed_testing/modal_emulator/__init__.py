"""A Modal emulator for tests and benchmarks: modal 1.6.4's observable semantics for everything
cellfeed uses, in real processes on this machine. Not a mock: it answers what Modal's client
would answer, whatever the test wants (README.md lists each semantic point and its source).

    with ModalEmulator(tmp_path) as modal_world:
        modal_world.install()                 # this process: modal.Queue/Dict/App/... are emulated
        ...                                   # code under test calls modal as it would on Modal
        modal_world.preempt(call_id)          # SIGINT to every process of it, a grace period, the same input again
        modal_world.fault("transport", "queue", calls=20)   # the network fails (faults.py)
        modal_world.describe()                # calls and attempts, live objects, queue statistics

Function calls run in worker processes (`worker.py`) whose `import modal` is emulated too
(`boot/sitecustomize.py` on their PYTHONPATH): a body that spawns more calls, or starts its own
processes, talks to the same world.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cellfeed_testing.modal_emulator import client
from cellfeed_testing.modal_emulator.limits import DICT_ENTRY_TTL_S, MAX_REQUEST_BYTES, PARTITION_TTL_S  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
BOOT = Path(__file__).resolve().parent / "boot"


class ModalEmulator:
    def __init__(
        self,
        root: str | os.PathLike,
        *,
        clock_speed: float = 1.0,
        grace_s: float = 30.0,
        retry_delay_s: float = 1.0,
        env: dict | None = None,
        secrets: dict[str, dict] | None = None,
    ):
        """`clock_speed`: emulated seconds per real second (timeouts and expiry run on it);
        `grace_s`: how long a preempted container has after its SIGINT; `retry_delay_s`: the
        wait before a failed call's next attempt (Modal: 1 s); `env`: added to every container's
        environment; `secrets`: the Modal Secrets that exist (S22), name -> variables, which every
        container gets too. Without `secrets`, `env` is the one Secret, named $CELLFEED_SECRET
        (default "cellfeed-s3")."""
        if secrets is None:
            secrets = {os.environ.get("CELLFEED_SECRET", "cellfeed-s3"): dict(env or {})}
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.volume_dir = self.root / "volumes" / "checkpoints"
        self.volume_dir.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
        path = os.pathsep.join([str(BOOT), str(ROOT), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        secret_env = {k: v for variables in secrets.values() for k, v in variables.items()}
        container_env = {
            **base,
            **(env or {}),
            **secret_env,
            "PYTHONPATH": path,
            "HOME": str(self.root),
            "CELLFEED_CHECKPOINT_MOUNT": str(self.volume_dir),
        }
        env_file = self.root / "container-env.json"  # a file, not argv: `ps` shows argv (secrets may be in env)
        env_file.touch(mode=0o600)
        env_file.write_text(json.dumps(container_env))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cellfeed_testing.modal_emulator.server",
                "--root",
                str(self.root),
                "--clock-speed",
                str(clock_speed),
                "--grace-s",
                str(grace_s),
                "--retry-delay-s",
                str(retry_delay_s),
                "--env-file",
                str(env_file),
                *(f"--secret={name}" for name in secrets),
            ],
            cwd=str(ROOT),
            env={**base, "PYTHONPATH": path},
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening "):
            self.proc.kill()
            raise RuntimeError("the Modal emulator did not start")
        self.address = line.split()[1]
        self.env = {**container_env, "MODAL_EMULATOR": self.address}  # for processes a test starts itself
        self._saved_env: dict = {}

    # ---- this process

    def install(self) -> None:
        """Emulate modal in this process (and in processes it starts: the environment is set)."""
        for key in ("MODAL_EMULATOR", "CELLFEED_CHECKPOINT_MOUNT", "PYTHONPATH"):
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = self.env[key]
        client.install()

    # ---- what a test does to the world

    def _call(self, header: dict, wait_s: float = 0.0) -> dict:
        saved = os.environ.get("MODAL_EMULATOR")
        os.environ["MODAL_EMULATOR"] = self.address
        try:
            return client._conn.call(header, wait_s=wait_s)[0]
        finally:
            if saved is None:
                os.environ.pop("MODAL_EMULATOR", None)
            else:
                os.environ["MODAL_EMULATOR"] = saved

    def describe(self) -> dict:
        return self._call({"op": "describe"})

    def calls(self, function: str | None = None) -> list[dict]:
        return [c for c in self.describe()["calls"] if function is None or c["function"] == function]

    def preempt(self, call_id: str) -> None:
        self._call({"op": "f.preempt", "id": call_id})

    def fault(self, kind: str, target: str, **rule) -> int:
        """S21: a network fault (faults.py): `kind` transport | lost_reply | spike, `target` queue |
        dict | spawn | call, and the rule's `after`, `calls`, `seconds`, `delay_s`, `partition`,
        `op`, `surface`. It fires on the matching calls from now on; returns its index."""
        return self._call({"op": "fault.add", "rule": {"kind": kind, "target": target, **rule}})["index"]

    def faults(self) -> list[dict]:
        """Every fault rule with its state: calls seen, when it fired, hits, items lost, done."""
        return self._call({"op": "fault.list"})["rules"]

    def lose_container(self, call_id: str, rank: int) -> None:
        """A container of a clustered call's running attempt is lost (SIGKILL, no grace): S27."""
        self._call({"op": "f.lose", "id": call_id, "rank": rank})

    def fail(self, function: str, times: int) -> None:
        """The next `times` attempts of `function` fail before its body runs (an injected fault)."""
        self._call({"op": "f.fail", "function": function, "times": times})

    def advance(self, seconds: float) -> float:
        """Move the emulated clock on (expiry and function timeouts run on it)."""
        return self._call({"op": "clock.advance", "seconds": seconds})["now"]

    def close(self) -> None:
        if self._saved_env:
            client.uninstall()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def __enter__(self) -> "ModalEmulator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
