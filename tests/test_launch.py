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
from trainer.launch import Rank, RankServer


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
        missing = server.start(
            ["--config", str(tmp_path / "missing.json")], dict(os.environ), out.fileno(), out.fileno()
        )
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
    # in a session of its own once it runs (Ctrl-C in a terminal reaches the launcher only)
    wait_for(lambda: _session(rank.pid) == rank.pid, "the rank to lead a session of its own")
    bit = 1 << (STOP_SIGNAL - 1)
    assert int(_status(rank.pid)["SigBlk"], 16) & bit  # held from its first instruction
    rank.send_signal(STOP_SIGNAL)  # a stop asked this early waits (pending) instead of killing the rank
    wait_for(
        lambda: int(_status(rank.pid)["SigPnd"], 16) & bit or int(_status(rank.pid)["ShdPnd"], 16) & bit,
        "the stop signal to be pending",
    )
    assert rank.poll() is None and _status(rank.pid)["State"][0] in "SR"
    server.proc.kill()  # the server gone: its ranks die with it, and are reported killed
    assert rank.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: not _reading(fifo), "the rank to die with its server")
    with pytest.raises(CellfeedError, match="rank server has ended"):
        server.start(["--config", str(fifo)], dict(os.environ), 1, 2)


def _alive(pid: int) -> bool:
    try:
        return _status(pid)["State"][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone: before the open, or reaped between open and read
        return False


def _reading(fifo: Path) -> bool:
    """Whether a process has the FIFO open for reading (a rank blocked on it)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        return True
    except OSError:  # ENXIO: no reader
        return False


def test_a_start_left_unanswered_ends_the_server_so_no_later_start_gets_its_rank(monkeypatch, tmp_path):
    import trainer.launch as launch

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    server = RankServer()
    monkeypatch.setattr(launch, "START_TIMEOUT_S", 0.001)  # shorter than any `import torch`
    with pytest.raises(CellfeedError, match="started no rank within"):
        server.start(["--config", str(fifo)], dict(os.environ), 1, 2)
    assert server.proc.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: not _reading(fifo), "no rank left behind")
    with pytest.raises(CellfeedError, match="rank server has ended"):
        server.start(["--config", str(fifo)], dict(os.environ), 1, 2)


def test_a_launcher_gone_before_its_rank_was_forked_leaves_no_rank(tmp_path):
    """A launcher killed right after asking for a rank (while the server still imports torch): the
    server does not fork for a launcher that has hung up."""
    import subprocess
    import sys

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    code = (
        "import os, socket, sys; import trainer.launch as launch\n"
        "send = socket.send_fds\n"
        "def send_then_die(*args):\n"
        "    send(*args); os._exit(0)\n"
        "socket.send_fds = send_then_die\n"
        "server = launch.RankServer(); print(server.proc.pid, flush=True)\n"
        f"server.start(['--config', {str(fifo)!r}], dict(os.environ), 1, 2)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    server_pid = int(out.stdout.split()[0])
    wait_for(
        lambda: not Path(f"/proc/{server_pid}").exists() or _status(server_pid)["State"].startswith("Z"),
        "the server to end with its launcher",
    )
    assert not _reading(fifo)


def test_a_shared_server_serves_each_launcher_its_own_ranks_and_kills_those_of_a_launcher_gone(
    shared_rank_server, tmp_path
):
    """`python -m trainer.launch --listen PATH` (the suite's own, conftest.py): two launchers at once,
    each signalled only about its own ranks; one killed outright (no goodbye) loses its rank, the
    other's runs on; a launcher that ends hangs up and loses its own; the server serves on."""
    import subprocess
    import sys

    from trainer.launch import RANK_SERVER_ENV

    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    os.mkfifo(ours), os.mkfifo(theirs)  # a rank blocks opening one: alive until something kills it (or writes)
    mine = RankServer(str(shared_rank_server))
    rank = mine.start(["--config", str(ours)], dict(os.environ), 1, 2)
    other = subprocess.Popen(
        [sys.executable, "-c", f"from trainer.launch import rank_server; import os, sys\n"
         f"r = rank_server().start(['--config', {str(theirs)!r}], dict(os.environ), 1, 2)\n"
         "print(r.pid, flush=True); sys.stdin.read()"],
        env=dict(os.environ, **{RANK_SERVER_ENV: str(shared_rank_server)}),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    their_rank = int(other.stdout.readline())
    wait_for(lambda: _session(rank.pid) == rank.pid and _session(their_rank) == their_rank, "both ranks to run")
    assert their_rank not in mine.ranks  # each launcher hears of its own ranks only
    mine.signal(Rank(mine, their_rank), signal.SIGKILL)  # a pid not ours: the server ignores it
    missing = mine.start(["--config", str(tmp_path / "missing.json")], dict(os.environ), 1, 2)  # (after the signal)
    assert missing.wait(timeout=60) == 1 and _alive(their_rank)
    other.kill()
    other.wait(timeout=30)
    wait_for(lambda: not _alive(their_rank), "the rank of the launcher killed outright to be killed")
    assert _alive(rank.pid) and rank.poll() is None
    mine.end()  # hanging up: the server kills our rank too
    assert rank.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: not _alive(rank.pid), "our rank to die with our connection")
    again = RankServer(str(shared_rank_server))  # and it serves the next launcher
    assert again.start(["--config", str(tmp_path / "missing.json")], dict(os.environ), 1, 2).wait(timeout=60) == 1
    again.end()


def test_a_shared_server_that_is_not_there_is_one_clear_error(tmp_path):
    with pytest.raises(CellfeedError, match=r"CELLFEED_RANK_SERVER=.*nothing: no rank server answers there.*--listen"):
        RankServer(str(tmp_path / "nothing"))


def rank_report(tmp_path, report_body: str, env: dict) -> str:
    """What one rank of a shared server started with `env` writes to its stdout, where the rank
    runs `report_body` (its locals: `fds`, the rank's stdout first; `server`, the server's pid)
    instead of training."""
    import subprocess
    import sys

    path, report = tmp_path / "server.sock", tmp_path / "rank.txt"
    code = (
        "import os, sys; import trainer.launch as launch\n"
        "def report(socks, fds, request, server):\n"
        f"{report_body}"
        "    os._exit(0)\n"
        "launch._be_a_rank = report\n"
        f"sys.argv = ['trainer.launch', '--listen', {str(path)!r}]; launch.main()\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().startswith("rank server listening")
        launcher = RankServer(str(path))
        with open(report, "w") as out:
            rank = launcher.start([], dict(env), out.fileno(), out.fileno())
        assert rank.wait(timeout=120) == 0
        launcher.end()
        return report.read_text()
    finally:
        server.kill()
        server.wait(timeout=30)


def test_a_server_started_without_omp_num_threads_gives_its_ranks_one_thread(tmp_path):
    """OpenMP reads OMP_NUM_THREADS once, as torch loads it in the server: a rank forked after that
    keeps the server's count whatever its own environment says. A shared server started from a shell
    that set nothing (here: a rank that reports torch's thread count instead of training) still gives
    each rank one thread, not one per core."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    body = "    import torch\n    os.write(fds[0], str(torch.get_num_threads()).encode())\n"
    assert rank_report(tmp_path, body, env) == "1"


def test_on_modal_the_server_imports_modal_once_for_its_ranks_and_forks_them_from_one_thread(tmp_path):
    """In a Modal container (MODAL_IS_REMOTE=1, as modal's own config reads it) each rank's queue client
    is modal's: the server imports it before forking (each of a node's 8 ranks imported it again,
    ~0.7 CPU-s each). Forking is safe only from a process of one thread: a rank sees modal loaded and
    counts the server's threads at its fork."""
    body = (
        "    threads = len(os.listdir(f'/proc/{server}/task'))\n"
        "    os.write(fds[0], f\"{'modal' in sys.modules} {threads}\".encode())\n"
    )
    assert rank_report(tmp_path, body, {**os.environ, "MODAL_IS_REMOTE": "1"}) == "True 1"


def test_a_rendezvous_port_is_one_no_outgoing_connection_can_be_given_meanwhile():
    """`free_port` (DDP's rendezvous, local servers) picks below the kernel's ephemeral range: a port
    from `bind(0)`, free when picked, could be handed to any process's outgoing connection before its
    server bound it (rank 0's TCPStore failed with EADDRINUSE when two Modal test campaigns started
    together). The port is free: it binds, on IPv4 and IPv6."""
    import socket

    from coordination.net import free_port

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for host, family in (("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)):
        ports = {free_port(host) for _ in range(20)}
        assert all(low // 2 <= p < low for p in ports) and len(ports) > 1, ports
        with socket.socket(family) as s:
            s.bind((host, ports.pop()))


@pytest.mark.token_pass_free
def test_a_killed_rank_whose_exit_is_never_reported_is_not_waited_on_forever(monkeypatch, capsys):
    """A rank stuck in the kernel (a hung driver call) outlives SIGKILL and its exit never comes:
    `reap` gives up after KILL_WAIT_S, says so, and counts it killed, so `wait_all` and
    `checkpoint_and_stop` (a preemption's save window) go on. A rank whose exit came returns its code."""
    import threading
    from types import SimpleNamespace

    from trainer import ranks

    monkeypatch.setattr(ranks, "KILL_WAIT_S", 0.2)
    server = SimpleNamespace(changed=threading.Condition())  # (no rank server: no exit is ever reported)
    stuck, ended = Rank(server, pid=12345), Rank(server, pid=12346)
    ended.returncode = 3
    assert (ranks.reap(stuck), ranks.reap(ended)) == (-int(signal.SIGKILL), 3)
    assert "rank pid 12345: killed, its exit not reported in 0 s; going on" in capsys.readouterr().err


@pytest.mark.token_pass_free
def test_a_rank_server_event_that_cannot_be_read_ends_the_server_not_its_reader_alone(tmp_path, capsys):
    """The launcher's reader of the server's events must not die alone: its ranks' exits would never
    come, `poll` say "running" for ever and `wait` hang. A message it cannot read ends the server's
    view as a hang-up does: said on stderr, every rank still running counted as killed, waiters woken."""
    import json
    import socket

    from trainer.ranks import KILL_WAIT_S

    listening = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listening.bind(str(tmp_path / "s"))
    listening.listen(1)
    server = RankServer(str(tmp_path / "s"))  # (the launcher's end of a shared server: this test plays the server)
    peer, _ = listening.accept()
    with peer, listening:
        peer.send(json.dumps({"started": 4242}).encode())
        wait_for(lambda: len(server.started) == 1, "the rank's start", timeout=10)
        (rank,) = server.started
        assert rank.poll() is None
        peer.send(b"\xff not an event")
        assert rank.wait(timeout=KILL_WAIT_S) == -signal.SIGKILL and server.ended
    assert "rank server: an event could not be read" in capsys.readouterr().err
