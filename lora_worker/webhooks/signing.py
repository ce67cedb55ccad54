"""Signing by the Standard Webhooks spec (standardwebhooks.com), with the standard library alone.

Each request carries `webhook-id` (the event's stable id), `webhook-timestamp` (Unix seconds of this attempt)
and `webhook-signature`: `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, one per active secret,
space-separated, so that a receiver holding either secret verifies it while the secrets rotate.

A secret is written as the spec prints it, `whsec_<base64 key>`, one per line of the secret file (at most two:
the new one and the one it replaces). The file is the systemd credential `$CREDENTIALS_DIRECTORY/webhook_secret`
(LoadCredential=), else the `webhook_secret_file` setting; it is never a setting's value, an environment
variable, or a log line. A running sender re-reads it whenever it changes (`Keyring`): a rotation needs no
restart where the sender reads the file itself (systemd hands its unit a copy made at the unit's start).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.errors import ConfigError

CREDENTIAL = "webhook_secret"
PREFIX = "whsec_"
MIN_KEY_BYTES = 24  # the spec's lower bound
MAX_SECRETS = 2  # the current one and the one being rotated out

log = logging.getLogger(__name__)


def secret_file(settings: Settings, environ: Mapping[str, str]) -> Path | None:
    credentials = environ.get("CREDENTIALS_DIRECTORY")
    if credentials and (Path(credentials) / CREDENTIAL).is_file():
        return Path(credentials) / CREDENTIAL
    return settings.webhook_secret_file


def load_secrets(settings: Settings, environ: Mapping[str, str] | None = None) -> list[bytes]:
    """The active keys, newest first; ConfigError for a target without a usable secret, since an unsigned
    request would be one a receiver cannot tell from a forgery."""
    path = secret_file(settings, os.environ if environ is None else environ)
    if path is None:
        raise ConfigError("webhook_url is set but no webhook secret is: LoadCredential=webhook_secret:… or "
                          "webhook_secret_file (make one with: python3 -c \"import base64, secrets; "
                          "print('whsec_' + base64.b64encode(secrets.token_bytes(32)).decode())\")")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"the webhook secret {path} is not a regular file")
            if st.st_mode & stat.S_IROTH:
                raise ConfigError(f"the webhook secret {path} is readable by every user (mode "
                                  f"{stat.S_IMODE(st.st_mode):04o}); chmod o-rwx it")
            text = fh.read(4096).decode("ascii", "replace")
    except OSError as exc:
        raise ConfigError(f"cannot read the webhook secret {path}: {exc.strerror or exc}") from exc
    return parse_secrets(text, path)


def parse_secrets(text: str, where: Path | str = "the webhook secret") -> list[bytes]:
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not 1 <= len(lines) <= MAX_SECRETS:
        raise ConfigError(f"{where}: {len(lines)} secrets; one, or two while rotating, one per line")
    keys = []
    for number, line in enumerate(lines, 1):
        try:
            key = base64.b64decode(line.removeprefix(PREFIX), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ConfigError(f"{where}: secret {number} is not whsec_<base64>") from exc
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(f"{where}: secret {number} is {len(key)} bytes; at least {MIN_KEY_BYTES}")
        keys.append(key)
    return keys


def signature(key: bytes, event_id: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(keys: Sequence[bytes], event_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {"webhook-id": event_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(signature(k, event_id, timestamp, body) for k in keys)}


class Keyring:
    """The keys that sign, re-read from the secret file whenever its identity changes (device, inode, size,
    mtime, ctime: an edit in place, a rename over it, a chmod), checked at each use for one stat. A file that
    becomes unreadable or invalid keeps the last good keys, logged once per change of the file: a half-written
    edit never stops the signing, and the next change is read again. Safe to use from several threads."""

    def __init__(self, keys: Sequence[bytes], settings: Settings | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        """`keys` as first read; with `settings`, kept up to date with their secret file."""
        self.settings, self.environ = settings, os.environ if environ is None else environ
        self._keys, self._lock = list(keys), threading.Lock()
        self._identity = self._stat()

    @classmethod
    def watching(cls, settings: Settings, environ: Mapping[str, str] | None = None) -> Keyring:
        """The keys of the secret file, kept up to date; ConfigError unless it loads now (as `load_secrets`)."""
        ring = cls([], settings, environ)
        ring._keys = load_secrets(settings, ring.environ)
        return ring

    def keys(self) -> list[bytes]:
        if self.settings is None:
            return list(self._keys)
        with self._lock:
            identity = self._stat()
            if identity != self._identity:
                self._identity = identity  # taken before the read: a change during it is read again next time
                self._reload()
            return list(self._keys)

    def _reload(self) -> None:
        assert self.settings is not None
        try:
            keys = load_secrets(self.settings, self.environ)
        except ConfigError as exc:
            log.error("webhooks: %s; still signing with the %d secret(s) read before", exc, len(self._keys))
            return
        if keys != self._keys:
            log.info("webhooks: the webhook secret changed: %d secret(s) sign from now on", len(keys))
        self._keys = keys

    def _stat(self) -> tuple[int, ...] | None:
        if self.settings is None:
            return None
        path = secret_file(self.settings, self.environ)
        try:
            st = os.stat(path, follow_symlinks=False) if path is not None else None
        except OSError:
            return None
        return None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                        st.st_mode)
