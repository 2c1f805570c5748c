"""What an outside attack found in the commands around signing: `fenced lock` handed
$FENCED_SIGNING_KEY to the command it runs (which could then sign any token), and `fenced
write` stored a forged token (a real signature, its number raised to 9000000000000000000)
even with $FENCED_VERIFY_KEY set, fencing the real holder out for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fenced._core.signing import Ed25519SigningKey, HmacKey, key_text
from tests.helpers import ROOT, write_key_file

FENCED = [sys.executable, "-m", "fenced"]
# the command's FENCED_* variables, as JSON
SHOW_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith('FENCED_') or k == 'FENCING_TOKEN'}))"
)


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FENCED_", "FENCING_"))}
    return {**base, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}


def _fenced(*args: str, env: dict[str, str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FENCED, *args], env=env, input=stdin, capture_output=True, text=True, timeout=60
    )


def test_fenced_lock_never_hands_the_sources_secrets_to_its_command(tmp_path: Path) -> None:
    """The signing key (text or path) and fenced serve's API key are dropped; $FENCED_URL
    with a password and $FENCED_VERIFY_KEY holding an HMAC key's text too. What holds no
    secret is kept (a nested `fenced check-token` or `fenced write` uses it)."""
    hmac = HmacKey("hk", b"\x11" * 32)
    public = Ed25519SigningKey("ek", b"\x07" * 32).public()
    url = f"sqlite:///{tmp_path}/l.db"
    secret_env = {
        "FENCED_SIGNING_KEY": key_text(hmac).strip(),
        "FENCED_API_KEY": "api-secret-123",
        "FENCED_URL": "postgresql://fenced:pw-secret@db.internal/locks",
        "FENCED_VERIFY_KEY": key_text(hmac).strip(),
    }
    out = _fenced("lock", "jobs", "--url", url, "--source-id", "prod", "--",
                  sys.executable, "-c", SHOW_ENV, env=_env(**secret_env))  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    for name in secret_env:  # ($FENCED_URL is --url's, which holds no secret)
        assert name not in seen or name == "FENCED_URL", (name, seen)
    assert seen["FENCED_URL"] == url
    assert seen["FENCING_TOKEN"].startswith("jobs:1.prod.hk.")  # (it did sign)
    assert seen["FENCED_LOCK"] == "jobs"

    kept_env = {
        "FENCED_SIGNING_KEY": str(write_key_file(tmp_path / "h.key", hmac)),  # a path: dropped
        "FENCED_URL": url,  # no secret in it
        "FENCED_VERIFY_KEY": key_text(public).strip(),  # a .pub line
        "FENCED_URL_FILE_X": "kept",
        "FENCED_SOURCE_ID": "prod",
    }
    out = _fenced("lock", "jobs", "--", sys.executable, "-c", SHOW_ENV, env=_env(**kept_env))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert "FENCED_SIGNING_KEY" not in seen
    for name in ("FENCED_URL", "FENCED_VERIFY_KEY", "FENCED_URL_FILE_X", "FENCED_SOURCE_ID"):
        assert seen[name] == kept_env[name], name
    assert seen["FENCING_TOKEN"].startswith("jobs:2.prod.hk.")


@pytest.fixture
def signed(tmp_path: Path) -> dict[str, str]:
    """A real Ed25519-signed token of source prod, its forged twin, the .pub, the URL."""
    key = Ed25519SigningKey("ek", b"\x07" * 32)
    write_key_file(tmp_path / "e.key", key)
    pub = tmp_path / "e.key.pub"
    pub.write_text(key_text(key.public()))
    pub.chmod(0o644)
    url = f"sqlite:///{tmp_path}/l.db"
    out = _fenced("lock", "reports", "--url", url, "--signing-key", str(tmp_path / "e.key"),
                  "--source-id", "prod", "--", "sh", "-c", 'echo "$FENCING_TOKEN"',
                  env=_env())  # fmt: skip
    assert out.returncode == 0, out.stderr
    real = out.stdout.strip()
    lock, _, rest = real.partition(":")
    forged = f"{lock}:9000000000000000000.{rest.split('.', 1)[1]}"
    (tmp_path / "out").mkdir()
    return {"real": real, "forged": forged, "pub": str(pub), "url": url,
            "target": str(tmp_path / "out" / "daily.csv")}  # fmt: skip


def _versions(target: str) -> list[str]:
    path = Path(target)
    names = (p.name for p in path.iterdir()) if path.exists() else iter(())
    return sorted(n for n in names if n != "current" and not n.startswith("."))


def test_fenced_write_refuses_a_forged_or_unsigned_token_with_a_key(
    signed: dict[str, str],
) -> None:
    """With --verify-key (or $FENCED_VERIFY_KEY) and --source-id: a forged token and an
    unsigned one exit 65, nothing written, the mark unmoved; the genuine token is stored."""
    target = signed["target"]
    by_flag = ["--verify-key", signed["pub"], "--source-id", "prod"]
    by_env = _env(FENCED_VERIFY_KEY=signed["pub"], FENCED_SOURCE_ID="prod")
    for token in (signed["forged"], signed["real"].split(".")[0]):
        for args, env in ((by_flag, _env()), ([], by_env)):
            out = _fenced("write", target, "--token", token, *args, env=env, stdin="evil\n")
            assert out.returncode == 65, (token, out.stderr)
            assert out.stderr.startswith("fenced: write refused: ") and out.stderr.count("\n") == 1
            assert _versions(target) == []
    for args, env in ((by_flag, _env()), ([], by_env)):
        out = _fenced("write", target, "--token", signed["real"], *args, env=env, stdin="real\n")
        assert out.returncode == 0, out.stderr
    assert _versions(target) == ["0000000000000000001.000000", "0000000000000000001.000001"]
    assert (Path(target) / "current").read_text() == "real\n"


def test_fenced_write_refuses_a_signed_token_when_no_key_verifies_it(
    signed: dict[str, str],
) -> None:
    """Fail closed: a signed token and no key is exit 2, one line naming --verify-key, nothing
    written; --insecure-no-verify is the explicit opt-out. An unsigned token without a key
    (no signing in use) is stored as before."""
    target = signed["target"]
    for token in (signed["forged"], signed["real"]):
        out = _fenced("write", target, "--token", token, env=_env(), stdin="x\n")
        assert out.returncode == 2, out.stderr
        assert "--verify-key" in out.stderr and out.stderr.count("\n") == 1
        assert _versions(target) == []
    out = _fenced("write", target, "--token", signed["real"], "--insecure-no-verify",
                  env=_env(), stdin="unchecked\n")  # fmt: skip
    assert out.returncode == 0, out.stderr
    out = _fenced("write", target, "--token", "reports:2", env=_env(), stdin="plain\n")
    assert out.returncode == 0, out.stderr
    assert _versions(target) == ["0000000000000000001.000000", "0000000000000000002.000000"]
    out = _fenced("write", target, "--token", signed["real"], "--insecure-no-verify",
                  "--verify-key", signed["pub"], env=_env(), stdin="x\n")  # fmt: skip
    assert out.returncode == 2 and "contradict" in out.stderr


def test_fenced_lock_and_write_end_to_end_with_a_verify_key(signed: dict[str, str]) -> None:
    """The documented job: `fenced lock --signing-key` runs `fenced write`, which verifies
    with $FENCED_VERIFY_KEY (a .pub, kept in the command's environment) and
    $FENCED_SOURCE_ID; the signing key is not in the command's environment."""
    key = str(Path(signed["pub"]).with_suffix(""))
    write = f"echo job | {sys.executable} -m fenced write {signed['target']}"
    env = _env(FENCED_VERIFY_KEY=signed["pub"], FENCED_SOURCE_ID="prod", FENCED_SIGNING_KEY=key)
    out = _fenced("lock", "reports", "--url", signed["url"], "--", "sh", "-c",
                  f'test -z "$FENCED_SIGNING_KEY" && {write}', env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (Path(signed["target"]) / "current").read_text() == "job\n"


def test_fenced_elect_never_hands_the_sources_secrets_to_its_commands(tmp_path: Path) -> None:
    """The same for `fenced elect`: neither the fence command nor the leader's command gets
    the signing key, the API key, or a URL with a password."""
    secret_env = {
        "FENCED_SIGNING_KEY": key_text(HmacKey("hk", b"\x11" * 32)).strip(),
        "FENCED_API_KEY": "api-secret-123",
        "FENCED_URL": "postgresql://fenced:pw-secret@db.internal/locks",
    }
    fence_out = tmp_path / "fence.json"
    fence = f'{sys.executable} -c "{SHOW_ENV}" > {fence_out}'
    out = _fenced("elect", "svc", "--url", f"sqlite:///{tmp_path}/l.db", "--fence-cmd", fence,
                  "--", sys.executable, "-c", SHOW_ENV, env=_env(**secret_env))  # fmt: skip
    assert out.returncode == 0, out.stderr
    for seen in (json.loads(out.stdout), json.loads(fence_out.read_text())):
        assert "FENCING_TOKEN" in seen
        for name in secret_env:
            assert name not in seen, (name, seen)


# A third outside attack (session 12, w3j-keys3): the order of check-token's checks, what a
# command of `fenced lock` needs to verify, pinning a directory's lock, exit codes.


def test_fenced_check_token_refuses_a_forged_token_before_asking_the_source(
    signed: dict[str, str],
) -> None:
    """Verified before the source is asked: with the source down, a forged or unsigned
    token is 65 (refused), not 69 ("try later"); the genuine one does ask, and gets 69."""
    down = _env(FENCED_URL="redis://127.0.0.1:1")
    args = ["--verify-key", signed["pub"], "--source-id", "prod", "--timeout", "3"]
    for token in (signed["forged"], signed["real"].split(".")[0]):
        out = _fenced("check-token", token, *args, env=down)
        assert out.returncode == 65, (token, out.stderr)
        assert "unavailable" not in out.stderr
    out = _fenced("check-token", signed["real"], *args, env=down)
    assert out.returncode == 69, out.stderr


def test_fenced_lock_gives_its_command_what_a_nested_write_needs_to_verify(
    signed: dict[str, str], tmp_path: Path
) -> None:
    """`fenced lock --signing-key ed.key --source-id prod -- ... fenced write` works with no
    variable set: the command gets $FENCED_SOURCE_ID and the key's public line in
    $FENCED_VERIFY_KEY. An HMAC key is never handed down (it signs): only the source id."""
    key = str(Path(signed["pub"]).with_suffix(""))
    nested = (
        f"echo job | {sys.executable} -m fenced write {signed['target']} && "
        f'{sys.executable} -m fenced check-token "$FENCING_TOKEN" && {sys.executable} -c "{SHOW_ENV}"'
    )
    out = _fenced("lock", "reports", "--url", signed["url"], "--signing-key", key,
                  "--source-id", "prod", "--", "sh", "-c", nested, env=_env())  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["FENCED_SOURCE_ID"] == "prod"
    assert seen["FENCED_VERIFY_KEY"] == Path(signed["pub"]).read_text().strip()
    assert (Path(signed["target"]) / "current").read_text() == "job\n"

    hmac = write_key_file(tmp_path / "h.key", HmacKey("hk", b"\x11" * 32))
    out = _fenced("lock", "jobs", "--url", signed["url"], "--signing-key", str(hmac),
                  "--source-id", "prod", "--", sys.executable, "-c", SHOW_ENV,
                  env=_env())  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["FENCED_SOURCE_ID"] == "prod" and "FENCED_VERIFY_KEY" not in seen


def test_fenced_write_lock_pins_the_directory_to_one_lock(tmp_path: Path) -> None:
    """--lock NAME: a token of another lock is refused (65) and claims nothing, so an empty
    directory goes to NAME, not to the first token's lock; the holder of NAME writes."""
    (tmp_path / "out").mkdir()
    target = str(tmp_path / "out" / "daily.csv")
    out = _fenced("write", target, "--lock", "reports", "--token", "other:5", env=_env(),
                  stdin="oops\n")  # fmt: skip
    assert out.returncode == 65 and "takes lock 'reports' (--lock)" in out.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
    out = _fenced("write", target, "--lock", "reports", "--token", "reports:1", env=_env(),
                  stdin="real\n")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / ".fenced-lock").read_text() == "reports\n"
    assert (Path(target) / "current").read_text() == "real\n"
    out = _fenced("write", target, "--lock", "other", "--token", "other:9", env=_env())
    # (the recorded lock is not shown: .fenced-lock's content is never printed, it may be a
    # link planted to a secret; the file is named instead)
    assert out.returncode == 2 and "fenced by another lock than 'other'" in out.stderr
    assert ".fenced-lock" in out.stderr and "reports" not in out.stderr
    out = _fenced("write", target, "--lock", "a" * 300, "--token", "reports:2", env=_env())
    assert out.returncode == 2 and len(out.stderr) < 600


def test_a_cut_or_altered_signature_is_65_for_write_and_check_token_alike(
    signed: dict[str, str],
) -> None:
    args = ["--verify-key", signed["pub"], "--source-id", "prod"]
    real = signed["real"]
    for bad in (real[:-1], real[:-6], real[:-1] + ("A" if real[-1] != "A" else "B")):
        out = _fenced("write", signed["target"], "--token", bad, *args, env=_env(), stdin="x")
        assert out.returncode == 65, (bad, out.stderr)
        out = _fenced("check-token", bad, *args, "--url", signed["url"], env=_env())
        assert out.returncode == 65, (bad, out.stderr)
    assert _versions(signed["target"]) == []


def test_a_huge_lock_name_is_cut_in_errors() -> None:
    """A 100 KB name is shown as its first 200 characters and its length."""
    name = "a" * 100_000
    for args in (("write", "x/y", "--token", f"{name}:1"), ("check-token", f"{name}:1")):
        out = _fenced(*args, env=_env(FENCED_URL="sqlite:///:memory:"))
        assert out.returncode in (2, 65), out.stderr
        assert len(out.stderr) < 600 and "(100000 characters)" in out.stderr, out.stderr[:300]
