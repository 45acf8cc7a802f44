"""Start one training process per rank on this machine (what torchrun does, minus elasticity):
real processes, each in a session of its own, so a test can SIGKILL them.

Ranks are forked from a *rank server* (`python -m trainer.launch`), one per launching process, started on first use.
It imports torch and the trainer once; each fresh interpreter would pay that again (~2.5 CPU-s here: `import torch`,
then `torch._dynamo`, which DDP's constructor and the optimizer's first step import), so a campaign's second and
later ranks, and every rank of a resume, start in milliseconds. The server never runs a torch op or initialises CUDA
before it forks (one thread; each rank sets its own device up), and talks to the launcher over a Unix socket pair:

    launcher -> server   {"argv": [...], "env": {...}, "cwd": ...} with the rank's stdout and stderr (SCM_RIGHTS)
                         {"signal": N, "pid": P}
    server -> launcher   {"started": P}, then {"exited": P, "code": C}

The server is the ranks' parent: it alone reaps them, and signals only a rank it has not reaped, so a signal never
reaches a process that reused a rank's pid. It ends when the launcher does (its socket closes), and its ranks die
with it (each has the server's death as its SIGKILL): a launcher killed outright leaves no rank behind. A launcher
whose server died reports its ranks as killed.

A *shared* server (`python -m trainer.launch --listen PATH`, named to launchers by `CELLFEED_RANK_SERVER=PATH`)
serves every launch on the machine that names it, torch imported once for all: a sweep of short campaigns, the
test suite (~3 CPU-s a campaign saved). Each launcher is one connection and its ranks are its own (the shared
server's children, not the launcher's); a launcher gone (its connection closed) has its ranks SIGKILLed.

What the server read from the environment when it started stays: torch's import-time settings
(`TORCH_*` logging and compile settings), `sys.path`. A rank gets its launch's environment,
working directory, stdout and stderr; CUDA and NCCL read theirs in the rank.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from coordination.errors import CellfeedError
from coordination.net import die_with_parent, free_port
from trainer.config import STOP_SIGNAL, TrainConfig

START_TIMEOUT_S = 120.0  # the first start waits for the server's imports (seconds; minutes on a loaded machine)
REAP_EVERY_S = 0.05  # how often the server looks for ranks that ended
MAX_MESSAGE = 1 << 20  # a start request carries the rank's environment
RANK_SERVER_ENV = "CELLFEED_RANK_SERVER"  # a shared server's socket (`--listen PATH`), used by every launch here


def launch(
    cfg: TrainConfig,
    gpus: int,
    workdir: str | os.PathLike,
    summary_path: str | None = None,
    env: dict | None = None,
    log_ranks: bool = False,
    node: int = 0,
    nodes: int = 1,
    master: tuple[str, int] | None = None,
) -> list[Rank]:
    """Start this node's `trainer.train` ranks (`gpus` of them: global ranks node x gpus ...); the
    caller waits (or kills). The DDP world is nodes x gpus ranks, meeting at `master` (node 0's
    address and a free port there; one node: this machine, a free port). With `log_ranks`, ranks
    other than 0 write their output to WORKDIR/rank<r>.log; the rest write to this process's
    stdout and stderr."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"train_config.node{node}.json"
    config_path.write_text(json.dumps(asdict(cfg)))
    address, port = master or ("127.0.0.1", free_port())
    argv = ["--config", str(config_path)] + (["--summary", str(summary_path)] if summary_path else [])
    server = rank_server()
    ranks = []
    try:
        for local in range(gpus):
            rank = node * gpus + local
            rank_env = dict(
                os.environ,
                **(env or {}),
                RANK=str(rank),
                LOCAL_RANK=str(local),
                WORLD_SIZE=str(nodes * gpus),
                MASTER_ADDR=address,
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            if log_ranks and rank > 0:
                with open(workdir / f"rank{rank}.log", "w") as out:
                    ranks.append(server.start(argv, rank_env, out.fileno(), out.fileno()))
            else:
                ranks.append(server.start(argv, rank_env, 1, 2))
    except BaseException:  # all ranks or none (an interrupt while the server still imports torch included)
        for started in ranks:
            started.kill()
        raise
    return ranks


class Rank:
    """One rank process, with the part of `subprocess.Popen` the launchers use: `pid`,
    `returncode`, `poll`, `wait`, `send_signal`, `kill`. Its exit code comes from the rank server."""

    def __init__(self, server: "RankServer", pid: int):
        self.pid, self.returncode, self._server = pid, None, server

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self._server.signal(self, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RankServer:
    """The launcher's end of a rank server (see the module's docstring)."""

    def __init__(self, address: str | None = None):
        """A server of this launcher's own, or with `address`, the shared one listening there."""
        self.proc: subprocess.Popen | None = None
        if address:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.sock.connect(address)
            except OSError as exc:
                self.sock.close()
                raise CellfeedError(
                    f"{RANK_SERVER_ENV}={address}: no rank server answers there ({exc.strerror}); start one "
                    f"(python -m trainer.launch --listen {address}) or unset {RANK_SERVER_ENV}"
                ) from None
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with theirs:
                # its own session: a signal to the launcher's process group (a terminal's Ctrl-C, a
                # SIGTERM) is the launcher's to act on
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "trainer.launch"], stdin=theirs, start_new_session=True
                )
            self.sock = ours
        self.changed = threading.Condition()  # a rank started or ended, or the server ended
        self.ranks: dict[int, Rank] = {}
        self.started: list[Rank] = []
        self.ended = False
        self._one_start = threading.Lock()
        threading.Thread(target=self._read, name="rank-server", daemon=True).start()

    def start(self, argv: list[str], env: dict, stdout: int, stderr: int) -> Rank:
        """Fork one rank; its pid once the server has forked it. A start that cannot finish (no
        answer in time, an interrupt) ends the server, and with it every rank it started: a request
        left unanswered must not be answered to a later start."""
        with self._one_start, self.changed:
            if self.ended:
                raise CellfeedError("the rank server has ended; no rank can start")
            answered = False
            try:
                request = {"argv": argv, "env": env, "cwd": os.getcwd()}
                socket.send_fds(self.sock, [json.dumps(request).encode()], [stdout, stderr])
                if not self.changed.wait_for(lambda: self.started or self.ended, START_TIMEOUT_S):
                    raise CellfeedError(f"the rank server started no rank within {START_TIMEOUT_S:.0f}s")
                if not self.started:
                    raise CellfeedError(f"the rank server ended ({self._how()}) before a rank started")
                answered = True
                return self.started.pop()
            except OSError:
                raise CellfeedError(f"the rank server has ended ({self._how()})") from None
            finally:
                if not answered:
                    self.end()

    def signal(self, rank: Rank, sig: int) -> None:
        with self.changed:
            if rank.returncode is None and not self.ended:  # the server signals it only if it has not reaped it
                try:
                    self.sock.send(json.dumps({"signal": int(sig), "pid": rank.pid}).encode())
                except OSError:
                    pass  # the server has gone, and its ranks with it (their death signal): `_read` reports them

    def end(self) -> None:
        """Kill the server; its ranks die with it (each has the server's death as its own SIGKILL). A
        shared server is left running: hanging up is enough, it kills the ranks of a launcher gone."""
        if self.proc is not None:
            self.proc.kill()
        else:
            self.sock.shutdown(socket.SHUT_RDWR)

    def _how(self) -> str:
        return f"exit code {self.proc.poll()}" if self.proc is not None else "the shared server hung up"

    def _read(self) -> None:
        """The server's events, until they end: it hung up (killed with its container, or a bug: so
        did its ranks), or a message here could not be read (this thread would die, and its ranks'
        exits never come). Either way every rank still running counts as killed, and waiters wake."""
        try:
            while message := self._recv():
                with self.changed:
                    event = json.loads(message)
                    if "started" in event:
                        rank = self.ranks[event["started"]] = Rank(self, event["started"])
                        self.started.append(rank)
                    else:
                        self.ranks.pop(event["exited"]).returncode = event["code"]
                    self.changed.notify_all()
            if self.proc is not None:  # (hung up: the server is ending)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=30)
        except Exception as exc:
            print(f"rank server: an event could not be read ({exc!r}); its ranks count as killed", file=sys.stderr)
        finally:
            with self.changed:
                self.ended = True
                for rank in self.ranks.values():
                    rank.returncode = -signal.SIGKILL
                self.ranks.clear()
                self.changed.notify_all()

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(MAX_MESSAGE)
        except OSError:
            return b""


_server: RankServer | None = None
_server_lock = threading.Lock()


def rank_server() -> RankServer:
    """This process's rank server, started on first use (or again, if it ended); the shared one
    `RANK_SERVER_ENV` names, if it is set."""
    global _server
    with _server_lock:
        if _server is None or _server.ended:
            _server = RankServer(os.environ.get(RANK_SERVER_ENV) or None)
        return _server


# ------------------------------------------------------------------ the server (python -m trainer.launch)


def serve(launcher: socket.socket | None = None, listener: socket.socket | None = None) -> None:
    """Import the rank's code once, then fork a rank per request and report each one's exit to the
    launcher that asked: the one on this process's stdin, or each one that connects to `listener`
    (a shared server). A launcher gone takes its ranks with it (SIGKILL); the stdin's takes the server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's; this ends with it
    # STOP_SIGNAL is held (blocked) here, so in every rank from its first instruction until `train`
    # sets its handler: a stop asked that early waits instead of killing the rank
    signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})
    # one OpenMP thread a rank: OpenMP reads this as torch loads it, here, so a rank's own setting (launch()'s)
    # comes too late in a forked rank; whoever started this server (a launcher, a shell's --listen) need not set it
    os.environ["OMP_NUM_THREADS"] = "1"
    # no cyclic GC while the imports run, then all they made frozen: each collection during them walked
    # torch's objects again (1.2 of 3.6 CPU-s here), and a rank's would too, copying pages it shares with us
    gc.disable()
    import torch  # noqa: F401 - the point of this process: imported once, shared by every rank it forks
    import torch._dynamo  # noqa: F401 - DDP's constructor and the optimizer import it

    import coordination.local_client  # noqa: F401 - each rank's queue client (a local campaign's)
    import coordination.scalars  # noqa: F401 - rank 0's TensorBoard writer (~0.5 CPU-s: TensorFlow's stub)
    import trainer.train  # noqa: F401

    if os.environ.get("MODAL_IS_REMOTE") == "1":  # a Modal container (modal/config.py reads the same variable):
        import modal  # noqa: F401 - each rank's queue client's (coordination/modal_backend.py; ~0.7 CPU-s a rank)
    gc.freeze()
    gc.enable()

    running: dict[socket.socket, set[int]] = {launcher: set()} if launcher else {}  # each launcher's ranks
    gone: set[int] = set()  # ranks of launchers that have gone: killed, to be reaped
    listening = [listener] if listener else []
    server = os.getpid()

    def reaped(pid: int) -> int | None:
        done, status = os.waitpid(pid, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if done else None

    while True:
        for sock, pids in running.items():  # reap only our own ranks, by pid
            for pid in list(pids):
                if (code := reaped(pid)) is not None:
                    pids.discard(pid)
                    _send(sock, {"exited": pid, "code": code})
        gone = {pid for pid in gone if reaped(pid) is None}
        for sock in select.select([*running, *listening], [], [], REAP_EVERY_S)[0]:
            if sock is listener:
                running[listener.accept()[0]] = set()
                continue
            try:
                message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            except OSError:
                message, fds = b"", []
            if not message or _hung_up(sock):  # the launcher has gone (a start it queued is not served)
                for fd in fds:
                    os.close(fd)
                pids = running.pop(sock)
                sock.close()
                if listener is None:
                    return  # its ranks die with this process
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)  # not reaped yet: still this launcher's rank
                gone |= pids
                continue
            request = json.loads(message)
            if "signal" in request:
                if request["pid"] in running[sock]:  # not reaped, so still this rank (running, or a zombie)
                    os.kill(request["pid"], request["signal"])
                continue
            pid = os.fork()
            if pid == 0:
                _be_a_rank([*running, *listening], fds, request, server)  # never returns
            for fd in fds:
                os.close(fd)
            running[sock].add(pid)
            _send(sock, {"started": pid})


def _send(sock: socket.socket, event: dict) -> None:
    with contextlib.suppress(OSError):  # (the launcher has gone: the next read drops it)
        sock.send(json.dumps(event).encode())


def _hung_up(sock: socket.socket) -> bool:
    """Whether the launcher has closed its end (its queued requests can still be read)."""
    poller = select.poll()
    poller.register(sock, select.POLLHUP | select.POLLRDHUP)
    return any(events & (select.POLLHUP | select.POLLRDHUP) for _, events in poller.poll(0))


def _be_a_rank(socks: list[socket.socket], fds: list[int], request: dict, server: int) -> None:
    """(in the forked child) Become `python -m trainer.train ARGV` with the request's environment
    and output, in a session of its own (a terminal's Ctrl-C reaches the launcher, which stops the
    ranks: no tracebacks from every rank), and SIGKILLed if the server dies (it dies with its
    launcher: no orphans)."""
    code = 1
    try:
        die_with_parent()
        if os.getppid() != server:  # the server died before the line above
            os._exit(1)
        for sock in socks:
            sock.close()
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)  # no stdin (the server's was its socket)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["trainer.train", *request["argv"]]
        from trainer.train import main

        main()
        code = 0
    except SystemExit as exc:  # as the interpreter exits on it
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # as the interpreter ends on one: killed by SIGINT
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught one
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="A rank server. Started by a launcher, it serves that launcher on its stdin and ends with it; "
        f"with --listen, every launcher on this machine whose {RANK_SERVER_ENV} names PATH (a sweep of short "
        "campaigns, a test suite: torch imported once for all of them), until it is killed or its parent ends."
    )
    parser.add_argument("--listen", metavar="PATH", help="serve launchers connecting to this Unix socket")
    args = parser.parse_args()
    if args.listen is None:
        serve(launcher=socket.socket(fileno=0))  # the launcher's socket is this process's stdin
        return
    die_with_parent()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(args.listen)
    listener.listen()
    print(f"rank server listening at {args.listen}", flush=True)  # (before its imports: starts queue until then)
    serve(listener=listener)


if __name__ == "__main__":
    main()
