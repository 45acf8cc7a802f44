"""`python -m cellfeed_testing.modal_control_plane run [options] -- CMD ARGS...`: a control plane for one command.

Starts a plane (a free port on 127.0.0.1, or a unix socket with `--unix`), runs CMD with
`MODAL_SERVER_URL`, a test token and `MODAL_CONFIG_PATH` (a file that does not exist) in its
environment, then stops everything it started (CMD's process group, every container) and exits with
CMD's status (128 + N for a signal N). SIGINT, SIGTERM and SIGHUP are passed on to CMD, which runs in a
process group of its own: Ctrl-C reaches `modal run` once, as from a terminal, and the plane outlives
it until CMD has finished.

`serve` starts one and prints the `export` lines for another shell, until Ctrl-C.

Defaults a local campaign can use: a Secret named $CELLFEED_SECRET (default `cellfeed-s3`) holding
whichever of AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL and AWS_REGION this
environment has (app/modal_app.py: SECRET_NAME), and the app's Volumes (`/checkpoints`, `/kernels`) told
to containers as `app/modal_app.py: MOUNT_ENV` names them. `--secret` and `--mount-env` replace them.
`--lasting-volume NAME=FOLDER` keeps a named Volume in FOLDER across planes, as a workspace keeps it across
runs (V9): `--lasting-volume cellfeed-kernels=~/.cellfeed/kernels` compiles the token pass once, not per plane.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

from cellfeed_testing.modal_control_plane.plane import ControlPlane

S3_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# settings of the laptop's Modal that must not reach CMD: they would point it elsewhere (config.py:314, 380-386)
CLEARED = (
    "MODAL_PROFILE",
    "MODAL_OAUTH_REFRESH_TOKEN",
    "MODAL_OAUTH_CLIENT_ID",
    "MODAL_OAUTH_CLIENT_SECRET",
    "MODAL_OAUTH_JWT_KEY",
    "MODAL_ENVIRONMENT",
)


def _secrets(specs: list[str] | None) -> dict[str, dict[str, str]]:
    """`NAME=VAR,VAR`: a Secret holding those variables' values from this environment (values never
    appear on a command line)."""
    if specs is None:
        name = os.environ.get("CELLFEED_SECRET", "cellfeed-s3")
        return {name: {k: os.environ[k] for k in S3_VARIABLES if k in os.environ}}
    out = {}
    for spec in specs:
        name, _, names = spec.partition("=")
        missing = [v for v in names.split(",") if v and v not in os.environ]
        if missing:
            raise SystemExit(f"--secret {spec}: not in this environment: {', '.join(missing)}")
        out[name] = {v: os.environ[v] for v in names.split(",") if v}
    return out


def _mount_env(specs: list[str] | None) -> dict[str, str]:
    if specs is None:
        from app.modal_app import MOUNT_ENV

        return dict(MOUNT_ENV)
    out = {}
    for spec in specs:
        path, sep, var = spec.partition("=")
        if not sep or not path.startswith("/") or not var:
            raise SystemExit(f"--mount-env {spec}: expected /MOUNT/PATH=VARIABLE")
        out[path] = var
    return out


def _lasting(specs: list[str] | None) -> dict[str, str]:
    out = {}
    for spec in specs or []:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"--lasting-volume {spec}: expected NAME=FOLDER")
        out[name] = os.path.expanduser(folder)
    return out


def _plane(args) -> ControlPlane:
    return ControlPlane(
        args.root,
        transport="unix" if args.unix else "tcp",
        secrets=_secrets(args.secret),
        mount_env=_mount_env(args.mount_env),
        lasting_volumes=_lasting(args.lasting_volume),
    )


def run(args) -> int:
    if not args.cmd:
        raise SystemExit("run: give a command after --")
    with _plane(args) as plane:
        env = {k: v for k, v in os.environ.items() if k not in CLEARED}
        env.update(plane.env)
        proc = subprocess.Popen(args.cmd, env=env, process_group=0)

        def forward(sig, _frame):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            try:  # whatever CMD left behind in its group goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return 128 - code if code < 0 else code


def serve(args) -> int:
    done = threading.Event()
    for sig in FORWARDED:
        signal.signal(sig, lambda *_: done.set())
    with _plane(args) as plane:
        for k, v in plane.env.items():
            print(f"export {k}={v}", flush=True)
        print("# serving until Ctrl-C", file=sys.stderr, flush=True)
        done.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cellfeed_testing.modal_control_plane", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--root", help="keep the plane's state (volumes, container folders, logs) here")
        p.add_argument("--unix", action="store_true", help="listen on a unix socket instead of 127.0.0.1")
        p.add_argument("--secret", action="append", metavar="NAME=VAR,VAR", help="a Secret from this environment")
        p.add_argument("--mount-env", action="append", metavar="/PATH=VAR", help="tell containers a mount's folder")
        p.add_argument(
            "--lasting-volume",
            action="append",
            metavar="NAME=FOLDER",
            help="a named Volume kept in FOLDER across planes",
        )
        if name == "run":
            p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.cmd and args.cmd[0] == "--":
            args.cmd = args.cmd[1:]
        return run(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
