"""Which addresses a sender may connect to when remote sinks are allowed.

Rules of this module:

* ``refusal(address, allow)`` is the rule, a pure function: an address inside a network of
  ``allow`` is permitted; any other address that is not globally routable is refused, with a
  one-line reason naming its category (loopback, private, shared, link-local, unique-local,
  site-local, multicast, unspecified, reserved, documentation, benchmarking, broadcast, or
  simply not globally routable); the cloud metadata addresses are named as such.
* An IPv6 address that carries an IPv4 address (IPv4-mapped ``::ffff:a.b.c.d``,
  IPv4-compatible ``::a.b.c.d``, NAT64 ``64:ff9b::/96``, 6to4 ``2002::/16``) is judged on the
  IPv4 address inside: that is where its packets go.
* The address judged is the address connected: ``Guard`` resolves a host itself and hands
  back only the addresses it permits, and a sender connects to those, never to the name
  resolved again. A host written as an IP address is judged as written; a host that looks
  like one but is not written in full (``127.1``, ``2130706433``: the system resolver maps
  them onto 127.0.0.1) is refused.
* No address permitted is ``Refused``, a ``Permanent`` failure (nothing is sent), logged as
  one line by the ``asnackq.guard`` logger. A lookup that finds nothing is an ``OSError``:
  the sink is not there, for now.
* Standard library at import; aiohttp (and yarl) only inside the functions that use them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeAlias

from asnackq.core.worker import Permanent

if TYPE_CHECKING:
    import aiohttp.abc

__all__ = [
    "Guard",
    "Lookup",
    "Network",
    "Refused",
    "aiohttp_host",
    "aiohttp_resolver",
    "networks",
    "refusal",
    "sender_guard",
    "system_lookup",
]

LOG = logging.getLogger("asnackq.guard")

Network: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
Address: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
# A resolver: a host and a port to the host's addresses, as text (a stub in tests).
Lookup: TypeAlias = Callable[[str, int], Sequence[str]]

METADATA = "a cloud metadata address"
PRIVATE = "a private address"
DOCUMENTATION = "a documentation address"
NOT_GLOBAL = "not a globally routable address"

# The categories, the narrowest first: the first network holding an address names it.
# Anything else that ``is_global`` does not call global is ``NOT_GLOBAL``.
V4_CATEGORIES = (
    ("169.254.169.254/32", METADATA),  # AWS, GCP, Azure, OpenStack, DigitalOcean, ...
    ("100.100.100.200/32", METADATA),  # Alibaba Cloud
    ("0.0.0.0/32", "the unspecified address"),
    ("0.0.0.0/8", "a reserved address (this network)"),
    ("127.0.0.0/8", "a loopback address"),
    ("10.0.0.0/8", PRIVATE),
    ("172.16.0.0/12", PRIVATE),
    ("192.168.0.0/16", PRIVATE),
    ("100.64.0.0/10", "a shared address (carrier-grade NAT)"),
    ("169.254.0.0/16", "a link-local address"),
    ("192.0.0.0/24", "a reserved address (IETF protocol assignments)"),
    ("192.0.2.0/24", DOCUMENTATION),
    ("198.51.100.0/24", DOCUMENTATION),
    ("203.0.113.0/24", DOCUMENTATION),
    ("198.18.0.0/15", "a benchmarking address"),
    ("224.0.0.0/4", "a multicast address"),
    ("255.255.255.255/32", "the broadcast address"),
    ("240.0.0.0/4", "a reserved address"),
)
V6_CATEGORIES = (
    ("fd00:ec2::254/128", METADATA),  # AWS over IPv6
    ("::/128", "the unspecified address"),
    ("::1/128", "a loopback address"),
    ("fe80::/10", "a link-local address"),
    ("fec0::/10", "a site-local address"),
    ("fc00::/7", "a unique-local address"),
    ("ff00::/8", "a multicast address"),
    ("2001:db8::/32", DOCUMENTATION),
    ("3fff::/20", DOCUMENTATION),
    ("2001:2::/48", "a benchmarking address"),
    ("2001::/32", "a Teredo address"),  # (the IPv4 address inside is obscured)
    ("64:ff9b:1::/48", "a local-use NAT64 address"),
    ("100::/64", "a reserved address (discard-only)"),
)
CATEGORIES = {
    4: tuple((ipaddress.ip_network(net), name) for net, name in V4_CATEGORIES),
    6: tuple((ipaddress.ip_network(net), name) for net, name in V6_CATEGORIES),
}
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
COMPATIBLE = ipaddress.IPv6Network("::/96")


class Refused(Permanent):
    """Raised by a sender, before it connects, when its sink's host has no address it may
    connect to: every address the host resolves to, or the address it is written as, is
    refused by ``refusal``. Nothing was sent. ``host``: the host; ``reason``: why, one line."""

    def __init__(self, host: str, reason: str, others: int = 0) -> None:
        more = f" (and {others} other address{'es' if others > 1 else ''})" if others else ""
        super().__init__(f"refusing to connect to {host!r}: {reason}{more}")
        self.host, self.reason = host, reason


def refusal(address: str | Address, allow: Iterable[Network] = ()) -> str | None:
    """Why a sender must not connect to ``address`` (one line naming its category), or None
    if it may: the address is globally routable, or inside a network of ``allow``."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    inner = carried(ip) if isinstance(ip, ipaddress.IPv6Address) else None
    if any(ip in net or (inner is not None and inner[1] in net) for net in allow):
        return None
    if inner is not None:
        form, ipv4 = inner
        why = category(ipv4)
        return None if why is None else f"{ip} ({form} {ipv4}) is {why}"
    why = category(ip)
    return None if why is None else f"{ip} is {why}"


def carried(ip: ipaddress.IPv6Address) -> tuple[str, ipaddress.IPv4Address] | None:
    """The IPv4 address an IPv6 address carries, with the name of the form; None if none."""
    if ip.ipv4_mapped is not None:
        return "IPv4-mapped", ip.ipv4_mapped
    if ip.sixtofour is not None:
        return "6to4", ip.sixtofour
    low = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
    if ip in NAT64:
        return "NAT64", low
    if ip in COMPATIBLE and int(ip) > 1:  # (:: and ::1 are themselves)
        return "IPv4-compatible", low
    return None


def category(ip: Address) -> str | None:
    """The category that keeps a sender from ``ip``; None if it is globally routable."""
    for net, name in CATEGORIES[ip.version]:
        if ip in net:
            return name
    return None if ip.is_global else NOT_GLOBAL


def networks(values: Iterable[object]) -> tuple[Network, ...]:
    """``values`` as networks: ``ipaddress`` networks, or their text (``10.0.0.0/8``, an
    address alone is its /32 or /128); ``ValueError`` naming the first that is neither."""
    if isinstance(values, (str, bytes)):
        raise ValueError(f"allow_networks must be a list of networks, not one: {values!r}")
    found: list[Network] = []
    for value in values:
        if isinstance(value, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
            found.append(value)
        elif type(value) is not str:
            raise ValueError(f"not a network such as 10.0.0.0/8: {value!r}")
        else:
            found.append(network(value))
    return tuple(found)


def network(text: str) -> Network:
    """``text`` as a network, exactly (``ValueError``: one line, what to write instead)."""
    try:
        return ipaddress.ip_network(text)
    except ValueError:
        pass
    try:
        loose = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(f"not a network such as 10.0.0.0/8: {text!r}") from None
    raise ValueError(f"{text!r} has host bits set: the network is {loose}")


def ip_like(host: str) -> bool:
    """Whether ``host`` looks like an IP address rather than a name (aiohttp's test: it
    resolves no host that passes it)."""
    return ":" in host or host.replace(".", "").isdigit()


def system_lookup(host: str, port: int) -> list[str]:
    """The system resolver's addresses of ``host`` for a TCP connection, in its order, once
    each (an IPv6 address with a scope carries it: ``fe80::1%2``)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    shown = [
        f"{where[0]}%{where[3]}" if len(where) == 4 and where[3] else str(where[0])
        for *_, where in found
    ]
    return list(dict.fromkeys(shown))


class Guard:
    """A sender's check of the addresses it connects to: ``allow``, the networks permitted
    although not globally routable; ``lookup``, the resolver (``system_lookup`` unless
    given). It keeps no addresses: each call looks the host up again."""

    def __init__(self, allow: Iterable[object] = (), lookup: Lookup | None = None) -> None:
        if lookup is not None and not callable(lookup):
            raise ValueError(f"lookup must be a function (host, port) -> addresses: {lookup!r}")
        self.allow = networks(allow)
        self.lookup: Lookup = system_lookup if lookup is None else lookup

    def verdict(self, host: str) -> str | None:
        """Why ``host``, written as an IP address, is refused; None if it is permitted, or
        is a name (a name is judged by its addresses, each time it is looked up)."""
        if not ip_like(host):
            return None
        try:
            return refusal(host, self.allow)
        except ValueError:
            return f"{host!r} is not an IP address written in full"

    def check(self, host: str) -> None:
        """Raise ``Refused`` if ``host`` is written as an IP address that is refused."""
        why = self.verdict(host)
        if why is not None:
            raise refused(host, why)

    def addresses(self, host: str, port: int) -> list[str]:
        """The addresses of ``host`` a sender may connect to, looked up now."""
        self.check(host)
        return [host] if ip_like(host) else self.permitted(host, self.lookup(host, port))

    async def addresses_async(self, host: str, port: int) -> list[str]:
        """``addresses``, the lookup in the event loop's default executor."""
        self.check(host)
        if ip_like(host):
            return [host]
        found = await asyncio.get_running_loop().run_in_executor(None, self.lookup, host, port)
        return self.permitted(host, found)

    def permitted(self, host: str, found: Sequence[str]) -> list[str]:
        """The addresses of ``found`` (``host``'s) that are permitted; ``Refused`` if none."""
        if not found:
            raise OSError(f"no address found for {host!r}")
        reasons = [self.judged(address) for address in found]
        kept = [address for address, why in zip(found, reasons, strict=True) if why is None]
        if not kept:
            raise refused(host, next(why for why in reasons if why), len(found) - 1)
        return kept

    def judged(self, address: str) -> str | None:
        """``refusal`` of an address a lookup gave (text that is no address is refused)."""
        try:
            return refusal(address, self.allow)
        except ValueError:
            return f"{address!r} is not an IP address"


def refused(host: str, reason: str, others: int = 0) -> Refused:
    """The ``Refused`` for ``host``, logged (one line: the host and why, never more)."""
    error = Refused(host, reason, others)
    LOG.warning("%s", error)
    return error


def sender_guard(
    host: str, allow_remote: bool, allow: Iterable[object] = (), lookup: Lookup | None = None
) -> Guard | None:
    """A sender's guard (None when it sends to loopback only, ``allow_remote`` False); its
    arguments checked now, and its ``host`` too if it is written as an IP address
    (``ValueError``, one line)."""
    allowed = networks(allow)
    if not allow_remote:
        if allowed or lookup is not None:
            raise ValueError("allow_networks and lookup go with allow_remote=True")
        return None
    guard = Guard(allowed, lookup)
    why = guard.verdict(host)
    if why is not None:
        raise ValueError(f"refusing sink {host!r}: {why} (allow its network: allow_networks)")
    return guard


def aiohttp_resolver(guard: Guard) -> aiohttp.abc.AbstractResolver:
    """An aiohttp resolver (``TCPConnector(resolver=...)``) that answers only the addresses
    ``guard`` permits. aiohttp asks it about names only: a sender checks a host written as an
    IP address itself (``Guard.check``), before every request."""
    from aiohttp.abc import AbstractResolver, ResolveResult

    class GuardedResolver(AbstractResolver):
        async def resolve(
            self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
        ) -> list[ResolveResult]:
            found = await guard.addresses_async(host, port)
            results = [resolved(host, address, port) for address in found]
            kept = [r for r in results if family in (socket.AF_UNSPEC, r["family"])]
            if not kept:
                raise OSError(f"no address of the family asked for is permitted for {host!r}")
            return kept

        async def close(self) -> None:
            return None

    return GuardedResolver()


def aiohttp_host(url: str) -> str:
    """The host of ``url`` as aiohttp reads it (yarl's: IDNA applied, so ``127。0。0。1``
    is 127.0.0.1, which aiohttp asks no resolver about)."""
    from yarl import URL

    return URL(url).raw_host or ""


def resolved(host: str, address: str, port: int) -> aiohttp.abc.ResolveResult:
    """One address as aiohttp's resolvers give it (numeric: never looked up again)."""
    numeric = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return {
        "hostname": host,
        "host": address,
        "port": port,
        "family": family,
        "proto": 0,
        "flags": numeric,
    }
