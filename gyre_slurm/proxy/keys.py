"""Per-rollout API keys: the key names its rollout and carries an HMAC of it under the run token.

The proxy checks a key with nothing but the run token (from control.json), so it never asks the daemon
whether a key is valid; whether the rollout is still open is a separate question (Route / CallAck).
"""

from __future__ import annotations

import hashlib
import hmac
import re

KEY_PREFIX = "gyre-r"
_MAC_HEX = 40
_KEY_RE = re.compile(r"gyre-r(0|[1-9][0-9]{0,18})-([0-9a-f]{40})")


def _mac(run_token: str, rollout_id: int) -> str:
    # the domain string keeps these MACs apart from any other use of the run token
    msg = f"gyre-rollout-key:{rollout_id}".encode()
    return hmac.new(run_token.encode(), msg, hashlib.sha256).hexdigest()[:_MAC_HEX]


def make_key(run_token: str, rollout_id: int) -> str:
    """The API key for one rollout: gyre-r<id>-<hmac-sha256 hex[:40]>."""
    if rollout_id < 0:
        raise ValueError(f"rollout id must be >= 0, got {rollout_id}")
    return f"{KEY_PREFIX}{rollout_id}-{_mac(run_token, rollout_id)}"


def rollout_of(run_token: str, key: str | None) -> int | None:
    """The rollout a key belongs to, or None if the key is malformed or was not made with this run token."""
    if not key:
        return None
    m = _KEY_RE.fullmatch(key)
    if m is None:
        return None
    rollout_id = int(m.group(1))
    if not hmac.compare_digest(m.group(2).encode(), _mac(run_token, rollout_id).encode()):
        return None
    return rollout_id
