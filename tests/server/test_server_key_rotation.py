"""Rotating ``fenced serve``'s signing key without ending its leases: restarted with a new
``--signing-key`` and the old key as ``--verify-key`` (or ``$FENCED_VERIFY_KEY``), the server
renews and releases the grants the old key signed, signs new grants with the new key, and its
token check accepts both; a forged token under the old key id is refused, and without the
old key the renewal is refused as before. Resources whose ring holds both keys accept the
holder's writes throughout and still refuse a stale token. Real ``fenced serve`` processes
(with API keys) on SQLite; real guards (a high-water file)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import fenced
from fenced._core.signing import b64, key_text, load_key
from fenced.guards.files import HighWaterFile
from fenced.testing.servers import FencedServer
from tests.helpers import forged
from tests.server.test_server_trust import OPS, A, _keys_file


def _keygen(tmp_path: Path, kind: str, kid: str, name: str | None = None) -> Path:
    path = tmp_path / f"{name or kid}.key"
    subprocess.run(
        [sys.executable, "-m", "fenced", "keygen", kind, kid, str(path)],
        check=True,
        capture_output=True,
    )
    return path


def _public(key: Path) -> Path:
    """What verifies ``key``'s signatures: its .pub (Ed25519), or the HMAC secret itself."""
    pub = Path(f"{key}.pub")
    return pub if pub.exists() else key


def _kid(token: fenced.FencingToken) -> str:
    assert token.signature is not None, token
    return str(token.signature[0])


def _post(server: FencedServer, path: str, body: dict[str, object]) -> httpx.Response:
    headers = {"authorization": f"Bearer {A}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def _verify_key_uses(server: FencedServer, kid: str) -> float:
    text = httpx.get(
        f"{server.url}/metrics", headers={"authorization": f"Bearer {OPS}"}, timeout=30
    ).text
    found = re.search(rf'^fenced_verify_key_tokens_total{{kid="{kid}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(("kind", "given"), [("ed25519", "flag"), ("hmac", "env")])
def test_a_rotation_with_the_old_key_verify_only_keeps_every_lease(
    tmp_path: Path, kind: str, given: str
) -> None:
    old, new = _keygen(tmp_path, kind, "k1"), _keygen(tmp_path, kind, "k2")
    mark = HighWaterFile(
        tmp_path / "mark",
        lock="l",
        verify=fenced.load_keys([_public(old), _public(new)], source_id="prod"),
    )
    keys = ["--api-keys", str(_keys_file(tmp_path))]
    signing = ["--source-id", "prod", "--signing-key"]
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with (
        FencedServer(url, args=[*keys, *signing, str(old)]) as server,
        fenced.connect(server.url, api_key=A) as locks,
    ):
        first = locks.lock("l", ttl=30, auto_renew=False)
        stale = first.acquire(timeout=10)
        assert first.release() is True
        lease = locks.lock("l", ttl=30, auto_renew=False)
        held = lease.acquire(timeout=10)
        other = locks.lock("other", ttl=30, auto_renew=False)  # (kept to the rotation's end)
        other.acquire(timeout=10)
        assert _kid(stale) == _kid(held) == "k1" and held.value > stale.value
        assert mark.check_and_advance(token=held) == held  # the holder's write, before

        # -- serve restarted: signs with the new key, verifies the old one too ------------
        if given == "flag":
            server.args = [*keys, *signing, str(new), "--verify-key", str(_public(old))]
        else:
            server.args = [*keys, *signing, str(new)]
            server._env = {"FENCED_VERIFY_KEY": key_text(load_key(_public(old)))}
        server.restart()
        assert lease.renew() > 0 and not lease.lost.is_set()
        assert lease.token == held  # (the same token: the one its writes already carry)
        assert _verify_key_uses(server, "k1") == 1
        assert mark.check_and_advance(token=lease.token) == held  # the holder's write, after
        with pytest.raises(fenced.StaleTokenError):
            mark.check_and_advance(token=stale)  # well signed by the old key, and stale
        # the token check takes both keys' tokens, and refuses a forged one under the old id
        assert locks.check(held).current
        assert _post(server, "/v1/check", {"token": str(held)}).json()["verdict"] == "current"
        refused = _post(server, "/v1/check", {"token": forged(str(held))})
        assert refused.status_code == 400, refused.text
        for body in (
            {"token": forged(str(held)), "request_id": lease.request_id},
            {"token": forged(str(held)), "request_id": lease.request_id, "ttl": 30},
        ):
            route = "release" if "ttl" not in body else "renew"
            answer = _post(server, f"/v1/locks/l/-/{route}", body)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"] == "invalid_token", answer.text
        assert lease.release() is True  # (the forged ones changed nothing)

        # a new grant is signed by the new key; the ring of both accepts it, the old is stale
        later = locks.lock("l", ttl=30, auto_renew=False)
        newer = later.acquire(timeout=10)
        assert _kid(newer) == "k2" and newer.value > held.value
        assert mark.check_and_advance(token=newer) == newer
        with pytest.raises(fenced.StaleTokenError):
            mark.check_and_advance(token=held)
        assert locks.check(newer).current
        assert later.renew() > 0

        # -- the rotation's end: the old key dropped. Its last grant is refused at renewal
        server.args, server._env = [*keys, *signing, str(new)], None
        server.restart()
        assert later.renew() > 0 and later.release() is True
        with pytest.raises(fenced.LeaseLostError, match="invalid_token"):
            other.renew()


def test_without_the_old_key_a_rotation_still_ends_the_lease_at_its_renewal(
    tmp_path: Path,
) -> None:
    """The rightful contrast: a verify key of another key id does not admit the old key's
    tokens (neither does no verify key at all: test_server_restart_signing)."""
    old, new = _keygen(tmp_path, "ed25519", "k1"), _keygen(tmp_path, "ed25519", "k2")
    third = _keygen(tmp_path, "ed25519", "k3")
    keys = ["--api-keys", str(_keys_file(tmp_path))]
    signing = ["--source-id", "prod", "--signing-key"]
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with (
        FencedServer(url, args=[*keys, *signing, str(old)]) as server,
        fenced.connect(server.url, api_key=A) as locks,
    ):
        lease = locks.lock("l", ttl=30, auto_renew=False)
        held = lease.acquire(timeout=10)
        server.args = [*keys, *signing, str(new), "--verify-key", f"{third}.pub"]
        server.restart()
        with pytest.raises(fenced.LeaseLostError, match="invalid_token"):
            lease.renew()
        assert _post(server, "/v1/check", {"token": str(held)}).status_code == 400


def test_gateways_mid_rotation_renew_each_others_grants(tmp_path: Path) -> None:
    """Several gateways behind one address are restarted one at a time: while one already
    signs with the new key and another still with the old, a holder's renewal may reach
    either. Each verifying the other's key (the old one signing with --verify-key new.pub
    first), both renew and release both keys' grants."""
    old, new = _keygen(tmp_path, "ed25519", "k1"), _keygen(tmp_path, "ed25519", "k2")
    keys = ["--api-keys", str(_keys_file(tmp_path))]
    signing = ["--source-id", "prod", "--signing-key"]
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with (
        FencedServer(url, args=[*keys, *signing, str(old), "--verify-key", f"{new}.pub"]) as g1,
        FencedServer(url, args=[*keys, *signing, str(new), "--verify-key", f"{old}.pub"]) as g2,
    ):
        for maker, other, kid in ((g1, g2, "k1"), (g2, g1, "k2")):
            lock = f"by-{kid}"
            grant = _post(maker, f"/v1/locks/{lock}/-/acquire", {"ttl": 30}).json()
            signed, rid = grant["signed"], grant["request_id"]
            assert _kid(fenced.FencingToken.parse(signed)) == kid
            renewed = _post(
                other, f"/v1/locks/{lock}/-/renew", {"token": signed, "request_id": rid}
            )
            assert renewed.status_code == 200, renewed.text
            assert _verify_key_uses(other, kid) == 1 and _verify_key_uses(maker, kid) == 0
            released = _post(
                other, f"/v1/locks/{lock}/-/release", {"token": signed, "request_id": rid}
            )
            assert released.json() == {"released": True}, released.text


def _serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fenced",
            "serve",
            "--url",
            f"sqlite:///{tmp_path / 'l.db'}",
            "--listen",
            "127.0.0.1:0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_plain_env(), **(env or {})},
    )
    return out.returncode, out.stderr


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}


def test_a_bad_verify_key_is_one_line_at_start_and_no_secret_shown(tmp_path: Path) -> None:
    current = _keygen(tmp_path, "hmac", "k1")
    other = _keygen(tmp_path, "hmac", "k1", name="same-id")  # (the same key id, other bytes)
    secrets = [load_key(p)._material() for p in (current, other)]  # type: ignore[union-attr]
    ed = _keygen(tmp_path, "ed25519", "e1")
    (tmp_path / "odd.key").write_text("fenced-key 1 rsa k9 AAAA\n")
    missing = tmp_path / "missing.key"
    sign = ["--signing-key", str(current), "--source-id", "prod"]
    cases = [
        ([*sign, "--verify-key", str(missing)], f"cannot read key file {missing}"),
        ([*sign, "--verify-key", str(tmp_path / "odd.key")], "is not a fenced key file"),
        ([*sign, "--verify-key", str(other)], "the key id 'k1' of the signing key"),
        ([*sign, "--verify-key", str(ed)], "is an Ed25519 private key"),
        (
            [
                *sign,
                "--verify-key",
                f"{ed}.pub",
                "--verify-key",
                str(_keygen(tmp_path, "hmac", "e1", name="hmac-e1")),
            ],
            "two keys with the key id 'e1'",
        ),
        (["--verify-key", f"{ed}.pub"], "--verify-key needs a signing key"),
    ]
    for args, message in cases:
        code, err = _serve(tmp_path, *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, code, err)
        assert not any(b64(s) in err for s in secrets), err
    # the environment's form names the variable, never its text
    code, err = _serve(tmp_path, *sign, env={"FENCED_VERIFY_KEY": key_text(load_key(other))})
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "$FENCED_VERIFY_KEY" in lines[0], err
    assert not any(b64(s) in err for s in secrets), err
