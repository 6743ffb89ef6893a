"""TLS contexts: the senders' (client) and the sink's (server), from PEM files.

A file that is missing, unreadable or not PEM (or a key that does not match its
certificate) is one ``ValueError`` line naming the option and the file.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["server_context", "tls_context"]

T = TypeVar("T")
KEY_WHY = "not PEM, or no key that matches the certificate"


def tls_context(
    scheme: str, ca_file: object = None, cert_file: object = None, key_file: object = None
) -> ssl.SSLContext | None:
    """The client context for a sink URL's scheme: None for http; for https the system's
    trust store, or only ``ca_file``'s CAs, and ``cert_file`` (+ ``key_file``) presented
    as the client certificate.  A file that is missing or not PEM is a ``ValueError``."""
    named = {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file}
    files(named)
    if scheme != "https":
        if any(value is not None for value in named.values()):
            raise ValueError("ca_file, cert_file and key_file need an https:// sink URL")
        return None
    if key_file is not None and cert_file is None:
        raise ValueError("key_file needs cert_file")
    cafile = None if ca_file is None else str(ca_file)
    context = pem("ca_file", ca_file, lambda: ssl.create_default_context(cafile=cafile))
    if cert_file is not None:
        keyfile = None if key_file is None else str(key_file)
        load = lambda: context.load_cert_chain(str(cert_file), keyfile)  # noqa: E731
        pem("cert_file/key_file", cert_file, load, KEY_WHY)
    return context


def files(named: dict[str, object]) -> None:
    """Each given path names a file; ``ValueError`` names the first that does not."""
    for name, value in named.items():
        if value is not None and not isinstance(value, (str, Path)):
            raise ValueError(f"{name} must be a path: {value!r}")
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{name} {str(value)!r}: no such file")


def pem(name: str, path: object, load: Callable[[], T], why: str = "not PEM") -> T:
    """``load()``; a file that cannot be read, or not as ``why`` says, is one
    ``ValueError`` line."""
    try:
        return load()
    except (OSError, ssl.SSLError) as error:
        plain = isinstance(error, OSError) and not isinstance(error, ssl.SSLError)
        reason = error.strerror if plain and error.strerror else why
        raise ValueError(f"{name} {str(path)!r}: {reason}") from None


def server_context(cert_file: Path, key_file: Path, client_ca: Path | None) -> ssl.SSLContext:
    """The sink's context: its certificate and key; with ``client_ca``, a client
    certificate signed by that CA is required of every connection."""
    files({"tls_cert": cert_file, "tls_key": key_file, "tls_client_ca": client_ca})
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    load = lambda: context.load_cert_chain(cert_file, key_file)  # noqa: E731
    pem("tls_cert/tls_key", cert_file, load, KEY_WHY)
    if client_ca is not None:
        pem("tls_client_ca", client_ca, lambda: context.load_verify_locations(client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context
