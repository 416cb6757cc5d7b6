"""Every secret column of the schema, and what is done to all of them at once: sealing the plain
ones a process finds at start (rows written before a key was configured), resealing all of them
under the newest key (``freight secrets rotate``), and the start refusal when sealed ones exist
and no key opens them.

Each value is replaced by compare-and-set on its old value, so a rotation of a webhook secret
racing a reseal keeps the rotation's secret (the reseal of that row is skipped, and the newly
written secret is sealed already).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update

from storage.db import Database
from storage.models import DropFolder, WebhookEndpoint
from storage.secret_box import SEALED_PREFIX, SecretBox, SecretsKeyError

# (table, its id column, its secret columns)
SECRET_COLUMNS: tuple[tuple[type, Any, tuple[Any, ...]], ...] = (
    (DropFolder, DropFolder.id, (DropFolder.secret_access_key,)),
    (WebhookEndpoint, WebhookEndpoint.id, (WebhookEndpoint.secret, WebhookEndpoint.previous_secret)),
)


@dataclass(frozen=True)
class SecretCounts:
    sealed: int
    plain: int


def count_secrets(db: Database) -> SecretCounts:
    sealed = plain = 0
    with db.read() as s:
        for _table, _id, columns in SECRET_COLUMNS:
            for column in columns:
                for value in s.scalars(select(column).where(column.is_not(None), column != "")):
                    if value.startswith(SEALED_PREFIX):
                        sealed += 1
                    else:
                        plain += 1
    return SecretCounts(sealed, plain)


def start_refusal(db: Database, box: SecretBox) -> str | None:
    """Why a process must not start: sealed secrets and no key to open them (a drop folder's scan
    or a webhook's delivery would otherwise fail on every attempt, long after the start)."""
    if box.configured:
        return _unopenable(db, box)
    sealed = count_secrets(db).sealed
    if not sealed:
        return None
    return (
        f"the database holds {sealed} sealed secret(s) (drop folders' and webhooks') and no key is"
        " configured: set FREIGHT_SECRETS_KEYS or FREIGHT_SECRETS_KEYS_FILE to the key(s) that sealed them"
    )


def _unopenable(db: Database, box: SecretBox) -> str | None:
    """A refusal when a sealed secret opens with none of the keys (the key that sealed it was
    dropped before ``freight secrets rotate`` ran)."""
    lost = 0
    with db.read() as s:
        for _table, _id, columns in SECRET_COLUMNS:
            for column in columns:
                for value in s.scalars(select(column).where(column.startswith(SEALED_PREFIX))):
                    try:
                        box.open(value)
                    except SecretsKeyError:
                        lost += 1
    if not lost:
        return None
    return (
        f"{lost} sealed secret(s) open with none of the configured secrets keys: put back the key"
        " that sealed them (after the newest) and run `freight secrets rotate` before dropping it"
    )


def reseal_all(db: Database, box: SecretBox, *, plain_only: bool) -> int:
    """Seal every stored secret under the newest key (``plain_only``: only the plain ones, what a
    start does); the number of values rewritten. Nothing without a key."""
    if not box.configured:
        return 0
    rewritten = 0
    for table, id_column, columns in SECRET_COLUMNS:
        for column in columns:
            with db.read() as s:
                rows = s.execute(select(id_column, column).where(column.is_not(None), column != "")).all()
            for row_id, old in rows:
                if plain_only and old.startswith(SEALED_PREFIX):
                    continue
                new = box.reseal(old)
                with db.write() as s:
                    done = s.execute(
                        update(table)
                        .where(id_column == row_id, column == old)
                        .values({column.key: new})
                        .execution_options(synchronize_session=False)
                    )
                    rewritten += done.rowcount or 0  # type: ignore[attr-defined]
    return rewritten
