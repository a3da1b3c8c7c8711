"""`StepSnapshot` on CUDA: the copies run on a side stream into page-locked node memory while
the next steps change the model, and what was saved is the state as of the saved step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ftrun.checkpointing import StepSnapshot

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_snapshots_hold_the_saved_step_while_training_goes_on(tmp_path: Path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shm = Path("/dev/shm") / f"ftrun-test-{tmp_path.name}"
    snapshot = StepSnapshot(shm)
    expected = {}
    x = torch.randn(64, 1024, device="cuda")
    for step in range(1, 13):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if snapshot.save({"model": model, "optimizer": optimizer}, step):
            expected[step] = [t.detach().cpu().clone() for t in model.state_dict().values()]
    snapshot.close()
    fresh = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    step = StepSnapshot(shm).restore({"model": fresh, "optimizer": fresh_optimizer})
    assert step == max(expected)
    got = [t.detach().cpu() for t in fresh.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected[step], strict=True))
    assert fresh_optimizer.state  # the optimizer's moments came back too
    shutil.rmtree(shm, ignore_errors=True)
