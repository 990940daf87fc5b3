"""API keys: sources, Bearer parsing, constant-time matching, and no key ever in a repr or message."""

from __future__ import annotations

import pytest

from kvtide.config import parse_config
from kvtide.deployments.frontend.auth import ApiKeys, AuthConfigError, authorize, bearer_token, keys_from_text, load_api_keys

KEY = "sk-kvtide-0123456789abcdef"


def test_no_keys_means_auth_off():
    """Without keys every request passes, header or not."""
    keys = ApiKeys([])
    assert not keys.enabled
    assert authorize(keys, None).ok and authorize(keys, "Bearer anything").ok


@pytest.mark.parametrize(("header", "ok"), [
    (f"Bearer {KEY}", True),
    (f"bearer {KEY}", True),  # the scheme is case-insensitive (RFC 7235)
    (f"  Bearer   {KEY}  ", True),
    (None, False),
    ("", False),
    ("Bearer", False),
    ("Bearer ", False),
    (f"Basic {KEY}", False),
    (KEY, False),
    (f"Bearer {KEY}x", False),
    (f"Bearer {KEY[:-1]}", False),
    ("Bearer other-key", False),
])
def test_only_the_right_bearer_key_passes(header, ok):
    """Missing, malformed, wrong and near-miss keys are refused; the exact key passes."""
    assert authorize(ApiKeys([KEY, "second-key"]), header).ok is ok


def test_refusals_never_echo_the_presented_key():
    """The 401 message says what is wrong without repeating what was sent."""
    decision = authorize(ApiKeys([KEY]), "Bearer wrong-secret-value")
    assert not decision.ok and "wrong-secret-value" not in decision.message
    assert "provide" in authorize(ApiKeys([KEY]), None).message


def test_repr_shows_a_count_never_the_keys():
    """Keys are kept only as digests and a repr (a log line) shows their number alone."""
    keys = ApiKeys([KEY, "second-key"])
    assert repr(keys) == "ApiKeys(2 keys)"
    assert KEY not in repr(vars(keys)) and len(keys) == 2


def test_bearer_token_parsing():
    """Only the Bearer scheme yields a token."""
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("Token abc") is None and bearer_token(None) is None


def test_keys_from_env_and_file_are_merged(tmp_path):
    """The env var (comma-separated) and the file (one per line, # comments) both contribute."""
    path = tmp_path / "keys"
    path.write_text("# rotated 2026-11\nfile-key-1\n\n  file-key-2  \n")
    keys = load_api_keys("KVTIDE_API_KEYS", str(path), False, {"KVTIDE_API_KEYS": " env-1 , ,env-2"})
    assert len(keys) == 4
    for key in ("env-1", "env-2", "file-key-1", "file-key-2"):
        assert authorize(keys, f"Bearer {key}").ok
    assert keys_from_text("# only a comment\n") == []


def test_unset_sources_give_no_keys():
    """An absent or empty env var and no file leave auth off."""
    assert not load_api_keys("KVTIDE_API_KEYS", None, False, {}).enabled
    assert not load_api_keys("KVTIDE_API_KEYS", None, False, {"KVTIDE_API_KEYS": ""}).enabled
    assert not load_api_keys(None, None, False, {"KVTIDE_API_KEYS": KEY}).enabled


def test_required_keys_fail_closed_naming_the_fix():
    """require_keys with no key found refuses to start instead of serving unauthenticated."""
    with pytest.raises(AuthConfigError, match="require_keys=true.*apiKeys.existingSecret"):
        load_api_keys("KVTIDE_API_KEYS", None, True, {})


def test_unreadable_key_file_names_the_field(tmp_path):
    """A key file that cannot be read fails naming frontend.auth.api_keys_file, not silently open."""
    with pytest.raises(AuthConfigError, match="frontend.auth.api_keys_file"):
        load_api_keys(None, str(tmp_path / "missing"), False, {})


def test_auth_config_defaults_read_the_standard_env_var():
    """By default keys come from KVTIDE_API_KEYS, no file, and a missing key does not block start."""
    auth = parse_config({}).frontend.auth
    assert (auth.api_keys_env, auth.api_keys_file, auth.require_keys) == ("KVTIDE_API_KEYS", None, False)
