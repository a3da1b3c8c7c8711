"""`ftrun.gloo_exit` without processes: which gloo worker threads count as busy, and the wait
that lets them finish before a gloo group's last reference goes (a busy one still frees a
finished collective and needs the GIL that the group's destructor holds while joining it)."""

from __future__ import annotations

from ftrun.gloo_exit import busy_gloo_workers, wait_gloo_idle


def stat(tid: int, comm: str, state: str) -> str:
    return f"{tid} ({comm}) {state} 1 1 1 0 -1 4194368 0 0 0 0 5 3 0 0 20 0 6 0"


def test_only_runnable_gloo_workers_are_busy():
    stats = {
        10: stat(10, "python", "R"),  # the main thread: not gloo's
        11: stat(11, "pt_gloo_runloop", "S"),  # waits on its queue (or for the GIL)
        12: stat(12, "pt_gloo_runloop", "R"),  # still freeing a finished work
        13: stat(13, "gloo_tcp_loop", "R"),  # the transport's loop holds no work
        14: stat(14, "pt_gloo_runloop", "D"),
        15: "15 (a) b) R 1",  # a name with a parenthesis and a space
        16: "garbage",
    }
    assert busy_gloo_workers(stats) == [12]
    assert busy_gloo_workers({7: stat(7, "pt_gloo_runloop) R", "S")}) == []


class Fake:
    """Thread stats read in turn (the last one repeats), a clock moved by the sleeps."""

    def __init__(self, *reads: dict[int, str]) -> None:
        self.reads = list(reads)
        self.now = 0.0
        self.sleeps = 0

    def read(self) -> dict[int, str]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds

    def wait(self, timeout: float = 1.0) -> bool:
        return wait_gloo_idle(timeout, 0.01, self.read, self.sleep, lambda: self.now)


BUSY = {5: stat(5, "pt_gloo_runloop", "R")}
IDLE = {5: stat(5, "pt_gloo_runloop", "S")}


def test_waits_until_idle_twice_in_a_row():
    fake = Fake(BUSY, IDLE, BUSY, IDLE, IDLE)
    assert fake.wait()
    assert fake.sleeps == 4  # one idle read alone is not enough: seen again after a let-go


def test_no_gloo_threads_returns_at_once_after_two_reads():
    fake = Fake({1: stat(1, "python", "R")})
    assert fake.wait()
    assert fake.sleeps == 1


def test_gives_up_at_the_timeout():
    fake = Fake(BUSY)
    assert not fake.wait(timeout=0.05)
    assert 0.05 <= fake.now < 0.07


def test_this_process_has_no_busy_gloo_worker():
    assert wait_gloo_idle(timeout=1.0)
