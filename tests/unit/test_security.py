"""The pure parts of gradwire.security: where the token comes from, how it is compared, run ownership."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gradwire.security import (
    AUTH_HEADER,
    RUN_KEY_HEADER,
    TOKEN_ENV,
    ClientSecurity,
    bearer,
    is_loopback,
    resolve_token,
    run_key,
    run_owner,
    token_matches,
)

TOKEN = "0123456789abcdef0123"


def test_the_token_comes_from_the_flag_then_the_file_then_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-the-file-0123456789\nsecond line ignored\n")
    env = {TOKEN_ENV: "from-the-env-0123456789"}
    assert resolve_token("from-the-flag-0123456789", None, env) == "from-the-flag-0123456789"
    assert resolve_token(None, str(path), env) == "from-the-file-0123456789"
    assert resolve_token(None, None, env) == "from-the-env-0123456789"
    assert resolve_token(None, None, {}) is None


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("", "empty"),
        ("has space", "printable ASCII"),
        ("tab\there", "printable ASCII"),
        ("é" * 20, "printable ASCII"),
        ("x" * 5000, "longer than"),
    ],
)
def test_unusable_tokens_name_their_source(token: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"--token: .*{message}"):
        resolve_token(token)


def test_token_file_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="--token-file .*empty: the token is empty"):
        resolve_token(None, str(empty))
    with pytest.raises(ValueError, match="cannot read it"):
        resolve_token(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        resolve_token(TOKEN, str(empty))


def test_a_short_token_works_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gradwire.security"):
        assert resolve_token("short") == "short"
    assert "only 5 characters" in caplog.text


def test_token_comparison_and_the_bearer_header() -> None:
    assert token_matches(TOKEN, TOKEN)
    assert not token_matches(TOKEN + "x", TOKEN) and not token_matches("", TOKEN) and not token_matches(None, TOKEN)
    metadata = ClientSecurity(token=TOKEN).metadata()
    assert bearer(metadata) == TOKEN and dict(metadata)[AUTH_HEADER] == f"Bearer {TOKEN}"
    assert bearer([(AUTH_HEADER, "Basic abc")]) is None and bearer(None) is None
    assert AUTH_HEADER not in dict(ClientSecurity().metadata())


def test_run_keys_and_owners() -> None:
    security = ClientSecurity()
    assert run_key(security.metadata()) == security.run_key
    assert run_key([(RUN_KEY_HEADER, "not hex")]) == b"" and run_key([]) == b""
    a, b = bytes(32), bytes([1] * 32)
    assert run_owner(b"", a) == run_owner(b"", a)
    assert len({run_owner(b"", a), run_owner(b"", b), run_owner(b"CERT", a), run_owner(b"CER", b"T" + a)}) == 4
    with pytest.raises(ValueError, match="16 bytes"):
        ClientSecurity(run_key=b"short")


def test_any_tls_file_turns_tls_on() -> None:
    assert not ClientSecurity().tls
    assert (
        ClientSecurity(tls_ca="ca.pem").tls
        and ClientSecurity(tls_server_name="gpu1").tls
        and ClientSecurity(tls=True).tls
    )
    with pytest.raises(ValueError, match="go together"):
        ClientSecurity(tls_key="k.pem")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("[::1]", True),
        ("localhost", True),
        ("[::]", False),
        ("0.0.0.0", False),
        ("", False),
        ("gpu1.example.org", False),
        ("10.0.0.5", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
