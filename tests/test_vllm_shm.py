"""vLLM's own shared-memory segments (``/dev/shm/psm_*``) of engines that were killed are swept; a live
engine's are never touched (bridge/vllm_shm.py).

Real processes, real /dev/shm: Python ``SharedMemory`` holders (what every ``psm_*`` segment is) SIGKILLed
together with their resource tracker, as an engine's whole process group is; then two real ``vllm serve``
engines, one SIGKILLed: ``weight-bridge sweep-shm`` removes its segments, keeps the live engine's (which then
still generates) and removes nothing any live process used."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bridge.config import config_from_dict
from bridge.shm import SHM_DIR
from bridge.vllm_shm import Segment, Users, scan_users, sweep_vllm_segments, verdict
from tests.fakes import FakeEngine
from tests.helpers import ROOT, child_env, wait_until

HOLDER = """
import sys
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(create=True, size=4096 * 4)
shm.buf[:5] = b"hello"
print(shm.name, flush=True)
sys.stdin.read()
shm.close()
shm.unlink()
"""
# a CPU worker's collectives segment at TP >= 2, made as vLLM's C++ shm manager makes it: mapped, its descriptor closed
CPUSHM_HOLDER = """
import ctypes, mmap, os, sys, uuid
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
name = f"vllm_dist_{uuid.uuid4().hex}-tp:0-[0-1]-cpushm_0"
fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096 * 4)
addr = libc.mmap(None, 4096 * 4, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
os.close(fd)  # mapped, no descriptor left (Python's mmap module would keep a duplicate open)
ctypes.memmove(addr, b"hello", 5)
print(name, flush=True)
sys.stdin.read()
os.unlink(f"/dev/shm/{name}")
"""
NAMES = {"psm": r"psm_[0-9a-f]{8}", "cpushm": r"vllm_dist_[0-9a-f]{32}-tp:0-\[0-1\]-cpushm_0"}


def _seg(**fields: Any) -> Segment:
    return Segment(**{"name": "psm_0123abcd", "inode": 7, "uid": 1000, "size": 10, "resident": 4096, "changed": 0.0,
                      **fields})


@pytest.mark.parametrize(("segment", "users", "now", "want"), [
    (_seg(), Users(frozenset({7}), frozenset(), frozenset()), 1000.0, "in_use"),  # mapped
    (_seg(), Users(frozenset(), frozenset({"psm_0123abcd"}), frozenset()), 1000.0, "in_use"),  # held open
    (_seg(), Users(frozenset({8}), frozenset({"psm_ffffffff"}), frozenset()), 1000.0, "remove"),
    (_seg(), Users(frozenset(), frozenset(), frozenset()), 30.0, "young"),  # written 30 s ago, min 60
    (_seg(), Users(frozenset(), frozenset(), frozenset({1000})), 1000.0, "cannot tell"),  # its owner's process hidden
    (_seg(), Users(frozenset(), frozenset(), frozenset({0})), 1000.0, "remove"),  # another uid's process hidden
    (_seg(), Users(frozenset({7}), frozenset(), frozenset({1000})), 1000.0, "in_use"),
    (_seg(name=f"vllm_dist_{'a' * 32}-tp:0-[0-1]-cpushm_1", inode=9), Users(frozenset({9}), frozenset(), frozenset()),
     1000.0, "in_use"),  # a CPU worker's collectives segment (TP >= 2), mapped
])
def test_verdict(segment: Segment, users: Users, now: float, want: str) -> None:
    assert verdict(segment, users, now, 60.0).startswith(want)


def _holder(kind: str = "psm") -> tuple[subprocess.Popen[str], str]:
    script = HOLDER if kind == "psm" else CPUSHM_HOLDER
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    name = proc.stdout.readline().strip()  # type: ignore[union-attr]
    assert re.fullmatch(NAMES[kind], name), name
    return proc, name


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process and everything in its process group (its resource tracker, an engine's workers)."""
    members = [p for p in psutil.process_iter() if _pgid(p.pid) == proc.pid]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    psutil.wait_procs(members, timeout=30)


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def _age(name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(SHM_DIR / name, (then, then))


@pytest.fixture
def holders() -> Iterator[Any]:
    """make(alive, kind="psm") -> a segment's name (a SharedMemory's, or a CPU worker's collectives segment):
    its holder stays alive, or is SIGKILLed with its whole process group (nothing unlinks the segment then).
    Everything is ended and removed afterwards."""
    made: list[tuple[subprocess.Popen[str], str]] = []

    def make(alive: bool, kind: str = "psm") -> str:
        proc, name = _holder(kind)
        made.append((proc, name))
        if not alive:
            _kill_group(proc)
            assert (SHM_DIR / name).exists()  # SIGKILL unlinks nothing, and the tracker died too
        return name

    yield make
    for proc, name in made:
        if proc.poll() is None:
            proc.communicate("", timeout=30)  # the holder unlinks its segment
        (SHM_DIR / name).unlink(missing_ok=True)


@pytest.mark.parametrize("kind", ["psm", "cpushm"])
def test_sweep_removes_dead_holders_segments_and_keeps_live_and_young_ones(holders: Any, kind: str) -> None:
    dead, young, live = holders(alive=False, kind=kind), holders(alive=False, kind=kind), holders(alive=True, kind=kind)
    for name in (dead, live):
        _age(name, 120)  # not written for two minutes: only its users keep it now
    users = scan_users()
    assert (SHM_DIR / live).stat().st_ino in users.mapped and (live in users.open) == (kind == "psm")  # cpushm: mapped only
    report = sweep_vllm_segments()
    assert dead in report.removed and report.bytes >= 4 * 4096
    assert young in report.young and live in report.in_use
    assert not (SHM_DIR / dead).exists() and (SHM_DIR / young).exists() and (SHM_DIR / live).exists()
    assert set(report.removed).isdisjoint(users.open) and not {n for n, _ in report.not_cleaned} & {dead, young, live}


def test_a_starting_receiver_sweeps_them_unless_told_not_to(holders: Any, start_receiver: Any) -> None:
    kept, live = holders(alive=False), holders(alive=True)
    _age(kept, 120)
    _age(live, 120)
    start_receiver(config_from_dict({"serve": {"sweep_vllm_shm": False}}), FakeEngine())
    assert (SHM_DIR / kept).exists()
    start_receiver(config_from_dict({}), FakeEngine())
    assert not (SHM_DIR / kept).exists() and (SHM_DIR / live).exists()


# ---- real engines -----------------------------------------------------------------------------------------
PORTS = (18580, 18581)


def _engine_segments(proc: subprocess.Popen[str]) -> set[str]:
    """The psm_* segments the engine's processes (server, engine core, workers) map."""
    names = set()
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            names |= {m.path.rsplit("/", 1)[1] for m in p.memory_maps(grouped=True) if "/dev/shm/psm_" in m.path}
        except psutil.Error:
            continue
    return names


@pytest.mark.engine
def test_a_sigkilled_engines_segments_are_swept_and_a_live_engines_kept(tmp_path: Path) -> None:
    import requests

    from devtools.serve import serve_command
    from devtools.tiny_models import build_model, save_checkpoint, save_word_tokenizer

    model = build_model("tiny", seed=1)
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    save_word_tokenizer(ckpt, model.config.vocab_size)
    env = {**child_env(), "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    engines = []
    for port in PORTS:
        with open(tmp_path / f"engine-{port}.log", "w") as log:
            engines.append(subprocess.Popen(serve_command(ckpt, port), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, text=True))
    live, dead = engines
    live_segs: set[str] = set()
    try:
        for proc, port in zip(engines, PORTS, strict=True):
            def up(port: int = port, proc: subprocess.Popen[str] = proc) -> bool:
                assert proc.poll() is None, (tmp_path / f"engine-{port}.log").read_text()[-3000:]
                try:
                    return requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                except requests.RequestException:
                    return False
            wait_until(up, timeout=600, what=f"vllm serve on port {port}")
        live_segs, dead_segs = _engine_segments(live), _engine_segments(dead)
        assert live_segs and dead_segs and not live_segs & dead_segs, (live_segs, dead_segs)

        _kill_group(dead)
        assert all((SHM_DIR / n).exists() for n in dead_segs)  # what a killed engine leaves behind
        oldest = max(os.stat(SHM_DIR / n).st_mtime for n in dead_segs)
        time.sleep(max(0.0, oldest + 10 - time.time()))
        in_use = scan_users()  # every live process's segments, other engines on this host included
        proc = subprocess.run([sys.executable, "-m", "apps.cli", "sweep-shm", "--min-age", "10"], cwd=ROOT,
                              env=child_env(), capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        removed = set(re.search(r"vLLM segments no live process uses .*?(?:: (.*))?$", proc.stdout, re.M)
                      .group(1).split())  # type: ignore[union-attr]
        assert dead_segs <= removed, proc.stdout
        assert not any((SHM_DIR / n).exists() for n in dead_segs)
        assert all((SHM_DIR / n).exists() for n in live_segs)
        assert not removed & in_use.open, "a segment some live process held open was removed"

        r = requests.post(f"http://127.0.0.1:{PORTS[0]}/v1/completions", timeout=300, json={
            "model": str(ckpt), "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "return_token_ids": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text  # the live engine serves on
    finally:
        exited = True
        for proc in engines:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    exited = False
                    _kill_group(proc)
    # an engine that exits unlinks its own: its engine-core process may still be on its way out when the API
    # server's process has exited, so within a deadline (a killed engine leaves them: the sweep's case)
    if exited:
        wait_until(lambda: not any((SHM_DIR / n).exists() for n in live_segs), timeout=60,
                   what=lambda: f"the exited engine's segments unlinked: {sorted(n for n in live_segs if (SHM_DIR / n).exists())}")
