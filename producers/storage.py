"""Where a dataset lives: a local directory or an `s3://bucket/prefix` on any S3-compatible store.

Lance does the heavy reads and writes itself (it takes `lance_options`); this module does the
few small-object operations around it (config.json, existence checks, clean-up of a failed
write) and turns storage failures into one clear `CellfeedError`.

S3 settings come from the environment, never from code: AWS_ENDPOINT_URL (Tigris, R2, MinIO,
a local test server), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and
AWS_REGION (or AWS_DEFAULT_REGION). Plain-http endpoints are allowed. Keys never appear in
errors or logs.

How long an S3 request may take and how it is retried is set here once, for Lance's reads and
writes (its object_store client) and the small requests made here (boto3) alike: the constants
below, each overridable in the environment:

    CELLFEED_S3_CONNECT_TIMEOUT_S   5   a store that accepts no connection in this long is down
    CELLFEED_S3_REQUEST_TIMEOUT_S  30   a whole request, a large GET's body included
    CELLFEED_S3_RETRIES             3   tries again per request, quickly (0.1 s, doubling)

A request is retried for at most twice its timeout; beyond that the caller decides (a producer
tries a unit's read again 1 s, 2 s, 4 s, then 5 s apart for minutes), so an object store that
restarts is used again within seconds of answering. Lance also slows its requests when they fail
after retries, taking any such failure (an outage too) for throttling: halving its request rate
every second, down to 1 request/s, and requests queued at that rate keep their waits once the
store is back (in tests/test_s3.py a 15 s restart kept reads waiting up to 100 s). Its floor is
raised to MIN_REQUEST_RATE, which still backs off from a store that really throttles.

A dataset on object storage reads its fragment slices through `ReadSlots`: as many in flight as
the reader's pace needs (Little's law, from the slices' measured times), at most REMOTE_READS_MAX.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordination.errors import CellfeedError

CONNECT_TIMEOUT_S = 5.0  # CELLFEED_S3_CONNECT_TIMEOUT_S
REQUEST_TIMEOUT_S = 30.0  # CELLFEED_S3_REQUEST_TIMEOUT_S
RETRIES = 3  # CELLFEED_S3_RETRIES
MIN_REQUEST_RATE = 100  # requests/s: the floor of Lance's throttle (see the module's docstring)
# A dataset's slice reads in flight on object storage (`ReadSlots`): each is mostly waiting (a round trip or
# two), a thread blocked in Lance's GETs with the GIL released, so as many as the reader's pace needs
REMOTE_READS_MAX = 256  # at most (their rows are part of the units read ahead, which bound the memory)
# until a pace is asked and a read timed: the most, as if the store were far (started at 64, a producer's first
# units behind 100 ms read at 64: short block runs came out at 0.84-0.86x local against 256 fixed's 1.01-1.08x)
REMOTE_READS_START = REMOTE_READS_MAX
READS_HEADROOM = 2.0  # reads in flight over Little's law's mean: a latency's tail, a unit's slices all at once
# a read waiting for a slot while no read ends for this long: the store has stopped answering (less than a
# producer's `read_retry_s`, 180 s, so its read is tried again: StorageUnavailable)
READ_SLOT_WAIT_S = 120.0


def _env_number(env, name: str, default: float, kind=float):
    text = env.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = -1
    if value < 0 or (kind is float and value == 0):
        raise CellfeedError(f"{name}={text!r}: expected a {'positive number' if kind is float else 'count'}")
    return value


@dataclass(frozen=True)
class S3Settings:
    endpoint: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    request_timeout_s: float = REQUEST_TIMEOUT_S
    retries: int = RETRIES

    @classmethod
    def from_env(cls, env: dict | None = None) -> "S3Settings":
        env = os.environ if env is None else env
        name = "AWS_ENDPOINT_URL_S3" if env.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
        endpoint = env.get(name) or None
        if endpoint is not None:
            from urllib.parse import urlparse

            parts = urlparse(endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise CellfeedError(
                    f"{name}={endpoint!r} is not an http(s) URL: set it to the object store's "
                    "address (e.g. http://127.0.0.1:8333), or unset it for AWS S3"
                )
        return cls(
            endpoint=endpoint,
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            access_key_id=env.get("AWS_ACCESS_KEY_ID") or None,
            secret_access_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
            session_token=env.get("AWS_SESSION_TOKEN") or None,
            connect_timeout_s=_env_number(env, "CELLFEED_S3_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S),
            request_timeout_s=_env_number(env, "CELLFEED_S3_REQUEST_TIMEOUT_S", REQUEST_TIMEOUT_S),
            retries=_env_number(env, "CELLFEED_S3_RETRIES", RETRIES, int),
        )

    @property
    def retry_window_s(self) -> float:
        """How long one request is retried before the caller hears of the failure."""
        return 2 * self.request_timeout_s

    def lance_options(self) -> dict[str, str]:
        """Lance/object_store `storage_options` for these settings."""
        opts = {
            "aws_region": self.region,
            "connect_timeout": f"{round(self.connect_timeout_s * 1000)}ms",
            "timeout": f"{round(self.request_timeout_s * 1000)}ms",
            "client_max_retries": str(self.retries),
            "client_retry_timeout": str(max(1, round(self.retry_window_s))),
            "lance_aimd_min_rate": str(MIN_REQUEST_RATE),
        }
        if self.endpoint:
            opts["aws_endpoint"] = self.endpoint
            if self.endpoint.startswith("http://"):
                opts["allow_http"] = "true"
        if self.access_key_id:
            opts["aws_access_key_id"] = self.access_key_id
        if self.secret_access_key:
            opts["aws_secret_access_key"] = self.secret_access_key
        if self.session_token:
            opts["aws_session_token"] = self.session_token
        return opts


class Location:
    """A dataset directory: `join` names files in it, the rest are small-object operations."""

    uri: str

    def join(self, name: str) -> str:
        return f"{self.uri.rstrip('/')}/{name}"

    def lance_options(self) -> dict[str, str] | None:
        return None

    def read_bytes(self, name: str) -> bytes: ...
    def write_bytes(self, name: str, data: bytes) -> None: ...
    def exists(self, name: str = "") -> bool: ...
    def delete(self) -> None: ...

    def check_reachable(self, for_write: bool = False) -> None:
        """Raise a `CellfeedError` now, before any work, if the location cannot be used."""


class LocalLocation(Location):
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser().absolute()
        self.uri = str(self.path)

    def read_bytes(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def write_bytes(self, name: str, data: bytes) -> None:
        target = self.path / name
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def exists(self, name: str = "") -> bool:
        return (self.path / name).exists() if name else self.path.exists()

    def delete(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def check_reachable(self, for_write: bool = False) -> None:
        if for_write:
            parent = self.path.parent
            if not parent.is_dir():
                raise CellfeedError(f"cannot write {self.uri}: folder {parent} does not exist; create it first")
            if not os.access(parent, os.W_OK):
                raise CellfeedError(f"cannot write {self.uri}: folder {parent} is not writable")


class S3Location(Location):
    def __init__(self, uri: str, settings: S3Settings | None = None):
        rest = uri[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise CellfeedError(f"bad S3 address {uri!r}: expected s3://bucket/prefix")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.settings = settings or S3Settings.from_env()
        self._client = None

    def lance_options(self) -> dict[str, str]:
        return self.settings.lance_options()

    def key_of(self, name: str) -> str:
        return "/".join(p for p in (self.prefix, name) if p)

    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            s = self.settings
            self._client = boto3.client(
                "s3",
                endpoint_url=s.endpoint,
                region_name=s.region,
                aws_access_key_id=s.access_key_id,
                aws_secret_access_key=s.secret_access_key,
                aws_session_token=s.session_token,
                config=Config(
                    connect_timeout=s.connect_timeout_s,
                    read_timeout=s.request_timeout_s,
                    retries={"max_attempts": s.retries},
                ),
            )
        return self._client

    def _explain(self, exc: Exception, action: str) -> CellfeedError:
        """Map a boto/botocore failure to one actionable line (no keys, no traceback)."""
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        where = self.settings.endpoint or "the default AWS endpoint"
        if isinstance(exc, NoCredentialsError):
            return CellfeedError(
                f"cannot {action} {self.uri}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        if isinstance(exc, EndpointConnectionError) or type(exc).__name__ in (
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ConnectionClosedError",
        ):
            return CellfeedError(
                f"cannot {action} {self.uri}: S3 endpoint {where} is unreachable; "
                "check AWS_ENDPOINT_URL and the network"
            )
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchBucket", "404", "NotFound") and action != "read":
                return CellfeedError(
                    f"cannot {action} {self.uri}: bucket {self.bucket!r} does not exist at {where}; create it first"
                )
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "AccessDenied", "Forbidden"):
                return CellfeedError(
                    f"cannot {action} {self.uri}: access denied by {where} ({code}); check AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY and the bucket's permissions"
                )
            if code in ("NoSuchKey", "404", "NotFound"):
                return CellfeedError(f"cannot {action} {self.uri}: not found")
            return CellfeedError(f"cannot {action} {self.uri}: S3 error {code}")
        return CellfeedError(f"cannot {action} {self.uri}: {type(exc).__name__}")

    def check_reachable(self, for_write: bool = False) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001 - translated to one clear line
            raise self._explain(exc, "write" if for_write else "open") from None

    def read_bytes(self, name: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key_of(name))["Body"].read()
        except Exception as exc:  # noqa: BLE001
            err = self._explain(exc, "read")
            if "not found" in str(err):
                raise FileNotFoundError(self.join(name)) from None
            raise err from None

    def write_bytes(self, name: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key_of(name), Body=data)
        except Exception as exc:  # noqa: BLE001
            raise self._explain(exc, "write") from None

    def exists(self, name: str = "") -> bool:
        prefix = self.key_of(name)
        try:
            resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix + "/" if prefix else "", MaxKeys=1)
            if resp.get("KeyCount", 0):
                return True
            if name:
                self.client.head_object(Bucket=self.bucket, Key=prefix)
                return True
            return False
        except Exception as exc:  # noqa: BLE001
            from botocore.exceptions import ClientError

            if isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code")) in (
                "404",
                "NoSuchKey",
                "NotFound",
            ):
                return False
            raise self._explain(exc, "open") from None

    def delete(self) -> None:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key_of("") + "/" if self.prefix else ""):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})


def location(uri: str | os.PathLike, settings: S3Settings | None = None) -> Location:
    """The `Location` for a local path or an `s3://` address."""
    text = str(uri)
    if text.startswith("s3://"):
        return S3Location(text, settings)
    if "://" in text:
        raise CellfeedError(f"unsupported address {text!r}: use a local path or s3://bucket/prefix")
    return LocalLocation(text)


UNREACHABLE = re.compile(
    r"LanceError\(IO\)|HTTP|connect|timed? ?out|error sending request|broken pipe|reset by peer", re.IGNORECASE
)


def error_text(exc: Exception) -> str:
    """One line of a (Lance) error for the user: its first line, without the Rust source location
    Lance appends (`, /…/src/sql.rs:109:22`) or its internal columns."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r",?\s*\S+\.rs:\d+:\d+$", "", text)
    text = re.sub(r", _row\w+", "", text)
    return text[:300]


class StorageUnavailable(CellfeedError):
    """The storage did not answer (connection refused or reset, timeouts, HTTP errors): worth
    trying again later, unlike damaged data."""


def reads_in_flight(reads_per_s: float, latency_s: float) -> int:
    """Little's law: reads in flight = arrival rate x time in the system, with READS_HEADROOM;
    between 4 and REMOTE_READS_MAX. E.g. 2,000 slices a second at 0.12 s each: 480, so 256."""
    return int(min(REMOTE_READS_MAX, max(4, math.ceil(READS_HEADROOM * reads_per_s * latency_s))))


class ReadSlots:
    """A dataset's reads in flight on object storage: at most `limit` at once (`with slots.read(rows):`
    around each), the limit sized to a reader's pace from the recent reads' rows and times (`pace`).
    Reads waiting for a slot get one in the order they came (a freed slot is handed to the oldest):
    the oldest belong to the unit the producer needs first. A larger limit lets the waiting in at
    once; a smaller one takes effect as reads end."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.fixed = False  # (`fix`: a pace asked later changes nothing)
        self._lock = threading.Lock()
        self._waiting: deque[threading.Event] = deque()  # reads waiting for a slot, oldest first
        self._recent: deque = deque(maxlen=512)  # (rows, seconds) of the latest reads that succeeded
        self._last_end = time.monotonic()  # when a read last ended (a wait gives up only when none has)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @contextlib.contextmanager
    def read(self, rows: int):
        self._take_slot()
        start, ok = time.perf_counter(), False
        try:
            yield
            ok = True
        finally:
            with self._lock:
                if ok:
                    self._recent.append((rows, time.perf_counter() - start))
                self._last_end = time.monotonic()
                self.held -= 1
                self._admit()

    def _take_slot(self) -> None:
        with self._lock:
            if self.held < self.limit and not self._waiting:
                self.held += 1
                return
            turn, since = threading.Event(), time.monotonic()
            self._waiting.append(turn)
        # wait while reads end (each is bounded by the store's timeouts); give up only when none has
        # for READ_SLOT_WAIT_S: the reads in flight are stuck, so is the store
        while not turn.wait(max(0.0, READ_SLOT_WAIT_S - (time.monotonic() - max(since, self._last_end)))):
            with self._lock:
                if turn.is_set():  # (handed a slot as the wait ran out)
                    return
                if time.monotonic() - max(since, self._last_end) >= READ_SLOT_WAIT_S:
                    self._waiting.remove(turn)
                    raise StorageUnavailable(
                        f"no read of the object store ended in {READ_SLOT_WAIT_S:.0f} s ({self.held} in flight); "
                        "is the store up?"
                    )

    def _admit(self) -> None:
        """(lock held) Free slots to the oldest waiting reads."""
        while self._waiting and self.held < self.limit:
            self.held += 1
            self._waiting.popleft().set()

    def pace(self, rows_per_s: float) -> int:
        """Size the limit to read `rows_per_s` rows a second, the reader's pace: Little's law
        (`reads_in_flight`), reads a second at the rows the recent reads held, times their median
        time. Returns the limit."""
        with self._lock:
            if self._recent and rows_per_s > 0 and not self.fixed:
                rows_per_read = max(1.0, sum(r for r, _ in self._recent) / len(self._recent))
                latency_s = float(np.median([s for _, s in self._recent]))
                self.limit = reads_in_flight(rows_per_s / rows_per_read, latency_s)
                self._admit()
            return self.limit

    def fix(self, limit: int) -> None:
        """`limit` reads in flight from now on, whatever pace is asked."""
        with self._lock:
            self.limit, self.fixed = limit, True
            self._admit()
