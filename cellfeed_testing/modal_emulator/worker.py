"""One attempt of one function call, in its own process (a "container"): import the app's module,
run the function's body on the call's input, report the result or the error."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback

from cellfeed_testing.modal_emulator.client import _conn


def _cancelled(*_):
    import modal.exception

    raise modal.exception.InputCancellation("Input was cancelled by user")  # as modal's container does (S13)


def main() -> int:
    signal.signal(signal.SIGUSR1, _cancelled)
    # preemption's SIGINT is a KeyboardInterrupt in the body (S15) whatever this process inherited: a
    # test run started where SIGINT is ignored (a shell's background job) still sees it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    call_id, attempt = os.environ["MODAL_EMULATOR_CALL"], int(os.environ["MODAL_EMULATOR_ATTEMPT"])
    rank = json.loads(os.environ.get("MODAL_EMULATOR_CLUSTER") or '{"rank": 0}')["rank"]  # S27
    spec, _ = _conn.call({"op": "f.input", "id": call_id})
    try:
        if os.environ.get("MODAL_EMULATOR_FAIL"):  # S16: a fault injected by the test
            raise RuntimeError(os.environ["MODAL_EMULATOR_FAIL"])
        module = importlib.import_module(spec["app_file"])
        function = getattr(module, spec["function"])
        result = function.get_raw_f()(*spec["args"]["args"], **spec["args"]["kwargs"])
        json.dumps(result)
    except KeyboardInterrupt:  # preemption (S15): the input reports nothing; it runs again
        traceback.print_exc()
        return 130
    except BaseException as exc:  # noqa: BLE001 - reported, as Modal reports a failed input
        traceback.print_exc()
        cls = type(exc)
        from cellfeed_testing.modal_emulator import images

        message = images.GUARD.explain(exc) if images.GUARD is not None else str(exc)
        _conn.call(
            {
                "op": "f.report",
                "id": call_id,
                "attempt": attempt,
                "ok": False,
                "error": {"type": f"{cls.__module__}.{cls.__qualname__}", "message": message},
                "rank": rank,
            }
        )
        return 1
    _conn.call({"op": "f.report", "id": call_id, "attempt": attempt, "ok": True, "result": result, "rank": rank})
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    sys.exit(main())
