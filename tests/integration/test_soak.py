"""A short soak (issue 27.1; bench/soak.py is the long one, docs/benchmarks.md#soak its results)
on the session's stack with real VMs and the official SDK: one sandbox's pause → connect cycles
while others run pause → connect, snapshot → restore, fork ×2, network updates, file writes and
reads with a counter that must never restart or go back. Nothing may be lost or answered with
an error, and from the warm-up to the end the node worker, the API and the data plane must not
grow by more than 10 % nor the stack keep a sandbox, snapshot or fork capture."""
import os

import pytest

from cluster.processes import qemu_pids
from harness.polling import until

from bench.soak import leaders_of, summarize, verdict
from bench.soak_run import Config, Soak

pytestmark = [pytest.mark.vm, pytest.mark.slow]

CYCLES = int(os.environ.get("AENV_TEST_SOAK_CYCLES", "30"))
SANDBOXES = int(os.environ.get("AENV_TEST_SOAK_SANDBOXES", "2"))


def test_soak_loses_nothing_answers_no_error_and_leaks_nothing(stack, sdk_env):
    cfg = Config(cycles=CYCLES, sandboxes=SANDBOXES, warmup=CYCLES // 3, window=max(CYCLES // 3, 1), max_errors=5)
    soak = Soak(cfg, leaders_of(stack), stack.home)
    res = soak.run()
    summary = summarize(cfg, res)
    print(f"\nSOAK {res.cycles_done} cycles, worker ops {res.worker_ops}, leaks {summary['leaks']}")
    assert res.state_lost == [], res.state_lost
    assert res.errors == [], [e["error"] for e in res.errors]
    assert set(summary["leaks"]) >= {"node", "api", "dataplane", "stack"}
    assert verdict(summary) == []
    assert sum(res.worker_ops.values()) >= SANDBOXES, "the workers ran no operation"
    assert len(soak.made) > SANDBOXES + 1, "no snapshot restore or fork ran"
    # every sandbox the soak made (forks and restores included) is gone: Soak.run kills them
    until(lambda: not [sid for sid in soak.made if qemu_pids(str(stack.home), sid)],
          "the soak's VMs to end", deadline=120)
