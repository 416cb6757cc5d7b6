"""storage/secret_box.py: secrets sealed with Fernet under the configured keys, the newest
sealing and every one opening (a rotation's old key kept for reading), plain values of rows
written before a key passed through, and keys refused in words that never show a key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from storage.secret_box import SEALED_PREFIX, SecretBox, SecretsKeyError, configured_keys, is_sealed, new_key
from storage.settings import Settings, SettingsError

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY"


def test_a_sealed_secret_opens_and_shows_nothing_of_the_secret():
    box = SecretBox([new_key()])
    sealed = box.seal(SECRET)
    assert sealed is not None and sealed.startswith(SEALED_PREFIX) and is_sealed(sealed)
    assert SECRET not in sealed and box.seal(SECRET) != sealed  # a fresh IV each time
    assert box.open(sealed) == SECRET
    assert box.seal(None) is None and box.open(None) is None


def test_without_a_key_secrets_stay_plain_and_a_sealed_one_cannot_be_opened():
    plain = SecretBox()
    assert not plain.configured and plain.seal(SECRET) == SECRET and plain.open(SECRET) == SECRET
    sealed = SecretBox([new_key()]).seal(SECRET)
    with pytest.raises(SecretsKeyError, match="no key is configured"):
        plain.open(sealed)


def test_rotation_the_old_key_opens_until_reseal_then_the_new_key_alone_does():
    old, new = new_key(), new_key()
    stored = SecretBox([old]).seal(SECRET)
    rotating = SecretBox([new, old])  # the new key first: it seals, the old one still opens
    assert rotating.open(stored) == SECRET
    resealed = rotating.reseal(stored)
    assert resealed != stored and SecretBox([new]).open(resealed) == SECRET
    with pytest.raises(SecretsKeyError, match="not in FREIGHT_SECRETS_KEYS"):
        SecretBox([new]).open(stored)  # the old key dropped before the reseal: refused in words
    assert rotating.reseal(SECRET) is not None and SecretBox([new]).open(rotating.reseal(SECRET)) == SECRET


def test_a_malformed_key_is_refused_without_showing_it():
    with pytest.raises(SecretsKeyError, match="key 2 of 2 is not a Fernet key") as refused:
        SecretBox([new_key(), "not-a-key-but-long-enough-to-pass"])
    assert "not-a-key" not in str(refused.value)


def test_keys_come_from_the_environment_or_a_file_outside_the_data_folder(tmp_path: Path):
    k1, k2 = new_key(), new_key()
    data = tmp_path / "data"
    from_env = Settings.from_env({"FREIGHT_SECRETS_KEYS": f"{k1}, {k2}"}, data_dir=data)
    assert configured_keys(from_env) == [k1, k2]
    key_file = tmp_path / "keys"
    key_file.write_text(f"# newest first\n{k2}\n\n{k1}\n")
    assert configured_keys(Settings.from_env({}, data_dir=data, secrets_keys_file=str(key_file))) == [k2, k1]
    inside = data / "keys"
    data.mkdir()
    inside.write_text(k1)
    with pytest.raises(SecretsKeyError, match="lies in the data folder"):
        configured_keys(Settings.from_env({}, data_dir=data, secrets_keys_file=str(inside)))
    with pytest.raises(SecretsKeyError, match="not both"):
        configured_keys(replace(from_env, secrets_keys_file=str(key_file)))
    with pytest.raises(SecretsKeyError, match="cannot be read"):
        configured_keys(Settings.from_env({}, data_dir=data, secrets_keys_file=str(tmp_path / "none")))
    with pytest.raises(SettingsError, match="FREIGHT_SECRETS_KEYS holds a placeholder"):
        Settings.from_env({"FREIGHT_SECRETS_KEYS": "CHANGE-ME"}, data_dir=data)
