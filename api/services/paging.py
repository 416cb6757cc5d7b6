"""Cursor pagination as OpenAI does it: newest first, ``after`` an id, ``limit`` rows, ``has_more``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from storage.errors import ServiceError


@dataclass(frozen=True)
class Page:
    rows: list[Any]
    has_more: bool


def parse_limit(raw: str | None, default: int = 20, maximum: int = 100) -> int:
    if raw is None or raw == "":
        return default
    try:
        limit = int(raw)
    except ValueError:
        raise ServiceError(
            "invalid_request", f"limit must be an integer from 1 to {maximum}", param="limit"
        ) from None
    if not 1 <= limit <= maximum:
        raise ServiceError("invalid_request", f"limit must be an integer from 1 to {maximum}", param="limit")
    return limit


def page(s: Session, model: Any, tenant_id: str, after: str | None, limit: int, *filters: Any) -> Page:
    query = select(model).where(model.tenant_id == tenant_id, *filters)
    if after:
        cursor = s.execute(
            select(model.created_at, model.id).where(model.id == after, model.tenant_id == tenant_id)
        ).first()
        if cursor is None:
            raise ServiceError("invalid_request", f"after={after!r} is not an id in this list", param="after")
        query = query.where(
            or_(
                model.created_at < cursor.created_at,
                and_(model.created_at == cursor.created_at, model.id < cursor.id),
            )
        )
    rows = s.scalars(query.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)).all()
    return Page(list(rows[:limit]), len(rows) > limit)
