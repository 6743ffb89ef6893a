"""Sequential sends per second of the stdlib sender (``HttpSender``) to the project's sink:
one kept-alive connection against one connection per send, measured in one run.

    python benchmarks/sender_keepalive.py [--sends 2000] [--base DIR] [--tls]

The sink is an ``asnackq sink`` process on 127.0.0.1 port 0 (a fresh DB: every send is a
new id, an applied effect).  Runs alternate between the modes, three rounds each; the best
round of each mode counts.  The modes:
  kept       HttpSender as it is: one connection for every send
  per-send   without --base: HttpSender closing its connection after each send (a new
             connection per send, as the sender was built before it kept connections);
             with --base DIR: the sender of an older checkout, e.g. made by
             ``git worktree add DIR 874950c``
--tls runs the sink on https with a throwaway CA (needs trustme): a handshake per send.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asnackq.lab.procs import sink_process
from asnackq.wire.send import HttpSender

Send = Callable[[dict[str, Any]], object]


def base_sender(base: Path, url: str) -> Send:
    """The ``HttpSender`` of the checkout at ``base`` (its own module, this package's core)."""
    spec = importlib.util.spec_from_file_location("base_http_send", base / "asnackq/http_send.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sender: Send = module.HttpSender(url)
    return sender


def per_send(url: str, **tls: Any) -> Send:
    sender = HttpSender(url, **tls)

    def send(event: dict[str, Any]) -> object:
        try:
            return sender(event)
        finally:
            sender.close()

    return send


def rate(send: Send, prefix: str, sends: int) -> float:
    started = time.perf_counter()
    for n in range(sends):
        assert send({"id": f"{prefix}-{n}", "qty": 1}) is True
    return sends / (time.perf_counter() - started)


def pki(root: Path) -> tuple[list[str], dict[str, Any]]:
    """Sink options and sender options for https with a throwaway CA."""
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(root / "ca.pem")
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(root / "server.pem")
    server.private_key_pem.write_to_path(root / "server.key")
    options = ["--tls-cert", str(root / "server.pem"), "--tls-key", str(root / "server.key")]
    return options, {"ca_file": root / "ca.pem"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sends", type=int, default=2000)
    parser.add_argument("--base", type=Path, default=None, help="an older checkout")
    parser.add_argument("--tls", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        sink_options, tls = pki(Path(root)) if args.tls else ([], {})
        if args.base is not None and args.tls:
            parser.error("--base and --tls do not go together (the older sender has no CA)")
        with sink_process(Path(root) / "sink.db", *sink_options) as url:
            kept = HttpSender(url, **tls)
            before = base_sender(args.base, url) if args.base else per_send(url, **tls)
            best = {"kept": 0.0, "per-send": 0.0}
            for round_ in range(3):
                best["per-send"] = max(best["per-send"], rate(before, f"b{round_}", args.sends))
                best["kept"] = max(best["kept"], rate(kept, f"k{round_}", args.sends))
            kept.close()
    label = f"per-send ({'--base ' + str(args.base) if args.base else 'new connection'})"
    print(f"{'https' if args.tls else 'http'}, {args.sends} sequential sends, best of 3:")
    print(f"  {label}: {best['per-send']:8.0f} sends/s")
    print(f"  kept-alive: {best['kept']:8.0f} sends/s")
    print(f"  ratio kept/per-send: {best['kept'] / best['per-send']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
