"""The guard against internal targets (``asnackq.wire.guard``): with remote sinks allowed, a
sender connects only to addresses that are globally routable or in an allowed network,
judged on every new connection, for both senders, a Dispatcher and the command line.

Names are resolved by a stub (``Stub``), never by the system's resolver; nothing is sent
anywhere but 127.0.0.1: a public address appears only in the pure rule, or as a stub's
answer that no connection follows."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re

import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.cli.common import Usage, check_sink
from asnackq.core.worker import Permanent, epoch_ms
from asnackq.lab.hosts import Hosts
from asnackq.lab.schedule import Site
from asnackq.wire.guard import Guard, Refused, networks, refusal
from asnackq.wire.send import AsyncHttpSender, HttpSender

from .conftest import rows
from .sinks import peer, serving
from .test_cli import fails, ok

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


class Counting:
    """A peer on 127.0.0.1 that ACKs every event and counts the requests it received
    (``close``: each answer ends its connection)."""

    def __init__(self, close: bool = False) -> None:
        self.requests = 0
        self.close = close

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = await request.json()
        headers = {"Connection": "close"} if self.close else None
        return web.json_response({"id": body["id"], "status": "applied"}, headers=headers)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


async def sync_send(url: str, events: list[dict[str, object]], **options: object) -> list[object]:
    """Send ``events`` in turn with one ``HttpSender`` (in a thread): each ACK or exception."""

    def run() -> list[object]:
        with HttpSender(url, **options) as send:  # type: ignore[arg-type]
            return [outcome(send, event) for event in events]

    return await asyncio.to_thread(run)


async def async_send(url: str, events: list[dict[str, object]], **options: object) -> list[object]:
    """Send ``events`` in turn with one ``AsyncHttpSender``: each ACK or exception."""
    results: list[object] = []
    async with AsyncHttpSender(url, **options) as send:  # type: ignore[arg-type]
        for event in events:
            try:
                results.append(await send(event))
            except Exception as error:
                results.append(error)
    return results


def outcome(send: HttpSender, event: dict[str, object]) -> object:
    try:
        return send(event)
    except Exception as error:
        return error


SENDERS = pytest.mark.parametrize("send", [sync_send, async_send], ids=["sync", "async"])


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
    with pytest.raises(ValueError, match="not an IP address written in full"):
        HttpSender(f"http://{host}:80/events", allow_remote=True, lookup=stub)
    with pytest.raises(ValueError, match="not an IP address written in full"):
        AsyncHttpSender(f"http://{host}:80/events", allow_remote=True, lookup=stub)


def test_the_guard_s_options_go_with_allow_remote_and_are_checked_at_once():
    with pytest.raises(ValueError, match="go with allow_remote=True"):
        HttpSender("http://127.0.0.1:9/events", allow_networks=["127.0.0.0/8"])
    with pytest.raises(ValueError, match="go with allow_remote=True"):
        AsyncHttpSender("http://127.0.0.1:9/events", lookup=Stub(["127.0.0.1"]))
    with pytest.raises(ValueError, match="has host bits set"):
        AsyncHttpSender("http://sink.test:9/events", allow_remote=True, allow_networks=["::1/64"])
    with pytest.raises(ValueError, match="lookup must be a function"):
        HttpSender("http://sink.test:9/events", allow_remote=True, lookup="127.0.0.1")  # type: ignore[arg-type]
    assert HttpSender("http://localhost:9/events").guard is None  # loopback only: as before


# --- both senders against a real server on 127.0.0.1 -----------------------------------------


def test_an_ipv4_mapped_loopback_literal_is_refused_before_anything_is_sent():
    url = "http://[::ffff:127.0.0.1]:9/events"
    for sender in (HttpSender, AsyncHttpSender):
        with pytest.raises(ValueError, match=r"\(IPv4-mapped 127\.0\.0\.1\) is a loopback"):
            sender(url, allow_remote=True)


@SENDERS
async def test_a_name_that_rebinds_to_loopback_is_refused_when_it_is_sent_to(send):
    """The stub answers a public address first (what a check of the configuration sees),
    then 127.0.0.1: the send is refused, and the server on 127.0.0.1 receives nothing."""
    counting = Counting()
    async with serving(peer(counting.handle)) as server:
        stub = Stub([PUBLIC], ["127.0.0.1"])
        url = f"http://sink.test:{port_of(server.url)}/events"
        assert Guard((), stub).addresses("sink.test", 80) == [PUBLIC]
        (result,) = await send(url, [EVENT], allow_remote=True, lookup=stub)
    assert isinstance(result, Refused) and isinstance(result, Permanent)
    assert result.reason == "127.0.0.1 is a loopback address"
    assert counting.requests == 0 and stub.asked == ["sink.test", "sink.test"]


@SENDERS
async def test_every_new_connection_is_looked_up_and_checked_again(send):
    """127.0.0.1 alone is allowed; the server ends each connection after its answer, and
    the name moves to 127.0.0.2 for the third send: two ACKs, then a refusal."""
    counting = Counting(close=True)
    async with serving(peer(counting.handle)) as server:
        stub = Stub(["127.0.0.1"], ["127.0.0.1"], ["127.0.0.2"])
        url = f"http://sink.test:{port_of(server.url)}/events"
        events = [{"id": f"e-{i}", "qty": 1} for i in range(3)]
        options = {"allow_remote": True, "allow_networks": ["127.0.0.1/32"], "lookup": stub}
        results = await send(url, events, **options)
    assert results[:2] == [True, True], results
    assert isinstance(results[2], Refused), results
    assert results[2].reason == "127.0.0.2 is a loopback address"
    assert counting.requests == 2 and len(stub.asked) == 3


@SENDERS
async def test_a_kept_alive_connection_is_used_again_without_a_lookup(send):
    """Its peer was checked when it was made, and cannot change."""
    counting = Counting()
    async with serving(peer(counting.handle)) as server:
        stub = Stub(["127.0.0.1"], ["127.0.0.2"])  # (the second answer would be refused)
        url = f"http://sink.test:{port_of(server.url)}/events"
        events = [{"id": f"e-{i}", "qty": 1} for i in range(3)]
        options = {"allow_remote": True, "allow_networks": ["127.0.0.1/32"], "lookup": stub}
        results = await send(url, events, **options)
    assert results == [True, True, True] and counting.requests == 3
    assert stub.asked == ["sink.test"]


@SENDERS
async def test_allowing_127_0_0_0_8_lets_a_loopback_server_receive(send):
    counting = Counting()
    async with serving(peer(counting.handle)) as server:
        stub = Stub(["::ffff:127.0.0.1", "127.0.0.1"])
        by_name = f"http://sink.test:{port_of(server.url)}/events"
        options = {"allow_remote": True, "allow_networks": ["127.0.0.0/8"]}
        assert await send(by_name, [EVENT], lookup=stub, **options) == [True]
        assert await send(server.url, [EVENT], **options) == [True]  # (127.0.0.1, as written)
    assert counting.requests == 2 and stub.asked == ["sink.test"]


@SENDERS
async def test_a_host_aiohttp_reads_as_an_address_is_checked_on_each_send(send):
    """``127。0。0。1`` (ideographic full stops) is a name to ``urlsplit`` but 127.0.0.1 to
    aiohttp, which asks no resolver about it: the send is refused all the same."""
    counting = Counting()
    async with serving(peer(counting.handle)) as server:
        stub = Stub(["127.0.0.1"])  # (what the system resolver says of that name)
        url = f"http://127。0。0。1:{port_of(server.url)}/events"
        results = await send(url, [EVENT, EVENT], allow_remote=True, lookup=stub)
    assert all(isinstance(r, Refused) for r in results), results
    assert all(r.reason == "127.0.0.1 is a loopback address" for r in results)
    assert counting.requests == 0


# --- a Dispatcher, and the command line ---------------------------------------------------


async def test_a_dispatcher_s_refused_jobs_end_dead_with_the_reason_logged(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "asnackq.guard")
    queue_file = tmp_path / "q.db"
    counting = Counting()
    async with AsyncQueue.open(queue_file) as queue, serving(peer(counting.handle)) as server:
        await queue.enqueue_many(
            [({"id": f"j-{i}", "qty": 1}, 60_000, 3) for i in range(3)], epoch_ms()
        )
        url = f"http://sink.test:{port_of(server.url)}/events"
        stub = Stub(["127.0.0.1"])
        async with AsyncHttpSender(url, allow_remote=True, lookup=stub) as send:
            summary = await Dispatcher(queue, send, owner="d1", concurrency=2).run()
    assert (summary.dead, summary.dead_permanent, summary.done) == (3, 3, 0)
    assert counting.requests == 0 and len(stub.asked) == 3
    jobs = [r for r in rows(queue_file) if len(r) > 3]
    assert {(r[3], r[4], r[11]) for r in jobs} == {("dead", 1, "permanent")}
    said = [r.getMessage() for r in caplog.records if r.name == "asnackq.guard"]
    assert said == ["refusing to connect to 'sink.test': 127.0.0.1 is a loopback address"] * 3


def test_the_lab_s_workers_allow_their_link_s_network():
    hosts = Hosts(count=2, subnet=ipaddress.IPv4Network("10.77.3.0/24"))
    site = Site(config=None, db="q.db", hosts=hosts)  # type: ignore[arg-type]
    assert site.worker_options == ("--allow-remote", "--allow-network", "10.77.3.0/24")
    sink = f"http://{hosts.sink_addr}:8080/events"
    check_sink(sink, True, [hosts.subnet])  # (what `asnackq work` checks: no usage error)
    with pytest.raises(Usage, match=re.escape("10.77.3.2 is a private address")):
        check_sink(sink, True)
    assert Site(config=None, db="q.db").worker_options == ()  # type: ignore[arg-type]


@pytest.fixture
def queue(tmp_path):
    """A queue file (empty: every refusal here comes before a claim)."""
    ok("init", tmp_path / "q.db")
    return tmp_path / "q.db"


BAD_NETWORKS = [
    (("--allow-network", "10.0.0.1/24"), "has host bits set: the network is 10.0.0.0/24"),
    (("--allow-network", "ten"), "not a network such as 10.0.0.0/8: 'ten'"),
    (("--allow-network", ""), "not a network such as 10.0.0.0/8: ''"),
    (("--allow-network", "10.0.0.0/8", "--allow-network", "fd00::/129"), "'fd00::/129'"),
    (("--allow-network",), "expected one argument"),
]


@pytest.mark.process
@pytest.mark.parametrize(("options", "said"), BAD_NETWORKS)
def test_a_bad_allow_network_is_a_usage_error_for_work(queue, options, said):
    before = queue.read_bytes()
    text = fails(
        "work", queue, "--sink", "http://127.0.0.1:9/events", "--allow-remote", *options, code=2
    )
    assert said in text and "--allow-network" in text
    assert queue.read_bytes() == before


@pytest.mark.process
@pytest.mark.parametrize(("options", "said"), BAD_NETWORKS[:2])
def test_a_bad_allow_network_is_a_usage_error_for_the_outbox(tmp_path, options, said):
    source = tmp_path / "source.db"
    ok("outbox", "accept", source, "--id", "o1", "--qty", "1")
    before = source.read_bytes()
    sink = "http://127.0.0.1:9/events"
    text = fails("outbox", "dispatch", source, "--sink", sink, "--allow-remote", *options, code=2)
    assert said in text
    assert source.read_bytes() == before


@pytest.mark.process
def test_the_guard_s_usage_errors_name_the_option(queue, tmp_path):
    private = "http://10.0.0.3:9/events"  # refused before any connection
    said = fails("work", queue, "--sink", private, "--allow-remote", code=2)
    assert said == (
        "asnackq work: refusing sink '10.0.0.3': 10.0.0.3 is a private address "
        "(allow its network with --allow-network)\n"
    )
    said = fails(
        "work",
        queue,
        "--sink",
        "http://127.0.0.1:9/events",
        "--allow-network",
        "10.0.0.0/8",
        code=2,
    )
    assert said == "asnackq work: --allow-network goes with --allow-remote\n"
    source = tmp_path / "source.db"
    ok("outbox", "accept", source, "--id", "o1", "--qty", "1")
    mapped = "http://[::ffff:127.0.0.1]:9/events"
    said = fails("outbox", "dispatch", source, "--sink", mapped, "--allow-remote", code=2)
    assert "(IPv4-mapped 127.0.0.1) is a loopback address" in said
