"""ftrun.lightning with real Lightning: the finished-flag contract, preemption, timeouts and the
checkpoint IO in one process (a real Trainer, a real RankMonitorServer), then crashes, hangs,
SIGTERM and a straggler with 2 ft_launcher nodes x 2 DDP (gloo) ranks running
examples/lightning_train.py."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

lightning = pytest.importorskip("ftrun.lightning", reason="needs ftrun[lightning]")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ftrun.checkpointing import BasicTensorAwareStateDict, LocalCheckpointManager  # noqa: E402
from ftrun.environment import Env  # noqa: E402
from ftrun.lightning import (  # noqa: E402
    NEWEST,
    Ending,
    FaultToleranceCallback,
    FaultToleranceSectionsCallback,
    HierarchicalCheckpointIO,
    LightningUsageError,
    LocalCheckpointCallback,
    PreemptionCallback,
    SimulatedFault,
    SimulatedFaultError,
    StragglerDetectionCallback,
    state_codec,
)
from ftrun.lightning._compat import (  # noqa: E402
    Callback,
    EarlyStopping,
    LightningModule,
    ModelCheckpoint,
    TorchCheckpointIO,
    Trainer,
)
from ftrun.lightning.fault_tolerance import STATE_KEY  # noqa: E402
from ftrun.straggler import Report  # noqa: E402
from launch import Job, start_job  # noqa: E402

pytestmark = [
    # Lightning's advice for real runs (few workers, no logger, small batches...): not ours.
    pytest.mark.filterwarnings("ignore::UserWarning:pytorch_lightning"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning_fabric"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:pytorch_lightning"),
    pytest.mark.filterwarnings("ignore::FutureWarning:pytorch_lightning"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),  # the `lightning` package
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning"),
    pytest.mark.filterwarnings("ignore::FutureWarning:lightning"),
]


# ---- one process: a tiny model under a real Trainer ------------------------------------------


class Tiny(LightningModule):
    def __init__(self, step_time: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.step_time = step_time

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.step_time:
            time.sleep(self.step_time)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader(n: int = 64) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class At(Callback):
    """Calls `action(trainer)` at the end of training step `step`."""

    def __init__(self, step: int, action: Any) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.action(trainer)


@pytest.fixture
def monitored(make_server, monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process is rank 0 of a real RankMonitorServer (as under ft_launcher). Steps here
    take milliseconds: the safety factor keeps calculated timeouts above the test's pauses."""
    server = make_server(safety_factor=1000.0)
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(Env.FINISHED_FLAG, raising=False)
    server.expect_rank(0, os.getpid())
    return server


def fit(root: Path, callbacks: list, ckpt_path: str | None = None, step_time: float = 0.0,
        **trainer_args: Any) -> Trainer:  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
        callbacks=callbacks, **{"max_steps": 6, "limit_val_batches": 1, **trainer_args},
    )  # fmt: skip
    trainer.fit(Tiny(step_time), loader(), loader(8), ckpt_path=ckpt_path)
    return trainer


def flag(root: Path) -> dict | None:
    path = root / "FINISHED"
    return json.loads(path.read_text()) if path.exists() else None


def stop_now(trainer: Any) -> None:
    trainer.should_stop = True


@pytest.mark.parametrize(
    ("limits", "extra", "ending"),
    [
        ({"max_steps": 6}, [], Ending.MAX_STEPS),
        ({"max_steps": -1, "max_epochs": 2}, [], Ending.MAX_EPOCHS),
        ({"max_steps": -1, "max_time": {"seconds": 0.4}}, [], Ending.MAX_TIME),
        (
            {"max_steps": 100, "val_check_interval": 3},
            [EarlyStopping("val_loss", stopping_threshold=1e9)],
            Ending.EARLY_STOPPING,
        ),
        ({"max_steps": 100}, [At(3, stop_now)], Ending.STOPPED),
    ],
    ids=["max_steps", "max_epochs", "max_time", "early_stopping", "should_stop"],
)
def test_finished_flag_is_written_when_training_ended(monitored, tmp_path, limits, extra, ending):
    ft = FaultToleranceCallback()
    step_time = 0.05 if "max_time" in limits else 0.0
    trainer = fit(tmp_path, [ft, *extra], step_time=step_time, **limits)
    assert ft.ending is ending and ft.client is None
    record = flag(tmp_path)
    assert record["ending"] == ending.value and record["global_step"] == trainer.global_step


def test_no_flag_after_a_crash_and_none_without_autoresume(monitored, tmp_path, monkeypatch):
    crash = FaultToleranceCallback(simulated_fault="exception:0:3")
    with pytest.raises(SimulatedFaultError):
        fit(tmp_path, [crash])
    assert crash.ending is Ending.FAILED and flag(tmp_path) is None
    off = FaultToleranceCallback(autoresume=False)
    fit(tmp_path, [off])
    assert off.ending is Ending.MAX_STEPS and flag(tmp_path) is None
    monkeypatch.setenv(Env.FINISHED_FLAG, str(tmp_path / "slurm" / "DONE"))  # Slurm's choice
    fit(tmp_path, [FaultToleranceCallback()])
    assert (tmp_path / "slurm" / "DONE").exists() and flag(tmp_path) is None


def test_sigterm_saves_stops_without_flag_and_the_next_fit_resumes(monitored, tmp_path):
    ckpt = tmp_path / "preempted.ckpt"
    preempt, ft = PreemptionCallback(checkpoint_path=ckpt), FaultToleranceCallback()
    sigterm = At(3, lambda _: os.kill(os.getpid(), signal.SIGTERM))
    trainer = fit(tmp_path, [sigterm, preempt, ft])
    assert preempt.preempted and trainer.global_step == 3
    assert ft.ending is Ending.INTERRUPTED and flag(tmp_path) is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # Lightning's and ours are gone
    assert torch.load(ckpt, weights_only=False)["global_step"] == 3
    again = PreemptionCallback(checkpoint_path=ckpt)
    resumed = fit(tmp_path, [again, FaultToleranceCallback()], ckpt_path=str(ckpt))
    assert resumed.global_step == 6 and not again.preempted
    assert flag(tmp_path)["ending"] == "max_steps"


def test_a_preemption_at_the_last_step_still_finishes(monitored, tmp_path):
    sigterm = At(6, lambda _: os.kill(os.getpid(), signal.SIGTERM))
    ft = FaultToleranceCallback()
    fit(tmp_path, [sigterm, PreemptionCallback(checkpoint_path=tmp_path / "p.ckpt"), ft])
    assert ft.ending is Ending.MAX_STEPS and flag(tmp_path)["ending"] == "max_steps"


def test_timeouts_are_calculated_after_a_load_and_a_save_and_kept(monitored, tmp_path):
    every2 = {"dirpath": tmp_path / "ckpt", "every_n_train_steps": 2, "save_top_k": -1}
    fit(tmp_path, [FaultToleranceCallback(), ModelCheckpoint(**every2, filename="a{step}")])
    first = torch.load(tmp_path / "ckpt" / "astep=6.ckpt", weights_only=False)
    assert STATE_KEY not in first  # nothing loaded in that run: nothing calculated
    ft = FaultToleranceCallback()
    fit(tmp_path, [ft, ModelCheckpoint(**every2, filename="b{step}")], max_steps=20,
        ckpt_path=str(tmp_path / "ckpt" / "astep=6.ckpt"))  # fmt: skip
    early = torch.load(tmp_path / "ckpt" / "bstep=14.ckpt", weights_only=False)
    assert STATE_KEY not in early  # loaded and saved, but 8 steps are too few to judge
    kept = torch.load(tmp_path / "ckpt" / "bstep=20.ckpt", weights_only=False)[STATE_KEY]
    timeouts = kept["timeouts"]["current_timeouts"]  # NVRx's saved form
    assert timeouts["heartbeat"]["subsequent"] > 0 and timeouts["heartbeat"]["were_calculated"]
    assert timeouts["section"]["calculated_sections"] == ["step"]
    later = FaultToleranceCallback()
    fit(tmp_path, [later], max_steps=21, ckpt_path=str(tmp_path / "ckpt" / "bstep=20.ckpt"))
    assert later._loaded_timeouts == {
        "heartbeat": {k: timeouts["heartbeat"][k] for k in ("initial", "subsequent")},
        "sections": {"step": timeouts["section"]["section"]["step"]},
    }


SECTIONED = {"setup": 600.0, "step": 600.0, "checkpointing": 600.0}


def test_the_sections_callback_times_nvrx_s_sections_and_keeps_timeouts_in_its_file(
    make_server, monkeypatch, tmp_path
):
    """NVRx's FaultToleranceSectionsCallback: a fit from scratch calculates "step" (more than
    16 steps) and "checkpointing"; a resumed fit also "setup" and the out-of-section timeout,
    and finds the first fit's values in `<exp_dir>/_ft_state_.json`."""
    server = make_server(
        safety_factor=1000.0, rank_section_timeouts=SECTIONED, rank_out_of_section_timeout=600.0
    )
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(Env.FINISHED_FLAG, raising=False)
    server.expect_rank(0, os.getpid())
    every5 = {"dirpath": tmp_path / "ckpt", "every_n_train_steps": 5, "save_top_k": -1}
    first = FaultToleranceSectionsCallback(True, True, exp_dir=tmp_path)
    trainer = fit(tmp_path, [first, ModelCheckpoint(**every5, filename="a{step}")], max_steps=20)
    assert trainer.strategy.training_step.__qualname__.startswith("Strategy")  # unwrapped
    state = json.loads((tmp_path / "_ft_state_.json").read_text())["current_timeouts"]["section"]
    assert state["calculated_sections"] == ["checkpointing", "step"]
    assert not state["is_out_of_section_calculated"]  # "setup" not seen after a load yet
    assert flag(tmp_path) is not None  # max_steps reached: finished
    second = FaultToleranceSectionsCallback(True, True, exp_dir=tmp_path)
    fit(tmp_path, [second, ModelCheckpoint(**every5, filename="b{step}")], max_steps=40,
        ckpt_path=str(tmp_path / "ckpt" / "astep=20.ckpt"))  # fmt: skip
    state = json.loads((tmp_path / "_ft_state_.json").read_text())["current_timeouts"]["section"]
    assert state["calculated_sections"] == ["checkpointing", "setup", "step"]
    assert state["is_out_of_section_calculated"]


def test_the_sections_callback_needs_nvrx_s_three_sections(monitored, tmp_path):
    with pytest.raises(ValueError, match="rank_section_timeouts must name exactly"):
        fit(tmp_path, [FaultToleranceSectionsCallback(False, False, exp_dir=tmp_path)])


def test_the_io_resumes_from_the_newest_good_copy(tmp_path):
    io = HierarchicalCheckpointIO(tmp_path / "local", every_n_train_steps=5)
    glob = ModelCheckpoint(tmp_path / "global", filename="{step}", every_n_train_steps=3,
                           save_top_k=-1)  # fmt: skip
    assert io.resume_path(tmp_path / "global") is None
    fit(tmp_path, [io.callback(), glob], plugins=[io], max_steps=10)
    assert io.resume_path(tmp_path / "global") == NEWEST
    order = []
    for damage in ("none", "local", "global9"):
        if damage == "local":
            for part in (tmp_path / "local").rglob("*.ftckpt"):
                part.unlink()
        if damage == "global9":
            (tmp_path / "global" / "step=9.ckpt").write_bytes(b"torn")
        fresh = HierarchicalCheckpointIO(tmp_path / "local", every_n_train_steps=100)
        fresh.resume_path(tmp_path / "global")
        trainer = fit(tmp_path, [], plugins=[fresh], max_steps=11, ckpt_path=NEWEST,
                      enable_checkpointing=False)  # fmt: skip
        assert trainer.global_step == 11
        order.append(fresh.loaded_from)
    assert order == ["local:10", str(tmp_path / "global" / "step=9.ckpt"),
                     str(tmp_path / "global" / "step=6.ckpt")]  # fmt: skip


class Weights(Callback):
    """The model's and the optimizer's tensors after every step, by step."""

    def __init__(self) -> None:
        self.seen: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen[trainer.global_step] = tensors_of(pl_module, trainer.optimizers[0])


def tensors_of(module: Any, optimizer: Any) -> list[torch.Tensor]:
    states = [v for s in optimizer.state.values() for v in s.values()]
    return [t.detach().clone() for t in [*module.parameters(), *states]]


def test_the_io_saves_every_step_behind_the_training_and_resumes_bit_equal(tmp_path):
    """`overlap=True`, every step: every step saved or skipped (never waited for), and a resume
    loads the newest saved step's model and optimizer exactly."""
    io = HierarchicalCheckpointIO(tmp_path / "local", every_n_train_steps=1, overlap=True)
    weights = Weights()
    fit(tmp_path, [io.callback(), weights], plugins=[io], max_steps=12)
    newest = io.manager.find_latest()
    assert newest >= 12 - io.skipped - 1 and io.skipped < 12
    fresh = HierarchicalCheckpointIO(tmp_path / "local", every_n_train_steps=100)
    fresh.resume_path(tmp_path / "global")
    restored = {}

    class Restored(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            restored["step"] = trainer.global_step
            restored["tensors"] = tensors_of(pl_module, trainer.optimizers[0])

    fit(tmp_path, [Restored()], plugins=[fresh], max_steps=newest + 1, ckpt_path=NEWEST,
        enable_checkpointing=False)  # fmt: skip
    assert fresh.loaded_from == f"local:{newest}" and restored["step"] == newest
    expected = weights.seen[newest]
    assert len(restored["tensors"]) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(restored["tensors"], expected, strict=True))


class NVRxStyleIO(HierarchicalCheckpointIO):
    """As NVRx's users write it: the two hooks NVRx leaves abstract."""

    def to_tensor_aware_state_dict(self, checkpoint):
        return BasicTensorAwareStateDict(checkpoint)

    def from_tensor_aware_state_dict(self, tensor_aware_checkpoint, **kwargs):
        return tensor_aware_checkpoint.state_dict


def test_nvrx_s_form_of_the_io_and_callback_resumes_from_the_newer_copy(tmp_path):
    """NVRx's constructors: `HierarchicalCheckpointIO.get_partial_wrapper_constructor(manager,
    fn)(TorchCheckpointIO())` and `LocalCheckpointCallback(every_n_train_steps=4)`; then
    `load_checkpoint(path)` takes the local copy when it is at least as new as the file."""

    def global_step_of(path):
        return torch.load(path, weights_only=False)["global_step"]

    def make_io():
        manager = LocalCheckpointManager(tmp_path / "local")
        return NVRxStyleIO.get_partial_wrapper_constructor(manager, global_step_of)(
            TorchCheckpointIO()
        )

    io = make_io()
    assert io.async_save is False and io.local_ckpt_manager is io.manager  # NVRx's defaults
    glob = ModelCheckpoint(tmp_path / "global", filename="{step}", every_n_train_steps=3,
                           save_top_k=-1)  # fmt: skip
    fit(tmp_path, [LocalCheckpointCallback(every_n_train_steps=4), glob], plugins=[io],
        max_steps=8)  # fmt: skip
    assert io.manager.find_latest() == 8 and (tmp_path / "local" / "iter_0000008").is_dir()
    resumed = make_io()
    trainer = fit(tmp_path, [], plugins=[resumed], max_steps=9, enable_checkpointing=False,
                  ckpt_path=str(tmp_path / "global" / "step=6.ckpt"))  # fmt: skip
    assert resumed.loaded_from == "local:8" and trainer.global_step == 9
    LocalCheckpointManager(tmp_path / "local").save({"x": torch.ones(1)}, 2)  # an older one only
    for part in (tmp_path / "local").glob("iter_000000[48]"):
        for child in part.iterdir():
            child.unlink()
        part.rmdir()
    older = make_io()
    fit(tmp_path, [], plugins=[older], max_steps=7, enable_checkpointing=False,
        ckpt_path=str(tmp_path / "global" / "step=6.ckpt"))  # fmt: skip
    assert older.loaded_from is None  # local 2 < global 6: the global file


def test_nvrx_s_callback_needs_the_io_in_the_plugins(tmp_path):
    with pytest.raises(LightningUsageError, match="needs a HierarchicalCheckpointIO"):
        fit(tmp_path, [LocalCheckpointCallback(every_n_train_steps=2)])


def test_a_lightning_checkpoint_round_trips_through_the_local_format():
    items = state_codec.ITEMS_KEY
    state = {"optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}, 1: {}},
                                   "param_groups": [{"params": [0, 1], "betas": (0.9, 0.99)}]}],
             "odd": {(1, "a"): None, items: 1}, "hp": {"lr": 0.1}}  # fmt: skip
    encoded = state_codec.encode(state)
    assert set(encoded["odd"]) == {items}
    back = state_codec.decode(encoded)
    assert back["odd"] == {(1, "a"): None, items: 1} and back["hp"] == {"lr": 0.1}
    assert back["optimizer_states"][0]["state"][0]["step"].item() == 3.0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: HierarchicalCheckpointIO("/tmp/x", every_n_train_steps=0), "every_n_train_steps"),
        (lambda: PreemptionCallback(sig=signal.SIGKILL), "SIGKILL cannot be caught"),
        (lambda: SimulatedFault("boom", 0, 1), "kind must be one of"),
        (lambda: SimulatedFault("hang", -1, 1), "rank must be an int >= 0"),
        (lambda: FaultToleranceCallback(simulated_fault="hang:1"), "KIND:RANK:STEP"),
        (lambda: straggler_callback(report_time_interval=-1), "report_time_interval must be"),
        (lambda: straggler_callback(gpu_relative_perf_threshold=2), "must be in \\[0, 1\\]"),
        (lambda: PreemptionCallback(check_interval=0), "check_interval must be in"),
    ],
)
def test_bad_arguments_are_one_line_errors(make, message):
    with pytest.raises(LightningUsageError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def straggler_callback(**overrides: Any) -> StragglerDetectionCallback:
    args = {
        "report_time_interval": 1.0, "calc_relative_gpu_perf": True,
        "calc_individual_gpu_perf": True, "num_gpu_perf_scores_to_print": 2,
        "gpu_relative_perf_threshold": 0.7, "gpu_individual_perf_threshold": 0.7,
        "enable_ptl_logging": False,
    }  # fmt: skip
    return StragglerDetectionCallback(**{**args, **overrides})


def test_straggler_reports_name_slow_ranks_from_gpu_or_section_scores(caplog):
    callback = straggler_callback()
    section = "DDPStrategy.training_step"
    cpu = Report({}, {section: {0: 1.0, 1: 0.5}}, {}, {section: {0: 1.0, 1: 0.6}},
                 {0: "n0", 1: "n1"}, {}, {}, 0.0, True, 0)  # fmt: skip
    with caplog.at_level("INFO", logger="ftrun.lightning"):
        assert callback._handle(cpu, None)
    assert callback.last_stragglers == {"relative": {(1, "n1")}, "individual": {(1, "n1")}}
    assert (
        "Affected ranks: rank 1 on n1" in caplog.text and "Rank=1 Node=n1 Score=0.50" in caplog.text
    )
    gpu = Report({0: 0.9, 1: 0.8}, {section: {1: 0.1}}, {}, {}, {0: "n0", 1: "n1"}, {}, {},
                 0.0, True, 0)  # fmt: skip
    assert not callback._handle(gpu, None)  # GPU scores, when there are some, come first


# ---- 2 ft_launcher nodes x 2 ranks running examples/lightning_train.py -----------------------

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_train.py"
LAUNCHER = [
    "--ft-prewarm-modules=torch,torch.distributed,pytorch_lightning",
    "--rdzv-conf=last_call_timeout=5",
]


def resumes(job: Job) -> dict[int, set[tuple[int, str]]]:
    """cycle -> {(first step, what it resumed from)} over every rank (one element: all agree)."""
    found: dict[int, set[tuple[int, str]]] = {}
    for path in job.ckpt_dir.glob("resume-rank*.txt"):
        for line in path.read_text().splitlines():
            cycle, step, source = line.split()
            found.setdefault(int(cycle), set()).add((int(step), source))
    return found


def worker_log(job: Job, cycle: int, rank: int) -> str:
    return "".join(p.read_text() for p in job.log_dir.glob(f"*/cycle{cycle}/rank{rank}/*.log"))


@pytest.mark.process
def test_a_crash_and_a_hang_resume_from_the_newest_checkpoint_with_calculated_timeouts(tmp_path):
    """Cycle 0: rank 3 is killed at step 12; cycle 1 resumes from the local checkpoint of step
    10, calculates timeouts after its first save, and rank 0 hangs at step 37: the configured
    heartbeat timeout is 10 minutes, so only the calculated ones can catch it; cycle 2 resumes
    from step 35 with the timeouts it found in the checkpoint and finishes."""
    job = start_job(
        tmp_path, 2,
        [*LAUNCHER, "--max-restarts=3", "--ft-safety-factor=20", "--ft-workload-check-interval=0",
         "--ft-initial-rank-heartbeat-timeout=600", "--ft-rank-heartbeat-timeout=600"],
        ["--max-steps", "50", "--step-time", "0.02", "--fault", "kill:3:12",
         "--fault", "hang:0:37:1"],
        script=EXAMPLE, nproc=2,
    )  # fmt: skip
    assert job.wait(150) == [0, 0]
    assert resumes(job) == {0: {(0, "scratch")}, 1: {(10, "local:10")}, 2: {(35, "local:35")}}
    # Rank 0 hangs; the others wait for it in a collective and miss their heartbeats too. Which
    # rank is judged first rests on about one step of deadline (load flips it): any may be.
    hangs = job.events("hang")
    assert hangs and all(h["cycle"] == 1 and h["timeout"] < 60 for h in hangs), hangs
    assert "fault tolerance: timeouts from the checkpoint" in worker_log(job, 2, 0)
    assert json.loads((job.ckpt_dir / "FINISHED").read_text())["ending"] == "max_steps"
