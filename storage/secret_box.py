"""Secrets Freight must keep and use again (drop folders' S3 secret keys, webhook signing secrets),
sealed at rest with Fernet under keys that never lie in the database or the data folder.

A stored value is either ``fernet:<token>`` (sealed) or, for rows written before a key was
configured, the plain secret. The keys come from FREIGHT_SECRETS_KEYS (comma-separated) or
FREIGHT_SECRETS_KEYS_FILE (one a line), newest first: the newest seals, every one opens
(``MultiFernet``), so a rotation adds a key in front, runs ``freight secrets rotate`` to reseal
every stored secret with it, and only then drops the old key. Without any key, secrets are kept
as they were (plain) and a sealed one cannot be opened: a process refuses to start then
(``storage.stored_secrets.start_refusal``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from storage.settings import Settings

SEALED_PREFIX = "fernet:"
# a key file is a few keys; anything bigger is not one
_MAX_KEY_FILE_BYTES = 64 * 1024


class SecretsKeyError(ValueError):
    """The secrets keys are unusable (malformed, in the data folder), or a stored secret cannot be
    opened with them. The message names the setting, never a key or a secret."""


def is_sealed(stored: str | None) -> bool:
    return bool(stored) and stored.startswith(SEALED_PREFIX)  # type: ignore[union-attr]


def new_key() -> str:
    """A new Fernet key (32 random bytes, url-safe base64), for FREIGHT_SECRETS_KEYS."""
    return Fernet.generate_key().decode()


class SecretBox:
    """Seals and opens stored secrets with the configured keys (none: seals nothing)."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        fernets = []
        for position, key in enumerate(keys, 1):
            try:
                fernets.append(Fernet(key.strip().encode()))
            except (ValueError, TypeError):
                raise SecretsKeyError(
                    f"secrets key {position} of {len(keys)} is not a Fernet key (32 bytes in url-safe"
                    " base64; make one with `freight secrets new-key`)"
                ) from None
        self._fernet = MultiFernet(fernets) if fernets else None
        self.key_count = len(fernets)

    @property
    def configured(self) -> bool:
        return self._fernet is not None

    def seal(self, plain: str | None) -> str | None:
        """What to store for a secret: sealed under the newest key, or as given without a key."""
        if not plain or self._fernet is None:
            return plain
        return SEALED_PREFIX + self._fernet.encrypt(plain.encode()).decode()

    def open(self, stored: str | None) -> str | None:
        """The secret a stored value holds (a plain one as it is)."""
        if not is_sealed(stored):
            return stored
        if self._fernet is None:
            raise SecretsKeyError(
                "a stored secret is sealed and no key is configured: set FREIGHT_SECRETS_KEYS or"
                " FREIGHT_SECRETS_KEYS_FILE"
            )
        try:
            return self._fernet.decrypt(stored[len(SEALED_PREFIX) :].encode()).decode()  # type: ignore[index]
        except InvalidToken:
            raise SecretsKeyError(
                "a stored secret was sealed with a key that is not in FREIGHT_SECRETS_KEYS"
                " (FREIGHT_SECRETS_KEYS_FILE): put the old key back after the new one"
            ) from None

    def reseal(self, stored: str | None) -> str | None:
        """The stored value sealed under the newest key (a plain one sealed, a sealed one opened
        with whichever key sealed it and sealed again)."""
        if not stored or self._fernet is None:
            return stored
        if not is_sealed(stored):
            return self.seal(stored)
        try:
            token = self._fernet.rotate(stored[len(SEALED_PREFIX) :].encode())
        except InvalidToken:
            self.open(stored)  # raises the refusal in words
            raise
        return SEALED_PREFIX + token.decode()


def configured_keys(settings: Settings) -> list[str]:
    """The keys of FREIGHT_SECRETS_KEYS or of the file FREIGHT_SECRETS_KEYS_FILE names, newest
    first. The file must lie outside the data folder (a copy of the data folder, a backup of it,
    must not carry the key that opens the secrets in its database) and be a few lines."""
    if settings.secrets_keys and settings.secrets_keys_file:
        raise SecretsKeyError("set FREIGHT_SECRETS_KEYS or FREIGHT_SECRETS_KEYS_FILE, not both")
    if settings.secrets_keys:
        return [k.strip() for k in settings.secrets_keys.split(",") if k.strip()]
    if not settings.secrets_keys_file:
        return []
    path = Path(settings.secrets_keys_file).absolute()
    data_dir = Path(settings.data_dir).absolute()
    if path.resolve().is_relative_to(data_dir.resolve()):
        raise SecretsKeyError(
            f"FREIGHT_SECRETS_KEYS_FILE {path} lies in the data folder {data_dir}: keep the key"
            " where a copy of the data folder does not reach"
        )
    try:
        if path.stat().st_size > _MAX_KEY_FILE_BYTES:
            raise SecretsKeyError(f"FREIGHT_SECRETS_KEYS_FILE {path} is over {_MAX_KEY_FILE_BYTES:,} bytes")
        text = path.read_text()
    except OSError as exc:
        raise SecretsKeyError(f"FREIGHT_SECRETS_KEYS_FILE {path} cannot be read: {exc.strerror}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise SecretsKeyError(f"FREIGHT_SECRETS_KEYS_FILE {path} holds no key")
    return keys


def secret_box(settings: Settings) -> SecretBox:
    return SecretBox(configured_keys(settings))
