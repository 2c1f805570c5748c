"""API keys files fail closed: a key with a lock verb and no ``prefixes`` is refused (it
used to get every lock), and a secret that cannot travel in an ``Authorization`` header (not
visible ASCII) is refused at load, as the Python client refuses it at connect: one line each,
never the secret."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fenced
from fenced import ConfigurationError
from fenced.server import Verb, load_api_keys
from tests.helpers import ROOT
from tests.server.gateway import keyed_server

SECRET = "fk_tenant_secret_0123456789"


def _load(tmp_path: Path, body: str) -> fenced.server.Keys:
    path = tmp_path / "keys.toml"
    path.write_text(f'[[keys]]\nid = "billing"\nsecret = "{SECRET}"\n{body}', encoding="utf-8")
    return load_api_keys(path)


@pytest.mark.parametrize("verbs", ['["acquire"]', '["check"]', '["acquire", "metrics"]'])
def test_a_lock_key_without_prefixes_is_refused(tmp_path: Path, verbs: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        _load(tmp_path, f"verbs = {verbs}\n")
    message = str(caught.value)
    assert "(billing): no 'prefixes': write prefixes = [\"\"] for every lock" in message
    assert "\n" not in message and SECRET not in message


def test_prefixes_say_what_a_key_may_lock(tmp_path: Path) -> None:
    every = _load(tmp_path, 'verbs = ["acquire"]\nprefixes = [""]\n').keys[0]
    assert every.allows(Verb.ACQUIRE, "any/lock")
    some = _load(tmp_path, 'verbs = ["acquire"]\nprefixes = ["invoices/"]\n').keys[0]
    assert some.allows(Verb.ACQUIRE, "invoices/1") and not some.allows(Verb.ACQUIRE, "hr/1")
    none = _load(tmp_path, 'verbs = ["acquire", "check"]\nprefixes = []\n').keys[0]
    assert not none.allows(Verb.ACQUIRE, "invoices/1") and not none.sees("invoices/1")
    # admin (every lock) and metrics (no lock) need no prefixes
    assert _load(tmp_path, 'verbs = ["admin"]\n').keys[0].allows(Verb.ACQUIRE, "x")
    metrics = _load(tmp_path, 'verbs = ["metrics"]\n').keys[0]
    assert metrics.allows(Verb.METRICS) and not metrics.sees("x")


def test_fenced_serve_refuses_a_lock_key_without_prefixes(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nid = "ci"\nsecret = "{SECRET}"\nverbs = ["check"]\n')
    out = subprocess.run(
        [sys.executable, "-m", "fenced", "serve", "--url", f"sqlite:///{tmp_path}/l.db",
         "--listen", "127.0.0.1:0", "--api-keys", str(keys)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"fenced: API keys file {keys}, key 1 (ci): no 'prefixes': write prefixes = [\"\"] "
        "for every lock, or the lock-name prefixes it may use"
    ]


NOT_HEADER = [
    "fk_ключ_секрет_0123456789",
    "fk_tenant\tsecret_0123456789",
    " " + SECRET,
    "é" * 20,
    "fk_" + "x" * 4094,  # (4097 characters: the clients of every language refuse it too)
]


@pytest.mark.parametrize("secret", NOT_HEADER)
def test_a_secret_no_header_can_carry_is_refused_at_load(tmp_path: Path, secret: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        f'[[keys]]\nid = "billing"\nsecret = "{secret}"\nprefixes = [""]\nverbs = ["acquire"]\n'.replace(
            "\t", "\\t"
        ),
        encoding="utf-8",
    )
    with pytest.raises(ConfigurationError) as caught:
        load_api_keys(path)
    message = str(caught.value)
    assert "(billing): 'secret' must be visible ASCII" in message
    assert secret.strip() not in message and "\n" not in message


@pytest.mark.parametrize("secret", NOT_HEADER)
def test_the_python_client_refuses_such_a_key_in_one_line(
    secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FENCED_API_KEY", raising=False)
    for where, kwargs in (("api_key=", {"api_key": secret}), ("$FENCED_API_KEY", {})):
        if not kwargs:
            monkeypatch.setenv("FENCED_API_KEY", secret)
        with pytest.raises(ConfigurationError) as caught:
            fenced.connect("http://127.0.0.1:9", connect_timeout=5, **kwargs)
        message = str(caught.value)
        assert message.startswith(f"{where}: an API key is visible ASCII"), message
        assert secret.strip() not in message and "\n" not in message


def test_a_visible_ascii_secret_with_blanks_inside_authenticates(tmp_path: Path) -> None:
    """The rightful side: what the rule lets through does reach the server as written."""
    secret = "fk_two words!#$%&()*+,-./:;<=>?@[]^_`{|}~"
    with keyed_server(
        f"sqlite:///{tmp_path}/l.db",
        tmp_path / "keys.toml",
        [{"id": "t", "secret": secret, "plain": True, "prefixes": [""], "verbs": ["acquire"]}],
    ) as server:
        with fenced.connect(server.url, api_key=secret) as locks:
            with locks.lock("jobs", ttl=5) as lease:
                assert lease.token.value >= 1
