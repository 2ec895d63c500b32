"""A sandbox snapshotted again and again keeps a short disk chain (issue 27, the fourth soak):
past ``max_disk_layers`` sealed layers a snapshot streams them into the running top
(vmm.qemu.disk_chain), the guest carrying on meanwhile, and the sandbox's dropped layer files
are deleted. What each snapshot held, and what the guest wrote, must all still be there: read
back through the guest with its page cache dropped (so from the streamed disk), from a cold
boot over the last snapshot's layers and from a memory restore taken after the stream. A
restored sandbox streams only the layers it made: its snapshot's stay, shared, under its top.
"""

from pathlib import Path

import pytest

from tests.vmm.test_lifecycle_vm import assert_continues, counter, real_driver, sh, start_counting
from tests.vmm.test_qemu_vm import endpoint
from vmm.driver import BootSpec, SnapshotManifest

pytestmark = pytest.mark.vm

BOUND = 3  # sealed layers above the base before a snapshot streams them (the product's is 16)
SNAPSHOTS = 2 * BOUND + 3


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with real_driver(tmp_path_factory.mktemp("chain") / "home") as d:
        d.max_disk_layers = BOUND
        yield d


def qemu_layer_files(driver, sandbox_id: str) -> set[str]:
    """The qcow2 files the sandbox's QEMU holds open."""
    pid = driver.info(sandbox_id).pid
    fds = Path(f"/proc/{pid}/fd")
    held = set()
    for fd in fds.iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target.endswith(".qcow2"):
            held.add(target)
    return held


def files_read_from_disk(vm, count: int) -> list[str]:
    """f0..f<count-1> as the guest reads them once its page cache is dropped."""
    sh(vm, "sync; echo 3 > /proc/sys/vm/drop_caches", user="root")
    return sh(vm, " ; ".join(f"cat /home/user/f{i}.txt" for i in range(count))).split()


def test_repeated_snapshots_keep_the_chain_short_and_every_write(driver, tmp_path):
    info = driver.boot(BootSpec("dc-1", cpu_count=1, memory_mb=256))
    kids = []
    try:
        ep = endpoint(info)
        start_counting(ep)
        before = counter(ep)
        depths, streamed = [], []
        for i in range(SNAPSHOTS):
            sh(ep, f"echo v{i} > /home/user/f{i}.txt; echo v{i} > /home/user/latest.txt")
            manifest = driver.snapshot("dc-1", tmp_path / f"snap{i}", memory=False)
            # the snapshot holds the chain it was taken on: the one before, plus the top it sealed
            assert len(manifest.layers) - 1 == (depths[-1] if depths else 0) + 1, manifest.layers
            state = driver._load("dc-1")
            depths.append(len(state.chain) - 1)
            if depths[-1] == 0:
                streamed.append(i)
            own = {str(p) for p in Path(state.state_dir).glob("top*.qcow2")}
            assert own == {state.top, *(c for c in state.chain if Path(c).parent == Path(state.state_dir))}, \
                "a streamed layer's file was left behind"
            assert qemu_layer_files(driver, "dc-1") <= {state.top, *state.chain}, "QEMU still holds dropped layers"
        print(f"\nchain depth after each snapshot: {depths}; streamed at {streamed}")
        assert max(depths) <= BOUND, depths
        assert len(streamed) >= 2, f"the chain was never streamed twice: {depths}"
        before = assert_continues(ep, before)  # the guest ran on through every stream

        assert files_read_from_disk(ep, SNAPSHOTS) == [f"v{i}" for i in range(SNAPSHOTS)]

        # a cold boot over the last snapshot's layers: its disk alone holds every file
        cold = driver.boot(BootSpec("dc-cold", cpu_count=1, memory_mb=256,
                                    layers=manifest_layers(tmp_path / f"snap{SNAPSHOTS - 1}")))
        kids.append(cold)
        assert files_read_from_disk(cold, SNAPSHOTS) == [f"v{i}" for i in range(SNAPSHOTS)]
        # one taken before the first stream: what it held then, nothing after
        early = streamed[0] - 1
        first = driver.boot(BootSpec("dc-early", cpu_count=1, memory_mb=256,
                                     layers=manifest_layers(tmp_path / f"snap{early}")))
        kids.append(first)
        assert files_read_from_disk(first, early + 1) == [f"v{i}" for i in range(early + 1)]
        assert sh(first, "cat /home/user/latest.txt").strip() == f"v{early}"

        # a memory snapshot after the streams restores the running guest with its disk
        memory = driver.snapshot("dc-1", tmp_path / "with-memory")
        restored = driver.restore(memory, BootSpec("dc-restored"))
        kids.append(restored)
        assert_continues(restored, before)
        assert files_read_from_disk(restored, SNAPSHOTS) == [f"v{i}" for i in range(SNAPSHOTS)]

        # a restored sandbox streams only its own layers: the snapshot's stay under its top
        inherited = driver._load("dc-restored").chain
        for i in range(BOUND + 1):
            sh(restored, f"echo r{i} > /home/user/r{i}.txt")
            driver.snapshot("dc-restored", tmp_path / f"restored-snap{i}", memory=False)
        assert driver._load("dc-restored").chain == inherited
        assert all(Path(layer).exists() for layer in inherited)
        sh(restored, "sync; echo 3 > /proc/sys/vm/drop_caches", user="root")
        assert sh(restored, " ; ".join(f"cat /home/user/r{i}.txt" for i in range(BOUND + 1))).split() == \
            [f"r{i}" for i in range(BOUND + 1)]
        assert files_read_from_disk(restored, SNAPSHOTS) == [f"v{i}" for i in range(SNAPSHOTS)]
    finally:
        for kid in kids:
            driver.kill(kid.sandbox_id)
        driver.kill("dc-1")


def manifest_layers(snapshot_dir: Path) -> list[str]:
    return list(SnapshotManifest.load(snapshot_dir).layers)
