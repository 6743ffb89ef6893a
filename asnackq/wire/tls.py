"""TLS contexts: the senders' (client) and the sink's (server), from PEM files.

A file that is missing, unreadable or not PEM (or a key that does not match its
certificate) is one ``ValueError`` line naming the option and the file.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["server_context", "tls_cause", "tls_context"]

T = TypeVar("T")
KEY_WHY = "not PEM, or no key that matches the certificate"
ENCRYPTED = "the key is encrypted: give an unencrypted key file (no pass phrase is asked for)"


class Encrypted(Exception):
    """Raised instead of asking for a key's pass phrase (OpenSSL would ask the terminal)."""


def no_pass_phrase() -> str:
    """The ``password`` of ``load_cert_chain``: an encrypted key is refused, never prompted."""
    raise Encrypted(ENCRYPTED)


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
        load = lambda: context.load_cert_chain(  # noqa: E731
            str(cert_file), keyfile, password=no_pass_phrase
        )
        pem("cert_file/key_file", cert_file, load, KEY_WHY)
    return context


# OpenSSL's verify codes (``X509_V_ERR_*``) a sender meets, by what a person should fix.
UNTRUSTED_CA = {2, 18, 19, 20, 21, 24, 27, 28}
EXPIRED, NOT_YET_VALID, HOST_MISMATCH, IP_MISMATCH = 10, 9, 62, 64
CLIENT_REFUSED = (  # the sink's alerts about this worker's client certificate
    "CERTIFICATE_REQUIRED",
    "BAD_CERTIFICATE",
    "UNKNOWN_CA",
    "CERTIFICATE_UNKNOWN",
    "ACCESS_DENIED",
    "CERTIFICATE_REVOKED",
    "CERTIFICATE_EXPIRED",
    "DECRYPT_ERROR",
)


def tls_cause(error: BaseException) -> str:
    """Why TLS with the sink failed, in one line naming what to fix: its CA, its
    certificate's dates or names, the protocol, or this worker's client certificate."""
    cause: BaseException | None = error
    while cause is not None:
        # (aiohttp's wrappers: the certificate's error, or the connection's)
        inner = getattr(cause, "certificate_error", None) or getattr(cause, "os_error", None)
        if isinstance(inner, BaseException) and inner is not cause:
            cause = inner
        if isinstance(cause, ssl.SSLCertVerificationError) and hasattr(cause, "verify_code"):
            code, text = cause.verify_code, cause.verify_message
            if code in UNTRUSTED_CA:
                return f"the sink's certificate is not from a trusted CA ({text}; see --sink-ca)"
            if code == EXPIRED:
                return "the sink's certificate has expired"
            if code == NOT_YET_VALID:
                return "the sink's certificate is not valid yet (or this host's clock is behind)"
            if code in (HOST_MISMATCH, IP_MISMATCH):
                return f"the sink's certificate names another host ({text})"
            return f"the sink's certificate cannot be verified ({text})"
        if isinstance(cause, ssl.SSLError):
            reason = str(getattr(cause, "reason", None) or "")
            if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
                return "the sink does not speak TLS on that port (https to a plain http port?)"
            if any(alert in reason for alert in CLIENT_REFUSED):
                return f"the sink refused this worker's client certificate or wanted one ({reason})"
            if "PROTOCOL" in reason or "VERSION" in reason:
                return f"no TLS version or cipher in common with the sink ({reason})"
            return f"the TLS handshake with the sink failed ({reason or cause})"
        cause = cause.__cause__ or cause.__context__
    return f"TLS with the sink failed ({error!r})"


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
    except Encrypted:
        raise ValueError(f"{name} {str(path)!r}: {ENCRYPTED}") from None
    except (OSError, ssl.SSLError) as error:
        plain = isinstance(error, OSError) and not isinstance(error, ssl.SSLError)
        reason = error.strerror if plain and error.strerror else why
        raise ValueError(f"{name} {str(path)!r}: {reason}") from None


def server_context(cert_file: Path, key_file: Path, client_ca: Path | None) -> ssl.SSLContext:
    """The sink's context: its certificate and key; with ``client_ca``, a client
    certificate signed by that CA is required of every connection."""
    files({"tls_cert": cert_file, "tls_key": key_file, "tls_client_ca": client_ca})
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    load = lambda: context.load_cert_chain(cert_file, key_file, password=no_pass_phrase)  # noqa: E731
    pem("tls_cert/tls_key", cert_file, load, KEY_WHY)
    if client_ca is not None:
        pem("tls_client_ca", client_ca, lambda: context.load_verify_locations(client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context
