"""Every path that sends, against ordinary servers (``tests/peers.py``): ``run_once`` with
the stdlib sender and the Dispatcher with the async one over every kind; ``asnackq outbox
dispatch`` and ``asnackq work`` (real processes) over a subset, https included."""

from __future__ import annotations

import json
import os
import ssl
import subprocess

import pytest
import trustme
from rich.console import Console

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import outbox
from asnackq.core import worker as w
from asnackq.lab import LabConfig, procs, run_lab
from asnackq.wire.send import AsyncHttpSender, HttpSender

from .conftest import rows
from .peers import KINDS, serving

IDS = [f"job-{i}" for i in range(4)]


def filled_queue(path):
    con = w.open_queue(path)
    w.enqueue_many(con, [({"id": i, "qty": 1}, 60_000, 3) for i in IDS], w.epoch_ms())
    return con


def statuses(path):
    return sorted((row[1], row[3]) for row in rows(path) if row[0] != "--")


@pytest.mark.parametrize("kind", KINDS)
def test_run_once_with_the_stdlib_sender_delivers_to_every_kind(kind, tmp_path):
    con = filled_queue(tmp_path / "q.db")
    try:
        with serving(kind, tmp_path) as peer, HttpSender(peer.url) as send:
            for _ in IDS:
                assert w.run_once(con, "w1", w.epoch_ms, send, 0.5)["status"] == "done"
    finally:
        con.close()
    assert sorted(peer.ids) == IDS


@pytest.mark.parametrize("kind", KINDS)
async def test_the_dispatcher_with_the_async_sender_delivers_to_every_kind(kind, tmp_path):
    filled_queue(tmp_path / "q.db").close()
    with serving(kind, tmp_path) as peer:
        async with AsyncQueue.open(tmp_path / "q.db") as queue, AsyncHttpSender(peer.url) as send:
            summary = await Dispatcher(queue, send, owner="d1", concurrency=2).run()
    assert (summary.done, summary.dead) == (len(IDS), 0)
    assert sorted(peer.ids) == IDS


def asnackq(*args, env=None):
    run = subprocess.run(
        procs.command(*args),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )
    return run.returncode, run.stdout, run.stderr


def outbox_with_ids(path):
    con = outbox.open_source(path)
    for event_id in IDS:
        outbox.accept(con, {"id": event_id, "qty": 1})
    con.close()


@pytest.mark.process
@pytest.mark.parametrize("kind", ["http10", "close", "chunked", "gzip", "sink"])
def test_outbox_dispatch_delivers_to_ordinary_servers(kind, tmp_path):
    outbox_with_ids(tmp_path / "source.db")
    with serving(kind, tmp_path) as peer:
        code, out, err = asnackq("outbox", "dispatch", tmp_path / "source.db", "--sink", peer.url)
    assert (code, err) == (0, "") and json.loads(out) == {"sent": IDS}
    assert peer.ids == IDS


@pytest.mark.process
@pytest.mark.parametrize("kind", ["http10", "close", "until-close", "continue"])
def test_work_delivers_to_ordinary_servers(kind, tmp_path):
    filled_queue(tmp_path / "q.db").close()
    with serving(kind, tmp_path) as peer:
        code, _, err = asnackq("work", tmp_path / "q.db", "--sink", peer.url, "--until-empty")
    assert code == 0, err
    assert sorted(peer.ids) == IDS and {status for _, status in statuses(tmp_path / "q.db")} == {
        "done"
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A server CA, its certificate for 127.0.0.1, a client CA and a client certificate."""
    root = tmp_path_factory.mktemp("pki")
    ca, clients = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(root / "ca.pem")
    clients.cert_pem.write_to_path(root / "clients.pem")
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(root / "server.pem")
    server.private_key_pem.write_to_path(root / "server.key")
    client = clients.issue_cert("worker-1")
    client.cert_chain_pems[0].write_to_path(root / "client.pem")
    client.private_key_pem.write_to_path(root / "client.key")
    return root


@pytest.mark.process
def test_work_and_outbox_dispatch_over_tls_to_the_sink_requiring_client_certs(pki, tmp_path):
    filled_queue(tmp_path / "q.db").close()
    outbox_with_ids(tmp_path / "source.db")
    tls = ("--tls-cert", pki / "server.pem", "--tls-key", pki / "server.key")
    mine = ("--sink-cert", pki / "client.pem", "--sink-key", pki / "client.key")
    with procs.sink_process(
        tmp_path / "sink.db", *tls, "--tls-client-ca", pki / "clients.pem"
    ) as url:
        assert url.startswith("https://127.0.0.1:")
        trusted = ("--sink", url, "--sink-ca", pki / "ca.pem", *mine)
        code, _, err = asnackq("work", tmp_path / "q.db", *trusted, "--until-empty")
        assert code == 0, err
        code, out, err = asnackq("outbox", "dispatch", tmp_path / "source.db", *trusted)
        assert code == 0 and json.loads(out) == {"sent": IDS}, err
    assert {status for _, status in statuses(tmp_path / "q.db")} == {"done"}


@pytest.mark.process
def test_the_system_trust_store_is_the_default(pki, tmp_path):
    outbox_with_ids(tmp_path / "source.db")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki / "server.pem", pki / "server.key")
    with serving("http10", tmp_path, tls=context) as peer:
        source, sink = tmp_path / "source.db", ("--sink", peer.url)
        code, _, err = asnackq("outbox", "dispatch", source, *sink)
        assert code == 1 and "not from a trusted CA" in err and peer.ids == []
        code, _, err = asnackq("outbox", "dispatch", source, *sink, env=trusting(pki))
        assert code == 0, err
    assert peer.ids == IDS


def trusting(pki):
    """An environment whose default trust store is the test CA alone."""
    return {"SSL_CERT_FILE": str(pki / "ca.pem"), "SSL_CERT_DIR": str(pki)}


@pytest.mark.parametrize(
    ("options", "why"),
    [
        (("--sink-ca", "missing.pem"), "--sink-ca 'missing.pem': no such file"),
        (("--sink-ca", "not.pem"), "--sink-ca 'not.pem': not PEM"),
        (("--sink-cert", "not.pem"), "--sink-cert/--sink-key 'not.pem': not PEM, or no key"),
        (("--sink-key", "not.pem"), "--sink-key needs --sink-cert"),
    ],
)
@pytest.mark.process
@pytest.mark.parametrize("command", ["work", "outbox dispatch"])
def test_tls_files_that_cannot_be_used_are_one_line_and_exit_2(
    command, options, why, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not.pem").write_text("hello\n")
    filled_queue(tmp_path / "q.db").close()
    target = "q.db" if command == "work" else "source.db"
    argv = (*command.split(), target, "--sink", "https://127.0.0.1:9/events", *options)
    code, out, err = asnackq(*argv)
    assert (code, out) == (2, "") and err.startswith(f"asnackq {command.split()[0]}: {why}")
    assert err.count("\n") == 1
    assert not (tmp_path / "source.db").exists()


@pytest.mark.parametrize(
    ("options", "why"),
    [
        (("--tls-cert", "not.pem", "--tls-key", "not.pem"), "--tls-cert/--tls-key 'not.pem'"),
        (("--tls-cert", "missing.pem", "--tls-key", "k"), "--tls-cert 'missing.pem': no such"),
        (("--tls-cert", "not.pem"), "--tls-cert and --tls-key go together"),
    ],
)
@pytest.mark.process
def test_the_sink_refuses_tls_files_that_cannot_be_used(options, why, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not.pem").write_text("hello\n")
    code, out, err = asnackq("sink", "--db", "sink.db", *options)
    assert (code, out) == (2, "") and err.startswith(f"asnackq sink: {why}")
    assert err.count("\n") == 1 and not (tmp_path / "sink.db").exists()


@pytest.mark.process
def test_the_lab_runs_its_sinks_on_https(pki, tmp_path):
    tls = {"tls_cert": pki / "server.pem", "tls_key": pki / "server.key", "sink_ca": pki / "ca.pem"}
    config = LabConfig(jobs=40, processes=1, concurrency=4, directory=tmp_path / "lab", **tls)
    with open(os.devnull, "w") as devnull:
        result = run_lab(config, Console(file=devnull))
    assert (result.evidence.violations, result.liveness_failures) == ([], [])
    assert {status for _, status in statuses(tmp_path / "lab" / "queue.db")} == {"done"}


@pytest.mark.parametrize(
    ("files", "why"),
    [
        ({"tls_cert": "server.pem"}, "--tls-cert, --tls-key and --sink-ca go together"),
        ({"tls_cert": "ca.pem", "tls_key": "ca.pem", "sink_ca": "ca.pem"}, "tls_cert/tls_key"),
        ({"tls_cert": "server.pem", "tls_key": "server.key", "sink_ca": "x.pem"}, "ca_file"),
    ],
)
def test_the_lab_refuses_tls_files_that_cannot_be_used(files, why, pki):
    config = LabConfig(jobs=1, **{name: pki / path for name, path in files.items()})
    with pytest.raises(ValueError, match="^" + why):
        config.check()
