"""The GPU benches' layouts: what `make bench-gpu` runs on a host, and each launcher's GPUs."""

from __future__ import annotations

import pytest
from bench.common.layouts import Layout, layouts_for


@pytest.mark.parametrize(
    ("gpus", "layouts"),
    [(1, ["1"]), (2, ["1", "2", "2x1"]), (4, ["1", "2", "4", "2x2"]), (8, ["1", "2", "4", "2x2"])],
)
def test_the_host_picks_the_layouts(gpus: int, layouts: list[str]) -> None:
    assert layouts_for(gpus) == layouts


def test_two_launchers_share_the_host_by_halves() -> None:
    layout = Layout.parse("2x2")
    assert (layout.world, layout.name) == (4, "2x2")
    assert [layout.node_env(n, "cuda", {}) for n in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]  # fmt: skip
    visible = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert layout.node_env(1, "cuda", visible) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert layout.node_env(1, "cpu", visible) == {}
    assert "--rdzv-endpoint=127.0.0.1:29500" in layout.launcher_args(29500, "job")
    assert Layout.parse("4").launcher_args(0, "job")[0] == "--standalone"


@pytest.mark.parametrize("text", ["0", "x2", "2x0", "two", "2x2x2"])
def test_a_layout_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a layout"):
        Layout.parse(text)
