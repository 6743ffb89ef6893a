"""The guard against internal targets (``asnackq.wire.guard``): the rule, and the guard's
lookups.

Names are resolved by a stub (``Stub``), never by the system's resolver; nothing is sent
anywhere but 127.0.0.1: a public address appears only in the pure rule, or as a stub's
answer that no connection follows."""

from __future__ import annotations

import ipaddress
import re

import pytest

from asnackq.core.worker import Permanent
from asnackq.wire.guard import Guard, Refused, networks, refusal

PUBLIC = "93.184.215.14"  # a stub's answer only: judged, never connected to
EVENT = {"id": "e-1", "qty": 1}


class Stub:
    """A resolver stub: call ``n`` answers ``answers[n]`` (the last one repeats); every host
    asked for is recorded."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        return self.answers[min(len(self.asked), len(self.answers)) - 1]


# --- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "named"),
    [
        ("127.0.0.1", "a loopback address"),
        ("127.255.0.9", "a loopback address"),
        ("::1", "a loopback address"),
        ("10.1.2.3", "a private address"),
        ("172.16.0.1", "a private address"),
        ("192.168.1.1", "a private address"),
        ("100.64.0.1", "a shared address (carrier-grade NAT)"),
        ("169.254.1.1", "a link-local address"),
        ("fe80::1", "a link-local address"),
        ("fc00::1", "a unique-local address"),
        ("fd12:3456::1", "a unique-local address"),
        ("fec0::1", "a site-local address"),
        ("224.0.0.1", "a multicast address"),
        ("239.1.2.3", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("0.0.0.0", "the unspecified address"),
        ("::", "the unspecified address"),
        ("0.1.2.3", "a reserved address (this network)"),
        ("240.0.0.1", "a reserved address"),
        ("192.0.0.8", "a reserved address (IETF protocol assignments)"),
        ("255.255.255.255", "the broadcast address"),
        ("192.0.2.1", "a documentation address"),
        ("198.51.100.1", "a documentation address"),
        ("203.0.113.1", "a documentation address"),
        ("2001:db8::1", "a documentation address"),
        ("198.18.0.1", "a benchmarking address"),
        ("2001::1", "a Teredo address"),
        ("169.254.169.254", "a cloud metadata address"),
        ("fd00:ec2::254", "a cloud metadata address"),
        ("100.100.100.200", "a cloud metadata address"),
    ],
)
def test_each_category_is_refused_with_its_name(address, named):
    why = refusal(address)
    assert why == f"{ipaddress.ip_address(address)} is {named}"


@pytest.mark.parametrize(
    ("address", "form", "inside", "named"),
    [
        ("::ffff:127.0.0.1", "IPv4-mapped", "127.0.0.1", "a loopback address"),
        ("::ffff:169.254.169.254", "IPv4-mapped", "169.254.169.254", "a cloud metadata address"),
        ("::10.0.0.1", "IPv4-compatible", "10.0.0.1", "a private address"),
        ("64:ff9b::127.0.0.1", "NAT64", "127.0.0.1", "a loopback address"),
        ("64:ff9b::a9fe:a9fe", "NAT64", "169.254.169.254", "a cloud metadata address"),
        ("2002:c0a8:101::1", "6to4", "192.168.1.1", "a private address"),
    ],
)
def test_an_ipv6_form_is_judged_on_the_ipv4_inside(address, form, inside, named):
    shown = ipaddress.ip_address(address)
    assert refusal(address) == f"{shown} ({form} {inside}) is {named}"


@pytest.mark.parametrize(
    "address", ["8.8.8.8", PUBLIC, "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::8.8.8.8"]
)
def test_globally_routable_addresses_are_permitted(address):
    assert refusal(address) is None


def test_an_allowed_network_permits_its_addresses_and_no_other():
    allow = networks(["10.0.0.0/8", "fd00::/8", ipaddress.ip_network("127.0.0.1/32")])
    for address in ("10.1.2.3", "::ffff:10.1.2.3", "64:ff9b::10.1.2.3", "fd00::5", "127.0.0.1"):
        assert refusal(address, allow) is None, address
    for address in ("192.168.1.1", "127.0.0.2", "169.254.169.254", "fc00::1"):
        assert refusal(address, allow) is not None, address


@pytest.mark.parametrize(
    ("values", "said"),
    [
        (["10.0.0.1/24"], "'10.0.0.1/24' has host bits set: the network is 10.0.0.0/24"),
        (["ten"], "not a network such as 10.0.0.0/8: 'ten'"),
        ([""], "not a network such as 10.0.0.0/8: ''"),
        (["10.0.0.0/33"], "not a network such as 10.0.0.0/8: '10.0.0.0/33'"),
        ([" 10.0.0.0/8"], "not a network such as 10.0.0.0/8: ' 10.0.0.0/8'"),
        ([True], "not a network such as 10.0.0.0/8: True"),
        ([ipaddress.ip_address("10.0.0.1")], "not a network such as 10.0.0.0/8: IPv4Address"),
        ("10.0.0.0/8", "a list of networks, not one: '10.0.0.0/8'"),
    ],
)
def test_a_bad_network_is_one_line(values, said):
    with pytest.raises(ValueError, match=re.escape(said)) as caught:
        networks(values)
    assert "\n" not in str(caught.value)


# --- the guard's lookups --------------------------------------------------------------------


def test_a_guard_keeps_the_permitted_addresses_in_the_resolver_s_order():
    stub = Stub(["127.0.0.1", PUBLIC, "10.0.0.7", "::1"])
    assert Guard((), stub).addresses("sink.test", 80) == [PUBLIC]
    assert Guard(["10.0.0.0/8"], stub).addresses("sink.test", 80) == [PUBLIC, "10.0.0.7"]
    assert stub.asked == ["sink.test", "sink.test"]


def test_a_host_with_no_address_permitted_is_refused_naming_it_and_why(caplog):
    stub = Stub(["127.0.0.1", "10.0.0.7", "not-an-address"])
    with pytest.raises(Refused) as caught:
        Guard((), stub).addresses("sink.test", 80)
    error = caught.value
    assert isinstance(error, Permanent)
    assert str(error) == (
        "refusing to connect to 'sink.test': 127.0.0.1 is a loopback address "
        "(and 2 other addresses)"
    )
    assert (error.host, error.reason) == ("sink.test", "127.0.0.1 is a loopback address")
    assert [r.getMessage() for r in caplog.records if r.name == "asnackq.guard"] == [str(error)]


def test_a_host_that_resolves_to_nothing_is_not_a_refusal():
    with pytest.raises(OSError, match="no address found") as caught:
        Guard((), Stub([])).addresses("sink.test", 80)
    assert not isinstance(caught.value, Refused)


@pytest.mark.parametrize("host", ["127.1", "2130706433", "127.0.0.1.", "0"])
def test_an_address_not_written_in_full_is_refused_without_a_lookup(host):
    stub = Stub([PUBLIC])
    with pytest.raises(Refused, match="not an IP address written in full"):
        Guard((), stub).addresses(host, 80)
    assert stub.asked == []
