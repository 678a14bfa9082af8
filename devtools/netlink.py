"""A rate-limited link between hosts, built on one machine: a network namespace joined to the root namespace by a
veth pair, each end shaped with ``tc ... tbf`` (needs root: ``ip netns``, ``ip link``, ``tc``).

The process that plays the other host runs inside the namespace (``exec_in``); it reaches the root namespace at
``host_addr`` and is reached at ``ns_addr`` (10.200.``index``.1 and .2). Both directions are shaped the same way,
as a real link is. ``shaped_link`` builds it and always removes it (an exception, Ctrl-C, SIGTERM); a
namespace of the same name left by a crashed run is removed first. Namespace names start with
``wbbench-`` so nothing else on the machine is touched.

    with shaped_link(Link("wbbench-demo", index=7, rate="1gbit")) as link:
        subprocess.run(exec_in(link, ["python", "-m", "some.receiver", "--bind", link.ns_addr]))

The functions building the command lists are pure (tests/test_netlink.py).
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bridge.errors import ConfigError

PREFIX = "wbbench-"
IFNAMSIZ = 15  # the kernel's limit on an interface name
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$")
_SIZE = re.compile(r"^\d+(b|kb|k|mb|m|gb|g)?$")
_TIME = re.compile(r"^\d+(\.\d+)?(s|ms|us)$")


@dataclass(frozen=True)
class Link:
    """A namespace ``name`` (prefix ``wbbench-``) joined by a veth pair on 10.200.``index``.0/24, both ends shaped
    to ``rate`` (tc's spelling, e.g. ``1gbit``; None: unshaped) with tbf's ``burst`` and ``latency``."""

    name: str
    index: int
    rate: str | None = None
    burst: str = "256kb"
    latency: str = "50ms"

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX) or not re.fullmatch(r"[a-z0-9-]+", self.name):
            raise ConfigError(f"namespace name {self.name!r} must start with {PREFIX!r} and use a-z, 0-9 and '-' only")
        if not 0 <= self.index <= 255:
            raise ConfigError(f"link index {self.index} must be 0..255 (the third octet of 10.200.x.0/24)")
        if self.rate is not None and not _RATE.match(self.rate):
            raise ConfigError(f"rate {self.rate!r} is not a tc rate (e.g. 1gbit, 100mbit)")
        if not _SIZE.match(self.burst):
            raise ConfigError(f"burst {self.burst!r} is not a tc size (e.g. 256kb)")
        if not _TIME.match(self.latency):
            raise ConfigError(f"latency {self.latency!r} is not a tc time (e.g. 50ms)")

    @property
    def host_if(self) -> str:
        """The veth end in the root namespace (``wbh<index>``, within the kernel's 15 characters)."""
        return f"wbh{self.index}"

    @property
    def ns_if(self) -> str:
        """The veth end inside the namespace."""
        return f"wbn{self.index}"

    @property
    def host_addr(self) -> str:
        return f"10.200.{self.index}.1"

    @property
    def ns_addr(self) -> str:
        return f"10.200.{self.index}.2"


def tbf_command(link: Link, dev: str, inside: bool, verb: str = "add") -> list[str]:
    """``tc qdisc <verb> dev <dev> root tbf rate ... burst ... latency ...``, in the namespace when ``inside``."""
    if link.rate is None:
        raise ConfigError("an unshaped link has no tbf qdisc")
    if verb not in ("add", "replace"):
        raise ConfigError(f"tc verb {verb!r}: add or replace")
    cmd = ["tc", "qdisc", verb, "dev", dev, "root", "tbf", "rate", link.rate, "burst", link.burst, "latency", link.latency]
    return in_namespace(link, cmd) if inside else cmd


def in_namespace(link: Link, argv: list[str]) -> list[str]:
    """``argv`` run inside the namespace (``ip netns exec``)."""
    return ["ip", "netns", "exec", link.name, *argv]


def setup_commands(link: Link) -> list[list[str]]:
    """The commands that build ``link``, in order: the namespace with its loopback up, the veth pair with one end
    moved in, the addresses, both ends up, a default route inside (so that a process there finds its own address
    as it would on a host) and, when shaped, tbf on both ends."""
    cmds = [
        ["ip", "netns", "add", link.name],
        in_namespace(link, ["ip", "link", "set", "lo", "up"]),
        ["ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if],
        ["ip", "link", "set", link.ns_if, "netns", link.name],
        ["ip", "addr", "add", f"{link.host_addr}/24", "dev", link.host_if],
        in_namespace(link, ["ip", "addr", "add", f"{link.ns_addr}/24", "dev", link.ns_if]),
        ["ip", "link", "set", link.host_if, "up"],
        in_namespace(link, ["ip", "link", "set", link.ns_if, "up"]),
        in_namespace(link, ["ip", "route", "add", "default", "via", link.host_addr]),
    ]
    if link.rate is not None:
        cmds += [tbf_command(link, link.host_if, inside=False), tbf_command(link, link.ns_if, inside=True)]
    return cmds


def reshape_commands(link: Link) -> list[list[str]]:
    """Change the rate of a built link (both ends) to ``link.rate`` without rebuilding it."""
    return [tbf_command(link, link.host_if, inside=False, verb="replace"),
            tbf_command(link, link.ns_if, inside=True, verb="replace")]


def teardown_commands(link: Link) -> list[list[str]]:
    """Deleting the namespace deletes the veth end inside it and so the pair; the root end is deleted on its own
    too, for a pair whose inner end never moved in."""
    return [["ip", "netns", "del", link.name], ["ip", "link", "del", link.host_if]]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ConfigError(f"`{' '.join(cmd)}` failed (rc {done.returncode}): {done.stderr.strip()}")


def _exists(link: Link) -> bool:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return any(line.split()[0] == link.name for line in listed.splitlines() if line.strip())


def remove(link: Link) -> None:
    """Remove ``link``'s namespace and veth pair, whatever of them exists (never raises for a missing part)."""
    for cmd in teardown_commands(link):
        subprocess.run(cmd, capture_output=True, timeout=30)


def reshape(link: Link) -> None:
    """Set both ends of the built link to ``link.rate`` (``dataclasses.replace(link, rate=...)``)."""
    for cmd in reshape_commands(link):
        _run(cmd)


def exec_in(link: Link, argv: list[str]) -> list[str]:
    """The command line running ``argv`` in the namespace (for ``subprocess.Popen``)."""
    return in_namespace(link, argv)


@contextmanager
def shaped_link(link: Link) -> Iterator[Link]:
    """Build ``link`` (removing a leftover of the same name first), yield it, remove it on the way out, whatever
    ends the block. In the main thread SIGTERM is turned into ``KeyboardInterrupt`` while inside, so a killed
    benchmark also removes its link (SIGKILL cannot be caught: ``remove`` or rerunning clears the leftover)."""
    previous: Any = None
    main = threading.current_thread() is threading.main_thread()
    if main:
        def interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        if _exists(link):
            remove(link)
        try:
            for cmd in setup_commands(link):
                _run(cmd)
            yield link
        finally:
            remove(link)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
