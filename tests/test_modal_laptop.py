"""The laptop's part in a Modal campaign, with modal's own CLI against the control plane (issue 41):
Ctrl-C on `modal run` stops the app (modal/runner.py: an app not detached is stopped when its client
disconnects) and the laptop says so, with the command that resumes; with `modal run --detach`, the
laptop can go away (killed: no goodbye reaches Modal) and the campaign goes on, handing over from call
to call (each `train` spawns the next from inside its container, under Modal's 24 h timeout compressed
480 times) to its audited end."""

from __future__ import annotations

import signal

from cellfeed_testing.modal_control_plane.plane import ControlPlane
from tests.conftest import wait_for
from tests.test_modal_campaign import (  # noqa: F401 (atlas: a fixture)
    RUN,
    SECRET,
    atlas,
    calls,
    finish,
    flags,
    logs_of,
    modal_run,
    rank0_task,
    steps_logged,
    train_calls,
    train_started,
)


def plane_of(tmp_path, **kw) -> ControlPlane:
    from app.modal_app import MOUNT_ENV

    return ControlPlane(tmp_path / "plane", secrets={SECRET: {}}, mount_env=MOUNT_ENV, **kw)


def test_ctrl_c_on_modal_run_stops_the_campaigns_calls_and_says_how_to_resume(atlas, tmp_path, kernel_volume):  # noqa: F811
    with plane_of(tmp_path, lasting_volumes=kernel_volume) as plane:
        run = modal_run(plane, flags(atlas, epochs=2, gpus=1), tmp_path)
        call = train_started(plane, run)
        wait_for(lambda: steps_logged(plane, rank0_task(call)) >= 1, "train's first step", timeout=240)
        run.proc.send_signal(signal.SIGINT)  # Ctrl-C in the laptop's terminal
        code, out, err = finish(run, timeout=120)
        assert code != 0
        assert "interrupted: without `modal run --detach`, Modal stops this campaign's calls" in err, err[-3000:]
        assert "Resume it with:\n  modal run app/modal_app.py" in err and "--resume" in err.splitlines()[-1]
        # the app stopped with its client: no call of it goes on; the run's state is kept for the resume
        wait_for(lambda: all(c["status"] != "running" for c in calls(plane)), "the app's calls to end", timeout=60)
        now = plane.describe()
        assert f"cellfeed-{RUN}" in now["queues"] and f"cellfeed-{RUN}" in now["dicts"]


def test_a_detached_campaign_longer_than_a_call_continues_in_new_calls_after_the_laptop_is_gone(
    atlas,  # noqa: F811
    tmp_path,
    kernel_volume,
):
    """Each train call hands over to a new one when its --attempt-hours are up (Modal ends a call at
    24 h). Here the hours are up at once, so every call trains one step (the event), saves and hands
    over: an epoch of 3 steps spans 3 calls and is still trained exactly once. Modal's 24 h is the
    plane's, server-side: the functions ask for it (timeout=86400, as modal's client sent it) and the
    plane runs it 480 times faster (K5: a day is three minutes), so a call that did not hand over in
    time would end as a TIMEOUT; none does.

    The campaign runs with `modal run --detach`: the laptop follows the first hand-over (the next call
    by FunctionCall.from_id) and is then killed (SIGKILL: no disconnect reaches the plane; it takes the
    client as gone when its heartbeats stop, D12). The calls after the first are spawned by train
    itself, not "triggered" by the laptop, and the campaign completes without it: every train call
    succeeds, the epoch is audited exactly once, the run's queue and dicts are deleted."""
    with plane_of(tmp_path, client_gone_s=2.0, lasting_volumes=kernel_volume) as plane:
        plane.scale_timeouts(24 * 20)
        # one rank, batches of 512: the epoch's 1,344 cells are 3 steps, so 3 calls
        args = flags(atlas, epochs=1, gpus=1, batch_size=512, attempt_hours=1e-6)
        run = modal_run(plane, args, tmp_path, detach=True)
        followed = lambda: "train continues in call" in run.out_path.read_text() or run.poll() is not None  # noqa: E731
        wait_for(followed, "the laptop to follow train's first hand-over", timeout=300)
        assert run.poll() is None, "modal run ended before the laptop was gone: " + run.err_path.read_text()[-3000:]
        run.proc.kill()  # the laptop is gone
        run.proc.wait(timeout=30)

        def ended():
            trains = train_calls(plane)
            return len(trains) >= 3 and all(c["status"] != "running" for c in trains) and trains

        trains = wait_for(ended, "the campaign's train calls to end without the laptop", timeout=300)
        assert all(c["status"] == "success" for c in trains), [c["status"] for c in trains]
        # train.with_options(gpu=...) changes the GPUs only: every call keeps the function's 32 cores,
        # 128 GiB and Modal's longest timeout (D9: the server merges what the variant does not set)
        assert {(c["gpu"], c["cpu"], c["memory"], c["timeout_s"]) for c in trains} == {
            ("H100:1", 32.0, 131_072, 86_400)
        }
        assert not [a for c in calls(plane) for a in c["attempts"] if a["outcome"] == "timeout"]
        logs = "".join(logs_of(plane, c) for c in trains)
        assert logs.count("a new call") >= 2 and logs.count("cells trained, 0 missing, 0 duplicated") == 1, logs[-3000:]
        assert "failed its exactly-once audit" not in logs
        wait_for(lambda: plane.describe()["queues"] == [], "the run's queue to be deleted", timeout=60)
        assert plane.describe()["dicts"] == []
        assert len(calls(plane, "produce")) == 1 and len(calls(plane, "setup")) == 1  # reused, never doubled
        wait_for(lambda: all(c["status"] != "running" for c in calls(plane)), "every call to end", timeout=60)
        # the plane took the laptop as gone (its heartbeats stopped) and the detached app went on
        assert [a.client_gone for a in plane.servicer.apps.values()] == [True]
