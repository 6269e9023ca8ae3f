"""Secrets out of whatever shows the config: credentials in URLs (redis://user:pass@host -> redis://***@host) and
fields that hold a secret by name (a password, a MAC key). The dashboard, `diagnose` and trace files show the
config; none of them needs a credential."""
from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
# scheme://userinfo@ : the userinfo part (user, user:password, or a bare token) is what gets hidden
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")
_SECRET_NAMES = ("secret", "password", "passwd", "api_key", "token")  # a field named so, or ending in _<name>


def redact_url(text: str) -> str:
    """`text` with the credentials of every URL in it replaced by ***."""
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)


def is_secret_name(name: str) -> bool:
    name = name.lower()
    return any(name == s or name.endswith("_" + s) for s in _SECRET_NAMES)


def redact_secrets(value: Any) -> Any:
    """A copy of a JSON-like value with secret-named fields replaced and URL credentials hidden."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_name(str(k)) and v is not None else redact_secrets(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value
