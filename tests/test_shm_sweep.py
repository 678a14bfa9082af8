"""Shared-memory segments left in /dev/shm by a SIGKILLed process are swept by the next publisher or
receiver on the host: /dev/shm is memory, and a crashed trainer in staged mode leaves a whole update there.

Real processes, real /dev/shm: a process is SIGKILLed holding segments (and a verdict file); the sweep
removes exactly its files and leaves a live process's, this process's, another pid namespace's and names
this code does not make. Then the same with a real trainer process SIGKILLed after an shm publish to a
receiver process: a new ``WeightPublisher`` on the host removes what it left and publishes on.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.shm import SHM_DIR, Segment, pid_namespace, sweep_orphans
from tests import recording_receiver as recording
from tests.helpers import ROOT, weights

SMALL = {"transport": {"bucket_mb": 1, "depth": 2}}

MAKER = """
import sys
from pathlib import Path
from bridge.shm import Segment, verdict_path
segs = [Segment.create("recv", 4096 * (i + 1)) for i in range({count})]
verdict_path(segs[0].name).write_bytes(b"ok")
print(" ".join(s.name for s in segs), flush=True)
sys.stdin.read()
for s in segs:
    s.close()  # the maker unlinks its segments and their verdicts
"""


def _maker(count: int) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", MAKER.format(count=count)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()  # type: ignore[union-attr]
    assert len(names) == count, names
    return proc, names


def _files(names: list[str]) -> list[str]:
    """The segments among ``names`` still in /dev/shm, with the verdict files next to them."""
    return sorted(p.name for n in names for p in (SHM_DIR / n, SHM_DIR / (n + ".ok")) if p.exists())


@pytest.fixture
def strays() -> Iterator[list[Path]]:
    """Files the test writes into /dev/shm by hand; removed afterwards whatever happens."""
    made: list[Path] = []
    yield made
    for path in made:
        path.unlink(missing_ok=True)


def test_sweep_removes_exactly_the_segments_of_dead_makers(strays: list[Path]) -> None:
    if pid_namespace() == 0:
        pytest.skip("this kernel does not expose /proc/self/ns/pid: the sweep leaves everything")
    sweep_orphans()  # whatever dead processes (earlier runs) left: the sweep below then sees only this test's
    dead, dead_names = _maker(2)
    live, live_names = _maker(1)
    mine = Segment.create("recv", 4096)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        left = _files(dead_names)
        assert left == sorted([*dead_names, dead_names[0] + ".ok"])  # SIGKILL unlinks nothing
        # a dead pid of another pid namespace (a container sharing /dev/shm) and a name we do not make
        foreign = SHM_DIR / f"wb-recv-{pid_namespace() + 1}-{dead.pid}-{secrets.token_hex(6)}"
        unknown = SHM_DIR / f"wb-recv-{dead.pid}-{secrets.token_hex(6)}"
        for path in (foreign, unknown):
            path.write_bytes(b"x")
            strays.append(path)

        report = sweep_orphans()

        assert report.removed == tuple(left), report
        assert report.bytes == 4096 + 2 * 4096 + 2  # both segments and the 2-byte verdict
        assert _files(dead_names) == []
        assert _files(live_names) == [live_names[0], live_names[0] + ".ok"] and (SHM_DIR / mine.name).exists()
        assert foreign.exists() and unknown.exists()
        assert sweep_orphans().removed == ()  # nothing left to sweep
    finally:
        mine.close()
        live.communicate(timeout=30)
    assert _files(live_names) == []  # the live maker unlinked its own when it ended


TRAINER = """
import json, sys
from bridge.config import config_from_dict
from tests.helpers import weights
from trainer_side import WeightPublisher
pub = WeightPublisher([sys.argv[1]], config=config_from_dict(json.loads(sys.argv[2])), transport="shm")
assert pub.publish(weights(1, count=4, shape=(512, 700)), version=1).ok
print("PUBLISHED", flush=True)
sys.stdin.read()
"""


def test_a_new_publisher_sweeps_what_a_sigkilled_trainer_left() -> None:
    from bridge.config import config_from_dict
    from trainer_side import WeightPublisher

    receivers, (endpoint,) = recording.start(SMALL)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, endpoint, json.dumps(SMALL)], cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "PUBLISHED"  # type: ignore[union-attr]
        pattern = f"wb-bucket-{pid_namespace()}-{trainer.pid}-*"
        kept = sorted(p.name for p in SHM_DIR.glob(pattern))
        assert len(kept) >= 3, kept  # staged: the publisher keeps the whole update for the next one
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        assert sorted(p.name for p in SHM_DIR.glob(pattern)) == kept  # leaked

        named = weights(2, count=4, shape=(512, 700))
        with WeightPublisher([endpoint], config=config_from_dict(SMALL), transport="shm") as pub:  # the restarted trainer
            assert sorted(p.name for p in SHM_DIR.glob(pattern)) == []
            report = pub.publish(named, version=2)
        assert report.ok, report
        assert report.engines[0].engine["crc32"].keys() == {name for name, _ in named}
    finally:
        if trainer.poll() is None:
            trainer.kill()
        recording.stop(receivers)
