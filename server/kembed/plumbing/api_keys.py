"""``KEMBED_API_KEY_FILE``: the API keys a client must present, read once at start-up.

The file holds one key a line (blank lines are skipped), so a key can be rotated: add the new one,
move the clients to it, then remove the old one, restarting the pods between steps (the operator
mounts the file from a Secret). A key is printable ASCII without spaces, as an HTTP header and gRPC
metadata carry it. A client presents one as ``Authorization: Bearer KEY`` (REST's header, gRPC's
``authorization`` metadata); :meth:`ApiKeys.allows` compares it with every key in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.contract import env_name

SCHEME = "bearer"  # the Authorization header's scheme, any case (RFC 9110)
MAX_KEY_CHARS = 1024
MAX_KEYS = 64


@dataclass(frozen=True)
class ApiKeys:
    """The keys' SHA-256 digests: a presented key is hashed and compared with each, so neither the
    comparison's time nor which key matched tells anything of a key, not even its length."""

    digests: tuple[bytes, ...]

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` value (``Bearer KEY``) presents one of the keys."""
        scheme, _, key = (authorization or "").strip().partition(" ")
        presented = _digest(key.strip())
        matched = False
        for digest in self.digests:  # every one, whichever matches: no early exit
            matched |= hmac.compare_digest(presented, digest)
        return matched and scheme.lower() == SCHEME


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def read(settings: Settings) -> ApiKeys | None:
    """The keys of ``KEMBED_API_KEY_FILE``, or None when it is not set (no key is required). A file
    that cannot be read, holds no key, or a key that is not printable ASCII, is a :class:`ConfigError`:
    a server that was meant to require a key never starts without one."""
    if not settings.api_key_file:
        return None
    variable = env_name("api_key_file")
    try:
        lines = Path(settings.api_key_file).read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{variable}: cannot read {settings.api_key_file} as ASCII ({error})") from None
    keys = [line.strip() for line in lines if line.strip()]
    if not keys:
        raise ConfigError(f"{variable}: {settings.api_key_file} holds no key (one a line)")
    if len(keys) > MAX_KEYS:
        raise ConfigError(f"{variable}: {len(keys)} keys, at most {MAX_KEYS}")
    for number, key in enumerate(keys, 1):
        if len(key) > MAX_KEY_CHARS or not all("!" <= char <= "~" for char in key):
            raise ConfigError(
                f"{variable}: key {number} is not printable ASCII without spaces, or over {MAX_KEY_CHARS} characters"
            )
    return ApiKeys(tuple(_digest(key) for key in keys))
