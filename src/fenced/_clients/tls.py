"""The TLS context of fenced's own HTTP clients (the http:// source, the check kit's HTTP
resource), decided once.

Loading the system's (or certifi's) trusted CAs costs ~30 ms of CPU, and httpx does it for
every client it makes unless given a context. A plain ``http://`` client never uses one:
it gets a context that trusts nothing (verification stays on, so a request that did reach a
TLS server through it would be refused, not let through unverified)."""

from __future__ import annotations

import ssl

from .._core.errors import ConfigurationError

__all__ = ["tls_context"]


def tls_context(scheme: str, ca_file: str | None = None) -> ssl.SSLContext:
    """For ``https``: the system's trusted CAs, or only ``ca_file`` (a private CA); a bad
    file is one line (:class:`~fenced.ConfigurationError`). For ``http`` with no
    ``ca_file``: a verifying context with no trust anchors, made without reading any."""
    if scheme.lower() == "http" and ca_file is None:
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # (hostname check and CERT_REQUIRED on)
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"cannot use ca_file {ca_file!r}: {exc}") from None
