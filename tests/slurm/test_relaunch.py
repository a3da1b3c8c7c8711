"""slurm/relaunch.py without Slurm: the decision table, parsing, and the `finish` command run
against fake `sbatch`/`scontrol` executables that record how they were called."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.errors import ExitCode

RELAUNCH_PY = Path(__file__).resolve().parents[2] / "slurm" / "relaunch.py"
_spec = importlib.util.spec_from_file_location("ftrun_slurm_relaunch", RELAUNCH_PY)
assert _spec and _spec.loader
relaunch = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = relaunch  # dataclasses look their module up by name
_spec.loader.exec_module(relaunch)

Action, JobEnding, decide = relaunch.Action, relaunch.JobEnding, relaunch.decide
RELAUNCH, STOP = Action.RELAUNCH, Action.STOP


def test_exit_codes_mirror_ftrun_errors():
    # relaunch.py copies them so that it runs without ftrun installed; they must not drift.
    assert relaunch.SUCCESS == ExitCode.SUCCESS
    assert relaunch.FAILED == ExitCode.FAILED
    assert relaunch.USAGE == ExitCode.USAGE
    assert relaunch.DO_NOT_RELAUNCH == ExitCode.DO_NOT_RELAUNCH
    assert relaunch.NO_PROGRESS == ExitCode.NO_PROGRESS
    assert relaunch.EXCLUDED == ExitCode.EXCLUDED
    assert relaunch.REPEATED_FAILURE == ExitCode.REPEATED_FAILURE
    assert relaunch.RESUME_TO_DISAMBIGUATE == ExitCode.RESUME_TO_DISAMBIGUATE
    assert relaunch.FAILED_ON_RESULT_VALIDATION == ExitCode.FAILED_ON_RESULT_VALIDATION
    assert relaunch.PREEMPTED == ExitCode.PREEMPTED


@pytest.mark.parametrize(
    ("codes", "finished", "so_far", "ending", "action", "exit_code"),
    [
        # finished wins over everything, even launchers that failed after writing the flag
        ([0, 0], True, 0, JobEnding.RUNNING, STOP, 0),
        ([1, 75], True, 3, JobEnding.CANCELLED, STOP, 0),
        # a refusal on any node wins over a relaunchable code elsewhere
        ([3, 75], False, 0, JobEnding.RUNNING, STOP, 3),
        ([1, 2], False, 0, JobEnding.RUNNING, STOP, 2),
        ([3, 2], False, 0, JobEnding.TIME_LIMIT, STOP, 3),
        # success: done when no flag is used; with a flag, success without it is not done
        ([0, 0], None, 0, JobEnding.RUNNING, STOP, 0),
        ([0, 0], False, 0, JobEnding.RUNNING, RELAUNCH, 0),
        # hot spares replaced nodes that were lost, excluded or unhealthy: the job succeeded
        ([0, None, 0], None, 0, JobEnding.RUNNING, STOP, 0),
        ([0, 137, 5, 3], None, 0, JobEnding.RUNNING, STOP, 0),
        ([4, 4], None, 0, JobEnding.RUNNING, STOP, 4),
        # the same failure on several nodes: a software fault, never relaunched
        ([6, 6], None, 0, JobEnding.RUNNING, STOP, 6),
        ([6, 1, 75], False, 0, JobEnding.RUNNING, STOP, 6),
        # the re-run state machine: 16 relaunches (other GPUs decide), 17 stops
        ([16, 16], False, 0, JobEnding.RUNNING, RELAUNCH, 16),
        ([17, 17, 17], False, 0, JobEnding.RUNNING, STOP, 17),
        # relaunchable: budget spent in the job, preempted, killed, no code at all
        ([1, 1], False, 0, JobEnding.RUNNING, RELAUNCH, 1),
        ([75, 75], False, 2, JobEnding.RUNNING, RELAUNCH, 75),
        ([0, 75], None, 0, JobEnding.RUNNING, RELAUNCH, 75),
        ([137, 1], False, 0, JobEnding.RUNNING, RELAUNCH, 1),
        ([137, 0], False, 0, JobEnding.RUNNING, RELAUNCH, 137),
        ([None, 75], False, 0, JobEnding.RUNNING, RELAUNCH, 1),
        ([None, None], False, 0, JobEnding.TIME_LIMIT, RELAUNCH, 1),
        # the job relaunch budget
        ([1, 1], False, 3, JobEnding.RUNNING, STOP, 1),
        ([75, 75], False, 3, JobEnding.TIME_LIMIT, STOP, 75),
        # Slurm is cancelling the job (scancel, its own preemption): never relaunch
        ([75, 75], False, 0, JobEnding.CANCELLED, STOP, 75),
    ],
)
def test_decide(codes, finished, so_far, ending, action, exit_code):
    decision = decide(codes, finished, so_far, 3, ending)
    assert (decision.action, decision.exit_code) == (action, exit_code), decision.reason


def test_decide_reasons_say_why():
    assert "budget spent (3 of 3)" in decide([1, 1], False, 3, 3).reason
    assert decide([0, 0], False, 0, 3).reason.endswith("finished flag is missing")
    assert decide([75, 75], False, 0, 3, JobEnding.TIME_LIMIT).reason.startswith("time limit")
    assert decide([3, 0], False, 0, 3).reason == "a launcher exited 3 (do not relaunch)"
    assert decide([None, 1], False, 0, 3).reason == "1x no exit code, 1x 1 (restart budget spent)"
    assert decide([], False, 0, 0).action is STOP


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5", 300),
        ("5:30", 330),
        ("01:02:03", 3723),
        ("2-03", 2 * 86400 + 3 * 3600),
        ("2-03:04", 2 * 86400 + 3 * 3600 + 4 * 60),
        ("1-00:00:10", 86410),
        ("UNLIMITED", None),
        ("Partition_Limit", None),
        ("", None),
    ],
)
def test_duration_s(text, seconds):
    assert relaunch.duration_s(text) == seconds


@pytest.mark.parametrize(
    ("record", "ending"),
    [
        ({"JobState": "RUNNING", "RunTime": "00:00:50", "TimeLimit": "00:01:00"}, "running"),
        ({"JobState": "COMPLETING", "RunTime": "00:00:20", "TimeLimit": "00:01:00"}, "cancelled"),
        ({"JobState": "COMPLETING", "RunTime": "00:01:00", "TimeLimit": "00:01:00"}, "time_limit"),
        ({"JobState": "COMPLETING", "RunTime": "00:01:00", "TimeLimit": "UNLIMITED"}, "cancelled"),
        ({"JobState": "TIMEOUT", "RunTime": "00:00:01", "TimeLimit": "UNLIMITED"}, "time_limit"),
        ({"JobState": "CANCELLED"}, "cancelled"),
    ],
)
def test_job_ending(record, ending):
    assert relaunch.job_ending(record).value == ending


def test_parse_job_record_keeps_values_with_spaces_and_equals():
    line = (
        "JobId=7 JobName=ftrun JobState=RUNNING TimeLimit=00:01:00 "
        "Command=/x/ftrun.sbatch --ft-job-dir=/j train.py WorkDir=/w Comment=a=b"
    )
    record = relaunch.parse_job_record(line)
    assert record["Command"] == "/x/ftrun.sbatch --ft-job-dir=/j train.py"
    assert record["WorkDir"] == "/w"
    assert record["Comment"] == "a=b"


def test_sbatch_argv_pins_the_job_shape_then_extra_options_then_arguments():
    record = {
        "NumNodes": "2",
        "TimeLimit": "04:00:00",
        "Partition": "gpu",
        "Account": "(null)",
        "QOS": "normal",
        "JobName": "my job",
        "WorkDir": "/w",
    }
    argv = relaunch.sbatch_argv(
        record, "/j/ftrun.sbatch", ["--nnodes=2", "t.py"], "/j", "--gres=gpu:8 --comment='a b'"
    )
    assert argv == [
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--time=04:00:00",
        "--partition=gpu",
        "--qos=normal",
        "--job-name=my job",
        "--chdir=/w",
        "--gres=gpu:8",
        "--comment=a b",
        "/j/ftrun.sbatch",
        "--ft-job-dir=/j",
        "--nnodes=2",
        "t.py",
    ]


@pytest.mark.parametrize("limit", ["UNLIMITED", "365-00:00:00"])
def test_sbatch_argv_leaves_no_limit_to_slurm(limit):
    argv = relaunch.sbatch_argv({"TimeLimit": limit}, "s", [], "/j")
    assert not [a for a in argv if a.startswith("--time")]


def test_sbatch_env_drops_this_jobs_variables():
    env = {"SLURM_JOB_ID": "7", "SLURM_CONF": "/c", "SBATCH_ACCOUNT": "a", "HOME": "/h"}
    assert relaunch.sbatch_env(env) == {"SLURM_CONF": "/c", "SBATCH_ACCOUNT": "a", "HOME": "/h"}


def test_read_codes(tmp_path: Path):
    (tmp_path / "exit-0").write_text("75 n1\n")
    (tmp_path / "exit-2").write_text("garbage\n")
    assert relaunch.read_codes(tmp_path, 3) == ([75, None, None], ["n1", None, None])
    assert relaunch.read_codes(None, 2) == ([None, None], [None, None])


def test_history_skips_a_torn_line(tmp_path: Path):
    relaunch.append_history(tmp_path, {"decision": "relaunch"})
    with (tmp_path / relaunch.HISTORY_FILE).open("a") as f:
        f.write('{"decision": "rel')  # a writer killed mid-line
    relaunch.append_history(tmp_path, {"decision": "relaunch"})
    history = relaunch.read_history(tmp_path)
    assert len(history) == 2
    assert relaunch.relaunch_count(history) == 2


# ---- excluding the nodes the agents judged unhealthy ----------------------------------------


def unhealthy(node: str, reason: str = "health check failed", ts: float = 100.0) -> dict:
    return {"event": "unhealthy", "node": node, "ts": ts, "cycle": 0, "reason": reason}


def exited(node: str, code: int, why: str = "", ts: float = 101.0) -> dict:
    return {"event": "exit", "node": node, "ts": ts, "cycle": 0, "code": code, "why": why}


def test_node_verdicts_name_the_unhealthy_and_the_excluded():
    events = [
        unhealthy("n2", "NVML: GPU 3 lost"),
        exited("n2", 3, "node unhealthy: NVML: GPU 3 lost"),  # its exit adds nothing
        exited("n3", 5, "node n3 excluded: the same failure 3 times on it"),
        exited("n1", 1, "restart budget spent"),  # a failure is no verdict on a node
        exited("n4", 3, "rank 0 asked to shut the workload down"),
        unhealthy("n5", ts=5.0),  # before `since`: an earlier run's, in a shared --log-dir
        {"event": "unhealthy", "ts": 100.0},  # no node: skipped
    ]
    assert relaunch.node_verdicts(events, since=50.0) == {
        "n2": "unhealthy: NVML: GPU 3 lost",
        "n3": "excluded: node n3 excluded: the same failure 3 times on it",
    }
    assert "n5" in relaunch.node_verdicts(events)


def test_merge_verdicts_keeps_the_oldest_first_and_moves_a_node_judged_again():
    kept = [("n1", "old"), ("n2", "old")]
    assert relaunch.merge_verdicts(kept, {"n1": "new", "n3": "x"}) == [
        ("n2", "old"), ("n1", "new"), ("n3", "x"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("judged", "own", "pool", "needed", "kept", "let_in"),
    [
        (["n2"], [], None, 2, ["n2"], []),  # pool unknown: every verdict kept
        (["n2"], [], ["n1", "n2", "n3"], 2, ["n2"], []),
        # 3 of 3 needed: no node can be spared
        (["n2"], [], ["n1", "n2", "n3"], 3, [], ["n2"]),
        # newest kept, oldest let back in
        (["n3", "n2"], [], ["n1", "n2", "n3"], 2, ["n2"], ["n3"]),
        # the job's own exclusions count against the pool, and are never let in
        (["n2"], ["n3"], ["n1", "n2", "n3"], 2, [], ["n2"]),
        (["n3"], ["n3"], ["n1", "n2", "n3"], 2, [], []),  # already excluded by the job
        (["x9"], [], ["n1", "n2"], 2, ["x9"], []),  # not in the partition: costs nothing
    ],
)
def test_plan_exclusion_keeps_the_newest_verdicts_that_leave_enough_nodes(
    judged, own, pool, needed, kept, let_in
):
    plan = relaunch.plan_exclusion(judged, own, pool, needed, "debug")
    assert (list(plan.judged), list(plan.let_in)) == (kept, let_in)
    assert plan.slurm_list == ",".join(dict.fromkeys([*own, *kept]))
    assert bool(plan.note) == bool(let_in)


def test_plan_exclusion_says_in_one_line_why_a_node_is_let_back_in():
    plan = relaunch.plan_exclusion(["n3", "n2"], [], ["n1", "n2", "n3"], 2, "debug")
    assert plan.note == (
        "excluding n2,n3 would leave 1 of partition debug's 3 nodes for a 2-node job: "
        "not excluding n3 (the oldest verdicts)"
    )


def test_an_unhealthy_nodes_refusal_is_waived_only_where_it_is_excluded():
    codes, names, verdicts = [1, 3], ["n1", "n2"], {"n2": "unhealthy: x"}
    seen = relaunch.waive_excluded(codes, names, verdicts, ["n2"])
    assert seen == [1, 5]
    assert decide(seen, None, 0, 3).action is RELAUNCH
    # not excluded (too few nodes): its 3 stands, as does a 3 without a verdict (a shutdown)
    assert decide(relaunch.waive_excluded(codes, names, verdicts, []), None, 0, 3).action is STOP
    assert relaunch.waive_excluded([3, 3], names, {}, ["n2"]) == [3, 3]


def test_sbatch_argv_merges_the_exclusions_of_ftrun_sbatch_args():
    argv = relaunch.sbatch_argv({}, "s", [], "/j", "--exclude=m[1-2] -x m7 --mem=0", "n2,n3")
    assert argv[:4] == ["sbatch", "--parsable", "--mem=0", "--exclude=m[1-2],m7,n2,n3"]
    assert "--exclude" not in " ".join(relaunch.sbatch_argv({}, "s", [], "/j", "", ""))


def test_read_excluded_skips_comments_and_blank_lines(tmp_path: Path):
    relaunch.write_excluded(tmp_path, [("n2", "unhealthy:  GPU\nlost")])
    with (tmp_path / relaunch.EXCLUDED_FILE).open("a") as f:
        f.write("\n# n9 let back in by hand\nn4\n")
    assert relaunch.read_excluded(tmp_path) == [("n2", "unhealthy: GPU lost"), ("n4", "")]


# ---- `relaunch.py finish` as the batch script runs it, with fake Slurm clients -------------

FAKE_CLIENT = """#!/bin/sh
printf '%s\\n' "$(basename "$0") $* SLURM_JOB_ID=${SLURM_JOB_ID:-unset}" >>"$FAKE_LOG"
case "$(basename "$0") $1 $2" in
  "scontrol show job") echo "JobId=41 JobState=$FAKE_STATE NumNodes=2 TimeLimit=UNLIMITED" \\
    "WorkDir=/w Partition=debug ExcNodeList=${FAKE_EXC:-(null)} ReqNodeList=${FAKE_REQ:-(null)}" ;;
  "scontrol show hostnames") echo "$3" | tr ',' '\\n' ;;
  "scontrol requeue"*) exit "$FAKE_RC" ;;
  "scontrol update"*) ;;
  "sinfo "*) printf 'n1\\nn2\\nn3\\n' ;;
  "sbatch --parsable"*) [ "$FAKE_RC" = 0 ] && echo "42;cluster" || { echo nope >&2; exit 1; } ;;
esac
"""


def write_events(log_dir: Path, events) -> None:
    """Each node's events in `<log dir>/events-<node>.jsonl`, as the launchers write them."""
    for path in log_dir.glob("events-*.jsonl"):
        path.unlink()
    log_dir.mkdir(parents=True, exist_ok=True)
    for event in events:
        with (log_dir / f"events-{event['node']}.jsonl").open("a") as f:
            f.write(json.dumps(event) + "\n")


def run_finish(tmp_path: Path, codes: list[int], *extra: str, state="RUNNING", rc=0,
               args=("train.py", "--lr=1"), events=(), exc="(null)", req="(null)"):  # fmt: skip
    bin_dir, run_dir, job_dir = tmp_path / "bin", tmp_path / "run", tmp_path / "job"
    for d in (bin_dir, run_dir, job_dir):
        d.mkdir(exist_ok=True)
    write_events(run_dir / "logs", events)
    for name in ("sbatch", "scontrol", "sinfo"):
        (bin_dir / name).write_text(FAKE_CLIENT)
        (bin_dir / name).chmod(0o755)
    for procid, code in enumerate(codes):
        (run_dir / f"exit-{procid}").write_text(f"{code} n{procid + 1}\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "41",
        "FAKE_LOG": str(tmp_path / "calls.log"),
        "FAKE_STATE": state,
        "FAKE_RC": str(rc),
        "FAKE_EXC": exc,
        "FAKE_REQ": req,
    }
    argv = [sys.executable, str(RELAUNCH_PY), "finish", "--job-dir", str(job_dir)]
    argv += ["--run-dir", str(run_dir), "--nodes", str(len(codes)), "--max-relaunches", "1"]
    argv += ["--script", str(job_dir / "ftrun.sbatch"), *extra, "--", *args]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    log = tmp_path / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, relaunch.read_history(job_dir), calls


def test_finish_resubmits_and_records_the_new_job(tmp_path: Path):
    proc, history, calls = run_finish(tmp_path, [75, 75])
    assert proc.returncode == 75, proc.stderr
    (record,) = history
    assert record["decision"] == "relaunch" and record["next_job_id"] == "42"
    assert record["codes"] == [75, 75] and record["nodes"] == ["n1", "n2"]
    assert record["relaunches"] == 1 and record["job_id"] == "41"
    job_dir = tmp_path / "job"
    sbatch = [c for c in calls if c.startswith("sbatch")]
    assert sbatch == [
        f"sbatch --parsable --nodes=2 --partition=debug --chdir=/w {job_dir}/ftrun.sbatch "
        f"--ft-job-dir={job_dir} train.py --lr=1 SLURM_JOB_ID=unset"
    ]


def test_finish_takes_the_no_restart_exit_code_for_a_refusal(tmp_path: Path):
    """NVRx's --ft-no-restart-exit-code among the launchers' options: its code stops the
    chain of runs, as the 4 and 6 it stands for do."""
    args = ("--nnodes=2", "--ft-no-restart-exit-code", "93", "train.py")
    proc, history, calls = run_finish(tmp_path, [93, 75], args=args)
    assert proc.returncode == 93, proc.stderr
    assert [r["decision"] for r in history] == ["stop"]
    assert "a launcher exited 93 (--ft-no-restart-exit-code" in history[0]["reason"]
    assert not [c for c in calls if c.startswith("sbatch")]


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--ft-no-restart-exit-code=93", "t.py"], 93),
        (["--ft_no_restart_exit_code", "42", "t.py", "--ft-no-restart-exit-code=9"], 42),
        (["t.py", "--lr=1"], None),
        (["--ft-no-restart-exit-code"], None),
    ],
)
def test_no_restart_code_is_read_from_the_launcher_options(args, code):
    assert relaunch.no_restart_code(args) == code
    if code is not None:  # the refusal wins over a relaunch, and over ftrun's own codes
        decision = decide([1, code, 4], False, 0, 3, no_restart=code)
        assert (decision.action, decision.exit_code) == (STOP, code)
        assert decide([1, code], False, 0, 3).action is RELAUNCH  # unknown without it


def test_finish_stops_once_the_budget_is_spent(tmp_path: Path):
    run_finish(tmp_path, [1, 1])
    proc, history, calls = run_finish(tmp_path, [1, 1])
    assert proc.returncode == 1
    assert [r["decision"] for r in history] == ["relaunch", "stop"]
    assert "budget spent (1 of 1)" in history[-1]["reason"]
    assert len([c for c in calls if c.startswith("sbatch")]) == 1


def test_finish_records_a_failed_resubmit_as_stop(tmp_path: Path):
    proc, history, _ = run_finish(tmp_path, [1, 1], rc=1)
    assert proc.returncode == 1
    assert history[-1]["decision"] == "stop"
    assert "resubmit failed: nope" in history[-1]["reason"]
    assert history[-1]["relaunches"] == 0


def test_finish_requeues_after_recording(tmp_path: Path):
    proc, history, calls = run_finish(tmp_path, [75, 75], "--mode", "requeue")
    assert proc.returncode == 75, proc.stderr
    assert [r["decision"] for r in history] == ["relaunch"]
    assert history[0]["next_job_id"] == "41"
    assert "scontrol requeue 41 SLURM_JOB_ID=41" in calls


def test_finish_does_not_relaunch_a_cancelled_job(tmp_path: Path):
    proc, history, calls = run_finish(tmp_path, [75, 75], state="COMPLETING")
    assert proc.returncode == 75
    assert history[-1]["decision"] == "stop" and history[-1]["ending"] == "cancelled"
    assert not [c for c in calls if c.startswith("sbatch")]


def test_finish_without_launchers_when_already_finished(tmp_path: Path):
    flag = tmp_path / "FINISHED"
    flag.write_text("done\n")
    proc, history, _ = run_finish(tmp_path, [], "--finished-flag", str(flag))
    assert proc.returncode == 0
    assert history[-1]["decision"] == "stop" and history[-1]["finished"] is True
    assert json.dumps(history[-1]["codes"]) == "[]"


def test_finish_keeps_a_node_judged_unhealthy_out_of_every_later_job(tmp_path: Path):
    # Run 0: n2 fails its health check (exits 3) and n1 cannot go on alone (1).
    proc, history, calls = run_finish(tmp_path, [1, 3], "--max-relaunches", "2",
                                      events=[unhealthy("n2", "GPU 3 lost")])  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert history[-1]["decision"] == "relaunch", history[-1]
    assert history[-1]["unhealthy"] == {"n2": "unhealthy: GPU 3 lost"}
    assert history[-1]["exclude"] == ["n2"]
    assert history[-1]["reason"].endswith("the next job excludes n2 (judged unhealthy)")
    assert "n2 judged unhealthy in this run: unhealthy: GPU 3 lost" in proc.stderr
    assert next(c for c in calls if c.startswith("sbatch")).count("--exclude=n2 ") == 1
    assert relaunch.read_excluded(tmp_path / "job") == [("n2", "unhealthy: GPU 3 lost")]
    # Run 1 (n1 and n3; the job's ExcNodeList is n2): n1 left on a verdict (5). Keeping both
    # out would leave one of the 3 nodes for a 2-node job: n2, the older verdict, comes back.
    (tmp_path / "calls.log").unlink()
    gone = exited("n1", 5, "a GPU fell off the bus")
    proc, history, calls = run_finish(tmp_path, [5, 1], "--max-relaunches", "2", exc="n2",
                                      events=[gone])  # fmt: skip
    assert history[-1]["decision"] == "relaunch" and history[-1]["exclude"] == ["n1"]
    assert "excluding n1,n2 would leave 1 of partition debug's 3 nodes" in proc.stderr
    (sbatch,) = [c for c in calls if c.startswith("sbatch")]
    assert "--exclude=n1 " in sbatch, sbatch
    assert [n for n, _ in relaunch.read_excluded(tmp_path / "job")] == ["n2", "n1"]


def test_finish_stops_when_an_unhealthy_node_cannot_be_spared(tmp_path: Path):
    """The job's own --exclude=n3 leaves n1 and n2 for 2 nodes: n2 cannot be kept out, so
    its 3 stands (do not relaunch), and the output says why in one line."""
    proc, history, calls = run_finish(tmp_path, [1, 3], exc="n3", events=[unhealthy("n2")])
    assert proc.returncode == 3
    assert history[-1]["decision"] == "stop" and history[-1]["exclude"] == []
    assert history[-1]["reason"] == (
        "a launcher exited 3 (do not relaunch); n2 judged unhealthy, too few nodes to exclude"
    )
    assert (
        "excluding n2 would leave 1 of partition debug's 3 nodes for a 2-node job: not "
        "excluding n2" in proc.stderr
    )
    assert not [c for c in calls if c.startswith("sbatch")]


def test_finish_carries_the_jobs_own_exclusions_and_forgets_cleared_ones(tmp_path: Path):
    run_finish(tmp_path, [1, 3], "--max-relaunches", "3", events=[unhealthy("n2")])
    (tmp_path / "job" / relaunch.EXCLUDED_FILE).unlink()  # an operator lets n2 back in
    (tmp_path / "calls.log").unlink()
    # The job's ExcNodeList: n2 (ours, last run) and m5 (the user's own sbatch --exclude).
    _, history, calls = run_finish(tmp_path, [1, 1], "--max-relaunches", "3", exc="m5,n2")
    (sbatch,) = [c for c in calls if c.startswith("sbatch")]
    assert "--exclude=m5 " in sbatch, sbatch
    assert history[-1]["exclude"] == []


def test_finish_sets_the_requeued_jobs_excluded_nodes(tmp_path: Path):
    proc, _, calls = run_finish(tmp_path, [1, 3], "--mode", "requeue", events=[unhealthy("n2")])
    assert proc.returncode == 1, proc.stderr
    requeue = calls.index("scontrol requeue 41 SLURM_JOB_ID=41")
    assert calls[requeue + 1] == "scontrol update JobId=41 ExcNodeList=n2 SLURM_JOB_ID=41"
    assert "requeued job 41: ExcNodeList set (n2)" in proc.stderr
    # Nothing judged, nothing to change: no update.
    (tmp_path / "job" / relaunch.EXCLUDED_FILE).unlink()
    (tmp_path / "calls.log").unlink()
    _, _, calls = run_finish(tmp_path, [75, 75], "--mode", "requeue", "--max-relaunches", "3")
    assert not [c for c in calls if c.startswith("scontrol update")]


def test_finish_does_not_exclude_a_node_a_requeued_job_requires(tmp_path: Path):
    """Requeue keeps the job's --nodelist: excluding a node of it would leave the job pending
    for ever, so n2 is not excluded and its 3 stands (resubmit does not carry --nodelist)."""
    proc, history, calls = run_finish(tmp_path, [1, 3], "--mode", "requeue", req="n1,n2",
                                      events=[unhealthy("n2")])  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert history[-1]["decision"] == "stop" and history[-1]["exclude"] == []
    assert "not excluding n2: the job requires it (--nodelist)" in proc.stderr
    assert not [c for c in calls if c.startswith(("scontrol requeue", "scontrol update"))]
    _, history, _ = run_finish(tmp_path, [1, 3], req="n1,n2", events=[unhealthy("n2")])
    assert history[-1]["decision"] == "relaunch" and history[-1]["exclude"] == ["n2"]
