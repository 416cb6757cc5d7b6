"""What the dispatcher knows is on its way to a model's queue: the word a pack carries that an idle
engine should wait a moment for more (``more_coming``; the wait is ``PackFeed.gathering``'s).

Why: jobs that share prompts and arrive together run fastest as one sweep over those prompts. An
engine that starts on the first job's pack alone fills itself with that job's requests, and the
other jobs' requests for the prompts it has passed wait for a second sweep, after a small KV cache
has dropped them (issue #24). A job that is alone, though, gains nothing from any wait: it is
idle accelerator time before its first request (issue #51), and a guessed wait (the settle window,
``FREIGHT_FEED_SETTLE_SECONDS``) cost every lone job of the scheduler benchmark 0.1-0.27 s of
jobs of 3-20 s. So the pack says what is known instead of guessing:

* batches still validating whose rows come only at its end (not those running early slices,
  ``workers/head_start.py``: their rows come as they are read, and an engine waiting for them
  would lose the time the slices were started to save); their model is None until validation has
  read a line naming it, so such a batch may be of any model;
* batch input files uploaded within ``FREIGHT_FEED_MERGE_SECONDS`` that no batch names yet: a
  client uploads its file and then creates the batch on it, so the batch is on its way (of a model
  not known yet). A file kept for later stops counting once the window has passed.

Each arrival is counted only for the cache domain it will run in (``Settings.cache_domain``): with
prefix caches per tenant, another tenant's job shares no cache entry with a pack's requests, and
its arrival must not hold them up. An upload still in flight (its body not yet received) is not
known: the settle window, off by default, is the operator's guess for that.
"""

from __future__ import annotations

import math

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from storage.models import Batch, StoredFile, WorkUnit
from storage.settings import Settings
from storage.status import BatchStatus

Arrival = tuple[str | None, str]  # (model, None: not known yet; the cache domain it will run in)


def arriving(s: Session, settings: Settings, now: float) -> set[Arrival]:
    """The (model, cache domain) pairs of the work on its way (see the module docstring)."""
    sliced = exists().where(WorkUnit.batch_id == Batch.id)
    validating = s.execute(
        select(Batch.model, Batch.tenant_id).where(Batch.status == BatchStatus.VALIDATING, ~sliced).distinct()
    ).all()
    found: set[Arrival] = {(model, settings.cache_domain(tenant)) for model, tenant in validating}
    if settings.feed_merge_seconds > 0:
        # files.created_at is whole seconds: the window is widened to the second before
        since = math.floor(now - settings.feed_merge_seconds)
        named = exists().where(Batch.input_file_id == StoredFile.id)
        unnamed = s.scalars(
            select(StoredFile.tenant_id)
            .where(
                StoredFile.purpose == "batch",
                StoredFile.created_at >= since,
                StoredFile.deleted_at.is_(None),
                ~named,
            )
            .distinct()
        ).all()
        found |= {(None, settings.cache_domain(tenant)) for tenant in unnamed}
    return found


def more_coming(found: set[Arrival], model: str, domains: set[str]) -> bool:
    """Whether work of ``model`` (or of a model not known yet) is on its way to one of ``domains``,
    the cache domains of a pack's requests."""
    return any(m in (None, model) and domain in domains for m, domain in found)
