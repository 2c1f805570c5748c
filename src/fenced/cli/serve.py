"""``fenced serve``: the lock service over HTTP (docs/server.md)."""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

from .._core.errors import ConfigurationError
from ._common import (
    Subparsers,
    _body_limit,
    _named,
    _read_timeout,
    _signing_key,
    _source_arguments,
    _source_id_argument,
    _source_options,
    _timeout,
    _ttl,
    _url,
    _verbose,
    key_file,
)

NAME = "serve"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    serve = sub.add_parser(
        "serve",
        parents=[_verbose()],
        help="run the lock service over HTTP for clients in any language (docs/server.md)",
        description=(
            "Serve the locks of one token source over HTTP/JSON (OpenAPI at /openapi.json, a "
            "dashboard at /, Prometheus metrics at /metrics). Stateless: run several in front "
            "of one etcd, PostgreSQL or Redis and any may die. Without --api-keys it listens "
            "on loopback only, unless --insecure-no-auth. On SIGTERM it stops answering; held "
            "leases are left to expire, never released on their holders' behalf."
        ),
    )
    _source_arguments(serve)
    serve.add_argument(
        "--listen",
        default="127.0.0.1:7400",
        metavar="HOST:PORT",
        help="address to listen on (127.0.0.1:7400; port 0 picks one and prints it)",
    )
    serve.add_argument(
        "--api-keys",
        metavar="FILE",
        help="TOML file of API keys, each allowed verbs on lock-name prefixes (docs/server.md)",
    )
    serve.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow listening beyond loopback without --api-keys (anyone reaching it may lock)",
    )
    serve.add_argument(
        "--signing-key",
        metavar="FILE",
        help="sign every token with this key (fenced keygen); default: $FENCED_SIGNING_KEY",
    )
    serve.add_argument(
        "--verify-key",
        metavar="FILE",
        action="append",
        help="also accept tokens this retired key signed (an Ed25519 .pub or an HMAC key; "
        "repeatable): renewals, releases and /v1/check of grants made before a rotation "
        "(docs/signing.md, rotating); default: $FENCED_VERIFY_KEY",
    )
    _source_id_argument(serve)
    serve.add_argument(
        "--accept-unbound",
        action="store_true",
        help="with --source-id, also accept its key's unbound (v1) tokens in /v1/check and "
        "renewals: while naming a running source (docs/signing.md, migrating)",
    )
    serve.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate")
    serve.add_argument("--tls-key", metavar="FILE", help="the certificate's private key")
    serve.add_argument(
        "--max-wait",
        type=_timeout,
        default=60.0,
        help="longest one acquire request waits before answering 409 timeout (60)",
    )
    serve.add_argument(
        "--default-ttl", type=_ttl, default=10.0, help="lease seconds when a client gives none (10)"
    )
    serve.add_argument(
        "--read-timeout",
        type=_read_timeout,
        default=30.0,
        metavar="SECONDS",
        help="answer 408 and close when a request's head, or its body, takes longer to arrive (30)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=_body_limit,
        default=1 << 20,
        metavar="N",
        help="refuse a request body over N bytes with 413, before holding it (1048576)",
    )
    serve.add_argument(
        "--max-watches-per-client",
        type=_watch_count,
        default=64,
        metavar="N",
        help="watches (/-/watch streams, blocking status queries) one API key, or without keys "
        "one address, may have open; one more is refused 429 too_many_watches (64)",
    )
    serve.add_argument(
        "--max-watches",
        type=_watch_count,
        default=1024,
        metavar="N",
        help="watches open on this server; one more is refused 503 too_many_watches (1024)",
    )
    serve.add_argument(
        "--max-waiting-per-client",
        type=_waiting_count,
        default=256,
        metavar="N",
        help="acquires one API key, or without keys one address, may have waiting (long "
        "polls); one more that would wait is refused 429 too_many_waiting, one answered at "
        "once is served; 0: no bound. A worker pool sharing one key should raise it (256)",
    )
    serve.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="log lines (text)"
    )
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument(
        "--forwarded-allow-ips",
        metavar="IPS",
        help=(
            "trust X-Forwarded-For/-Proto from these proxy addresses (comma-separated, or *): "
            "the client a request names is then its owner and is bounded per client; "
            "default: trust no one (the peer's own address)"
        ),
    )
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning"],
        default="info",
        help="info (default): a line per grant, release, expiry and forced release; warning: "
        "only problems (the transition lines cost a quarter to a third of a busy server's "
        "throughput)",
    )
    return serve


def _retired_keys(args: argparse.Namespace, key: Any, signing: dict[str, Any]) -> Any:
    """connect()'s ``verify=`` of a server that still verifies retired keys' tokens: a keyring
    of the signing key's public half and the keys of --verify-key (else $FENCED_VERIFY_KEY),
    bound as the signing options are; None without retired keys. The signing key's id names
    one key only: a verify key of that id with other bytes is refused, as two verify keys of
    one id with other bytes are (the same key given twice is taken once)."""
    from .._core.signing import Keyring, public_half, same_key, verify_key

    if key is None:
        if args.verify_key:  # ($FENCED_VERIFY_KEY alone is shared configuration: no error)
            raise ConfigurationError(
                "--verify-key needs a signing key (--signing-key or $FENCED_SIGNING_KEY): it "
                "admits a retired key's tokens beside the key that signs"
            )
        return None
    given: list[tuple[str, Any]] = []
    if args.verify_key:
        for p in args.verify_key:
            key_file(p, "--verify-key", "$FENCED_VERIFY_KEY")
        given = [
            (f"--verify-key {p}", verify_key(p, "--verify-key", path_shown=True))
            for p in args.verify_key
        ]
    elif os.environ.get("FENCED_VERIFY_KEY"):
        with _named("$FENCED_VERIFY_KEY"):
            text = os.environ["FENCED_VERIFY_KEY"]
            given = [("$FENCED_VERIFY_KEY", verify_key(text, "$FENCED_VERIFY_KEY"))]
    if not given:
        return None
    current = public_half(key)
    ring = {current.kid: current}
    for where, retired in given:
        known = ring.get(retired.kid)
        if known is None:
            ring[retired.kid] = retired
        elif not same_key(known, retired):
            if known is current:
                raise ConfigurationError(
                    f"{where} has the key id {retired.kid!r} of the signing key, but is another "
                    "key: a retired key keeps its own key id (give a new key a new one)"
                )
            raise ConfigurationError(
                f"{where}: two keys with the key id {retired.kid!r} (each key has its own id)"
            )
    return Keyring(
        ring.values(),
        source_id=signing.get("source_id"),
        accept_unbound=bool(signing.get("accept_unbound")),
    )


def _watch_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of watches: {text!r}") from None
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"a number of watches is 1 to 1000000, not {value}")
    return value


def _waiting_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of acquires: {text!r}") from None
    if not 0 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(
            f"a number of waiting acquires is 0 (no bound) to 1000000, not {value}"
        )
    return value


def run(args: argparse.Namespace) -> int:
    # The imports below make ~90,000 objects (FastAPI, pydantic, uvicorn, fenced) that live as
    # long as the process: the cyclic collector ran ~110 times while they were made, for ~700
    # garbage objects, and every later full collection of a running server walked them all
    # again. Off while they are made, then frozen (kept out of every later collection): a
    # start to its first answer took 50-100 ms (7-14 %) less CPU. The few cycles the imports
    # left stay (tens of KB).
    gc.disable()
    try:
        import uvicorn  # noqa: F401  (serve() imports it: here, inside the window)

        from ..server import ServerSettings, is_loopback, load_api_keys, parse_listen, serve
    except ImportError as exc:
        raise ConfigurationError(
            f"fenced serve needs extra packages: pip install 'fenced[server]' ({exc})"
        ) from None
    finally:
        gc.freeze()
        gc.enable()
    host, port = parse_listen(args.listen)
    keys = load_api_keys(args.api_keys) if args.api_keys else None
    if keys is None and not is_loopback(host) and not args.insecure_no_auth:
        raise ConfigurationError(
            f"refusing to listen on {host} without --api-keys: anyone who reaches it could "
            "take and release locks (give --api-keys FILE, or --insecure-no-auth)"
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigurationError("--tls-cert and --tls-key go together")
    options: dict[str, object] = {"connect_timeout": args.timeout}
    # (read here, so its errors name --signing-key or $FENCED_SIGNING_KEY, never its text)
    key = _signing_key(args)
    signing = _source_options(args, key)
    retired = _retired_keys(args, key, signing)
    if retired is not None:  # (the keyring takes accept_unbound: connect() then refuses it)
        signing.pop("accept_unbound", None)
        signing["verify"] = retired
    options.update(signing)
    settings = ServerSettings(
        url=_url(args),
        options=options,
        api_keys=keys,
        max_wait=args.max_wait,
        default_ttl=args.default_ttl,
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
        max_watches_per_client=args.max_watches_per_client,
        max_watches=args.max_watches,
        max_waiting_per_client=args.max_waiting_per_client,
        loopback_hosts_only=keys is None and is_loopback(host),  # (DNS rebinding)
        same_origin_only=keys is None,  # (a page's cross-site POST)
    )
    serve(
        settings,
        host,
        port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        log_format=args.log_format,
        log_level=args.log_level,
        access_log=args.access_log,
        forwarded_allow_ips=args.forwarded_allow_ips,
    )
    return 0
