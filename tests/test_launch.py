"""The rank server (trainer/launch.py): ranks forked from one process that imported torch once,
seen from the launcher as processes with exit codes, output where it was sent, and signals that
reach only a rank that has not been reaped."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from coordination.errors import CellfeedError
from tests.conftest import wait_for
from trainer.config import STOP_SIGNAL
from trainer.launch import RankServer


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _session(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


@pytest.fixture
def server():
    server = RankServer()  # its own, not this process's shared one: the test ends it
    yield server
    server.proc.kill()
    server.proc.wait(timeout=30)


def test_a_rank_reports_its_exit_code_and_writes_where_it_was_sent(server, tmp_path):
    log = tmp_path / "rank.log"
    with open(log, "w") as out:
        missing = server.start(["--config", str(tmp_path / "missing.json")], dict(os.environ), out.fileno(),
                               out.fileno())
        usage = server.start(["--config", "x", "--no-such-flag"], dict(os.environ), out.fileno(), out.fileno())
    assert missing.wait(timeout=60) == 1  # an uncaught error: its traceback, exit 1 (as the interpreter)
    assert usage.wait(timeout=60) == 2  # argparse's SystemExit(2)
    text = log.read_text()
    assert "FileNotFoundError" in text and "missing.json" in text and "unrecognized arguments: --no-such-flag" in text
    missing.kill()  # ended and reaped: nothing is signalled, nothing raised
    assert missing.poll() == 1


def test_a_fresh_rank_holds_the_stop_signal_in_its_own_session_and_a_dead_server_takes_its_ranks(server, tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # opening it blocks the rank before `train` sets its STOP_SIGNAL handler
    rank = server.start(["--config", str(fifo)], dict(os.environ), 1, 2)
    assert _session(rank.pid) == rank.pid != _session(os.getpid())  # Ctrl-C in a terminal reaches the launcher only
    bit = 1 << (STOP_SIGNAL - 1)
    assert int(_status(rank.pid)["SigBlk"], 16) & bit  # held from its first instruction
    rank.send_signal(STOP_SIGNAL)  # a stop asked this early waits (pending) instead of killing the rank
    wait_for(lambda: int(_status(rank.pid)["SigPnd"], 16) & bit or int(_status(rank.pid)["ShdPnd"], 16) & bit,
             "the stop signal to be pending")
    assert rank.poll() is None and _status(rank.pid)["State"][0] in "SR"
    server.proc.kill()  # the server gone: its ranks cannot be watched, so they are stopped
    assert rank.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: not Path(f"/proc/{rank.pid}").exists() or _status(rank.pid)["State"].startswith("Z"),
             "the orphaned rank to be killed")
    with pytest.raises(CellfeedError, match="rank server has ended"):
        server.start(["--config", str(fifo)], dict(os.environ), 1, 2)
