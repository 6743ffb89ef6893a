"""https sinks with a throwaway CA made at test time (trustme): a verified send on both
senders; an unknown CA, another host's certificate, an expired one, a missing client
certificate refused (``Untrusted``, never evidence); files that cannot be used refused."""

from __future__ import annotations

import datetime
import ssl

import pytest
import trustme

from asnackq.core.worker import Unavailable
from asnackq.wire.send import AsyncHttpSender, HttpSender, Untrusted

from .peers import send_each, serving

IDS = ("a", "b")


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture
def ca_file(ca, tmp_path):
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(path)
    return path


def server_tls(ca, *names, client_ca=None, **dates):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*(names or ("127.0.0.1",)), **dates).configure_cert(context)
    if client_ca is not None:
        client_ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@pytest.mark.parametrize("kind", ["sink", "http10", "close", "keep-alive"])
async def test_a_send_to_a_certificate_from_the_given_ca_is_verified(kind, ca, ca_file, tmp_path):
    with serving(kind, tmp_path, tls=server_tls(ca)) as peer:
        assert peer.url.startswith("https://")
        both = await send_each(peer.url, IDS, ca_file=ca_file)
    assert both == ([True, True], [True, True]) and peer.ids == [*IDS, *IDS]


@pytest.mark.parametrize(
    ("names", "dates"),
    [
        pytest.param((), {}, id="unknown-ca"),
        pytest.param(("localhost",), {}, id="another-host"),
        pytest.param(
            (),
            {"not_after": datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)},
            id="expired",
        ),
    ],
)
async def test_a_certificate_that_cannot_be_trusted_is_refused_by_both(
    names, dates, ca, ca_file, tmp_path
):
    trusted = {} if names or dates else {"ca_file": None}  # unknown-ca: the system store
    options = {"ca_file": ca_file, **trusted}
    with serving("sink", tmp_path, tls=server_tls(ca, *names, **dates)) as peer:
        assert await send_each(peer.url, IDS, **options) == ([Untrusted] * 2, [Untrusted] * 2)
    assert peer.ids == []
    assert issubclass(Untrusted, Exception) and Untrusted.__mro__[1].__name__ == "BadAck"


def client_files(ca, cert):
    ca.issue_cert("worker-1").private_key_and_cert_chain_pem.write_to_path(cert)
    return cert


@pytest.mark.parametrize(
    ("kind", "version"),
    [
        ("http10", ssl.TLSVersion.TLSv1_2),
        ("http10", ssl.TLSVersion.TLSv1_3),
        ("sink", ssl.TLSVersion.TLSv1_2),
        ("sink", ssl.TLSVersion.TLSv1_3),
    ],
)
async def test_a_client_certificate_required_and_presented(kind, version, ca, ca_file, tmp_path):
    """Refused without one (or with another CA's). A server that sends its alert during a
    TLS 1.2 handshake (http.server's blocking ssl) is refused as ``Untrusted``; with TLS 1.3
    the alert comes after the client's handshake, and asyncio's ssl closes with no alert:
    the client sees an alert (``Untrusted``) or only a close (``Unavailable``)."""
    clients = trustme.CA()
    tls = server_tls(ca, client_ca=clients)
    tls.maximum_version = version
    with serving(kind, tmp_path, tls=tls) as peer:
        cert = client_files(clients, tmp_path / "client.pem")
        both = await send_each(peer.url, IDS, ca_file=ca_file, cert_file=cert)
        assert both == ([True, True], [True, True])
        stranger = client_files(trustme.CA(), tmp_path / "stranger.pem")
        refused = await send_each(peer.url, IDS[:1], ca_file=ca_file, cert_file=stranger)
        none = await send_each(peer.url, IDS[:1], ca_file=ca_file)
    assert peer.ids == [*IDS, *IDS]
    alert = (kind, version) == ("http10", ssl.TLSVersion.TLSv1_2)
    expected = {Untrusted} if alert else {Untrusted, Unavailable}
    assert {outcome[0] for outcome in (*refused, *none)} <= expected


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"ca_file": "missing.pem"}, "ca_file 'missing.pem': no such file"),
        ({"ca_file": "not.pem"}, "ca_file 'not.pem': not PEM"),
        ({"cert_file": "not.pem"}, "cert_file/key_file 'not.pem': not PEM"),
        ({"cert_file": "ca.pem"}, "cert_file/key_file 'ca.pem': not PEM"),  # no key in it
        ({"key_file": "ca.pem"}, "key_file needs cert_file"),
        ({"ca_file": 5}, "ca_file must be a path"),
    ],
)
def test_tls_files_that_cannot_be_used_are_refused_by_both(
    options, why, ca_file, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not.pem").write_text("hello\n")
    for sender in (HttpSender, AsyncHttpSender):
        with pytest.raises(ValueError, match="^" + why):
            sender("https://127.0.0.1:1/events", **options)


def test_tls_files_need_an_https_url(ca_file):
    for sender in (HttpSender, AsyncHttpSender):
        with pytest.raises(ValueError, match="need an https:// sink URL"):
            sender("http://127.0.0.1:1/events", ca_file=ca_file)
