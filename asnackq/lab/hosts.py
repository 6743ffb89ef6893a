"""Hosts for the lab: network namespaces on one bridge, made for a run and removed after it.

Rules of this module:

* Linux and root only: ``require()`` raises ``HostsUnavailable`` (one line) otherwise.
* Every name carries the lab's pid and a sequence number: namespaces ``asnackq-PID-SEQ-hI``,
  links ``aqPIDxSEQb`` (the bridge) and ``aqPIDxSEQhI`` (host I's end on it).  A leftover
  whose pid no longer runs (a SIGKILLed lab) is removed by ``sweep`` at the next start.
* One bridge in the root namespace holds two addresses of a private /24 that nothing on
  this machine uses: ``.1`` for the database, ``.2`` for the sinks, so that a partition can
  cut either alone.  Host ``I`` is a veth pair: one end on the bridge, the other in its
  namespace with ``.(10+I)``.  A host has no other route: nothing outside the machine.
* A partition is a route in the host's namespace that sends what goes to ``.1``, ``.2`` or
  both through ``.250``, a neighbour with a MAC address no interface has: the packets leave
  and vanish, as on a cut link (a ``blackhole`` route would fail each send at once
  instead).  Replies cannot be answered either, so both ends see silence: connections
  stall, new ones time out, and both go on once the heal deletes the route.
* ``close()`` removes every namespace (its veth with it) and the bridge; it is idempotent,
  and ``with Hosts(...)`` runs it whatever happened.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

__all__ = ["MAX_HOSTS", "TARGETS", "Hosts", "HostsUnavailable", "require", "sweep"]

TARGETS = ("db", "sinks", "both")  # what a partition cuts a host off from
NETNS = re.compile(r"^asnackq-(\d+)-\d+-h\d+$")
LINK = re.compile(r"^aq(\d+)x\d+(b|h\d+)$")
MAX_HOSTS = 16
NOWHERE, NOWHERE_MAC = 250, "02:00:00:00:00:fa"  # a partition's next hop: nobody
_sequence = itertools.count()


class HostsUnavailable(OSError):
    """Raised when this machine cannot make hosts (not Linux, not root, no ``ip``) or an
    ``ip`` command that makes or changes them fails."""


def require() -> None:
    """``HostsUnavailable`` unless namespaces can be made here (Linux, root, ``ip``)."""
    if not sys.platform.startswith("linux"):
        raise HostsUnavailable("--hosts needs Linux (network namespaces)")
    if os.geteuid() != 0:
        raise HostsUnavailable("--hosts needs root (it makes network namespaces)")
    if shutil.which("ip") is None:
        raise HostsUnavailable("--hosts needs the 'ip' command (iproute2)")


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; a failure is one ``HostsUnavailable`` line (unless ``check`` is False)."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        why = done.stderr.strip() or f"exit {done.returncode}"
        raise HostsUnavailable(f"ip {' '.join(args)}: {why}")
    return done.stdout


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Remove the namespaces and links of labs that no longer run; return their names."""
    removed = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        found = NETNS.match(name)
        if found and not running(int(found[1])):
            ip("netns", "delete", name, check=False)
            removed.append(name)
    for link in json.loads(ip("-j", "link", "show") or "[]"):
        name = link.get("ifname", "")
        found = LINK.match(name)
        if found and not running(int(found[1])):
            ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine routes or holds an address in."""
    networks = []
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        if route.get("dst") not in (None, "default"):
            networks.append(ipaddress.ip_network(route["dst"], strict=False))
    for link in json.loads(ip("-j", "-4", "addr") or "[]"):
        for info in link.get("addr_info", []):
            networks.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", False))
    return [n for n in networks if isinstance(n, ipaddress.IPv4Network)]


def free_subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8, derived from ``pid``, that overlaps nothing on this machine."""
    taken = in_use()
    for step in range(1 << 16):
        index = (pid + step * 7919) % (1 << 16)
        subnet = ipaddress.IPv4Network(f"10.{index >> 8}.{index & 255}.0/24")
        if not any(subnet.overlaps(net) for net in taken):
            return subnet
    raise HostsUnavailable("no free private /24 for the lab's hosts")


@dataclass
class Hosts:
    """``count`` namespaces on one bridge; ``db_addr`` and ``sink_addr`` are the root
    namespace's addresses on it, ``argv(i)`` runs a command on host ``i``."""

    count: int
    pid: int = field(default_factory=os.getpid)
    seq: int = field(default_factory=lambda: next(_sequence) % 100)
    subnet: ipaddress.IPv4Network | None = None
    made: list[tuple[str, str]] = field(default_factory=list)  # ("netns" or "link", name)
    cut: dict[int, str] = field(default_factory=dict)  # host -> what it is cut off from

    @property
    def tag(self) -> str:
        return f"aq{self.pid}x{self.seq}"

    def namespace(self, i: int) -> str:
        return f"asnackq-{self.pid}-{self.seq}-h{i}"

    def address(self, offset: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + offset)

    @property
    def db_addr(self) -> str:
        return self.address(1)

    @property
    def sink_addr(self) -> str:
        return self.address(2)

    def argv(self, i: int) -> list[str]:
        """The prefix that runs a command on host ``i``."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def __enter__(self) -> Hosts:
        require()
        if not 1 <= self.count <= MAX_HOSTS:
            raise ValueError(f"hosts must be in [1, {MAX_HOSTS}]: {self.count}")
        sweep()
        try:
            self.subnet = free_subnet(self.pid * 100 + self.seq)
            self._bridge()
            for i in range(self.count):
                self._host(i)
        except BaseException:
            self.close()
            raise
        return self

    def _bridge(self) -> None:
        bridge = f"{self.tag}b"
        ip("link", "add", bridge, "type", "bridge")
        self.made.append(("link", bridge))
        for offset in (1, 2):
            ip("addr", "add", f"{self.address(offset)}/24", "dev", bridge)
        ip("link", "set", bridge, "up")

    def _host(self, i: int) -> None:
        name, outer = self.namespace(i), f"{self.tag}h{i}"
        ip("netns", "add", name)
        self.made.append(("netns", name))
        ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", name)
        self.made.append(("link", outer))
        ip("link", "set", outer, "master", f"{self.tag}b", "up")
        ip("-n", name, "addr", "add", f"{self.address(10 + i)}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        nowhere = ("neigh", "add", self.address(NOWHERE), "lladdr", NOWHERE_MAC, "dev", "eth0")
        ip("-n", name, *nowhere, "nud", "permanent")

    def destinations(self, target: str) -> list[str]:
        return {"db": [self.db_addr], "sinks": [self.sink_addr]}.get(
            target, [self.db_addr, self.sink_addr]
        )

    def partition(self, i: int, target: str) -> None:
        """Cut host ``i`` off from ``target`` (one of ``TARGETS``) until ``heal(i)``."""
        if target not in TARGETS:
            raise ValueError(f"a partition cuts one of {TARGETS}: {target!r}")
        for addr in self.destinations(target):
            via = ("via", self.address(NOWHERE), "dev", "eth0")
            ip("-n", self.namespace(i), "route", "add", f"{addr}/32", *via)
        self.cut[i] = target

    def heal(self, i: int) -> None:
        """Give host ``i`` its links back (nothing if it is not cut off)."""
        target = self.cut.pop(i, None)
        if target is not None:
            for addr in self.destinations(target):
                ip("-n", self.namespace(i), "route", "del", f"{addr}/32")

    def close(self) -> None:
        """Remove every link and namespace made, the last first (idempotent; one already
        gone is no error).  A veth's deletion takes its peer in the namespace with it."""
        self.cut.clear()
        while self.made:
            kind, name = self.made.pop()
            ip(kind, "delete", name, check=False)

    def __exit__(self, *exc: object) -> None:
        self.close()
