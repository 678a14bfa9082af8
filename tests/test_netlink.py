"""devtools/netlink.py: the command lists (pure), and a real namespace joined by a shaped veth pair whose measured
throughput stays below the rate it was shaped to and which is gone afterwards (needs root, ``ip`` and ``tc``;
about 2 s)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest

from bridge.errors import ConfigError
from devtools.netlink import (
    Link,
    exec_in,
    reshape_commands,
    setup_commands,
    shaped_link,
    tbf_command,
    teardown_commands,
)


def test_addresses_and_interface_names() -> None:
    link = Link("wbbench-a", index=7, rate="1gbit")
    assert (link.host_addr, link.ns_addr) == ("10.200.7.1", "10.200.7.2")
    assert (link.host_if, link.ns_if) == ("wbh7", "wbn7")
    assert len(Link("wbbench-b", index=255).host_if) <= 15


@pytest.mark.parametrize("kwargs, problem", [
    ({"name": "demo", "index": 1}, "must start with 'wbbench-'"),
    ({"name": "wbbench-A B", "index": 1}, "a-z, 0-9"),
    ({"name": "wbbench-a", "index": 256}, "0..255"),
    ({"name": "wbbench-a", "index": -1}, "0..255"),
    ({"name": "wbbench-a", "index": 1, "rate": "fast"}, "not a tc rate"),
    ({"name": "wbbench-a", "index": 1, "rate": "1gbit", "burst": "big"}, "not a tc size"),
    ({"name": "wbbench-a", "index": 1, "rate": "1gbit", "latency": "50"}, "not a tc time"),
])
def test_bad_links_are_refused(kwargs: dict[str, object], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        Link(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("rate", ["1gbit", "10gbit", "100mbit"])
@pytest.mark.parametrize("inside", [False, True])
def test_tbf_command(rate: str, inside: bool) -> None:
    link = Link("wbbench-a", index=3, rate=rate)
    cmd = tbf_command(link, "wbx", inside=inside)
    tail = ["tc", "qdisc", "add", "dev", "wbx", "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    assert cmd == (["ip", "netns", "exec", "wbbench-a", *tail] if inside else tail)


def test_unshaped_link_has_no_tbf() -> None:
    link = Link("wbbench-a", index=3)
    assert not any("tc" in cmd for cmd in setup_commands(link))
    with pytest.raises(ConfigError, match="unshaped"):
        tbf_command(link, "wbh3", inside=False)


@pytest.mark.parametrize("rate", [None, "1gbit"])
def test_setup_builds_namespace_pair_addresses_and_shapes_both_ends(rate: str | None) -> None:
    link = Link("wbbench-a", index=9, rate=rate)
    cmds = setup_commands(link)
    assert cmds[0] == ["ip", "netns", "add", "wbbench-a"]
    assert ["ip", "link", "add", "wbh9", "type", "veth", "peer", "name", "wbn9"] in cmds
    assert ["ip", "link", "set", "wbn9", "netns", "wbbench-a"] in cmds
    assert ["ip", "addr", "add", "10.200.9.1/24", "dev", "wbh9"] in cmds
    assert exec_in(link, ["ip", "addr", "add", "10.200.9.2/24", "dev", "wbn9"]) in cmds
    assert exec_in(link, ["ip", "link", "set", "lo", "up"]) in cmds
    shaped = [cmd for cmd in cmds if "tbf" in cmd]
    assert shaped == ([] if rate is None else [tbf_command(link, "wbh9", inside=False), tbf_command(link, "wbn9", inside=True)])
    # the namespace exists before anything is run in it or moved into it
    assert all(cmds.index(cmd) > 0 for cmd in cmds if "wbbench-a" in cmd and cmd != cmds[0])


def test_reshape_and_teardown() -> None:
    link = Link("wbbench-a", index=4, rate="10gbit")
    assert [cmd[:3] for cmd in reshape_commands(link)] == [["tc", "qdisc", "replace"], ["ip", "netns", "exec"]]
    assert all("10gbit" in cmd for cmd in reshape_commands(link))
    assert teardown_commands(link) == [["ip", "netns", "del", "wbbench-a"], ["ip", "link", "del", "wbh4"]]


SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
got, first = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    got += len(b)
    if first is None and got >= (1 << 20):
        first = (got, time.perf_counter())
end = time.perf_counter()
print(got, (got - first[0]) / (end - first[1]), flush=True)
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                                reason="needs root, ip and tc")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout


@needs_root
def test_shaped_link_throughput_is_below_its_rate_and_the_link_is_removed() -> None:
    """6 MB through a 40 Mbit/s link: the rate after the first MiB (past tbf's 256 kB burst) is at most 40 Mbit/s
    and at least half of it; afterwards neither the namespace nor the root end of the veth pair exists."""
    import socket

    link = Link("wbbench-test", index=250, rate="40mbit")
    port = 42901
    with shaped_link(link):
        sink = subprocess.Popen(exec_in(link, [sys.executable, "-c", SINK, link.ns_addr, str(port)]),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
            with socket.create_connection((link.ns_addr, port), timeout=30) as conn:
                conn.sendall(b"\0" * (6 << 20))
            got, rate = sink.communicate(timeout=60)[0].split()
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait(10)
        assert int(got) == 6 << 20
        bits = float(rate) * 8
        assert 20e6 <= bits <= 40e6, f"{bits / 1e6:.1f} Mbit/s through a 40 Mbit/s link"
    assert "wbbench-test" not in _namespaces()
    assert subprocess.run(["ip", "link", "show", link.host_if], capture_output=True, timeout=30).returncode != 0


@needs_root
def test_link_is_removed_when_the_block_raises() -> None:
    link = dataclasses.replace(Link("wbbench-test", index=250), rate="1gbit")
    with pytest.raises(RuntimeError, match="boom"), shaped_link(link):
        assert "wbbench-test" in _namespaces()
        raise RuntimeError("boom")
    assert "wbbench-test" not in _namespaces()
    assert subprocess.run(["ip", "link", "show", link.host_if], capture_output=True, timeout=30).returncode != 0
