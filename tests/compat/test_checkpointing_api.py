"""NVRx 0.7's documented local-checkpointing names, written from its docs and signatures."""

from __future__ import annotations

from ftrun.checkpointing import CkptID


def test_ckpt_id_is_nvrx_s_tuple() -> None:
    ckpt_id = CkptID(1, 0, "")
    assert ckpt_id == (1, 0, "") and hash(ckpt_id) == hash((1, 0, ""))
    iteration, rank, session = ckpt_id
    assert (iteration, rank, session, ckpt_id[0], ckpt_id.session_id) == (1, 0, "", 1, "")
