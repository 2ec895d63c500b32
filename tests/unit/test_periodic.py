"""agent.periodic: the loop every background duty of a node runs in."""
import threading
import time

from agent.periodic import Periodic


class Counting(Periodic):
    def __init__(self, interval, at_once, fail_first=0):
        super().__init__("counting", interval, at_once=at_once)
        self.times, self.fail_first, self.enough = [], fail_first, threading.Event()

    def round(self):
        self.times.append(time.monotonic())
        if len(self.times) >= 3:
            self.enough.set()
        if len(self.times) <= self.fail_first:
            raise RuntimeError("a bad round")


def test_failing_rounds_do_not_end_the_loop_and_stop_ends_it():
    job = Counting(0.05, at_once=False, fail_first=2)
    started = time.monotonic()
    job.start()
    assert job.enough.wait(5), job.times
    job.stop()
    job.join(2)
    assert not job.is_alive()
    assert job.times[0] - started >= 0.05  # the first round waits one interval
    count = len(job.times)
    time.sleep(0.15)
    assert len(job.times) == count  # nothing after stop


def test_at_once_runs_the_first_round_without_waiting():
    job = Counting(10, at_once=True)
    started = time.monotonic()
    job.start()
    deadline = time.monotonic() + 2
    while not job.times and time.monotonic() < deadline:
        time.sleep(0.01)
    job.stop()
    job.join(2)
    assert job.times and job.times[0] - started < 1
