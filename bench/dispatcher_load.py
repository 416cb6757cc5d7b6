"""The fleet-scale dispatcher benchmark's workload: tenants, batches and work units written straight
into the database in the state validation leaves them (``in_progress``, units ``pending``).

Validation is not what bench/dispatcher_sim.py measures, so nothing is parsed or tokenized here:
the rows are what ``workers.planning`` would have written for files of these sizes, seeded so that
every run at one scale is the same workload.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sqlalchemy import insert

from storage.db import Database
from storage.models import Batch, StoredFile, Tenant, WorkUnit
from storage.status import BatchStatus, UnitStatus

CHAT = "/v1/chat/completions"
# seconds left before the deadline, and how often each occurs: a few batches are due soon enough
# to be urgent (slack under FREIGHT_URGENT_SLACK_SECONDS once throughput is measured), most are not
DEADLINES = ((1200, 1), (3600, 3), (4 * 3600, 4), (24 * 3600, 2))
PRIORITIES = (-5, 0, 0, 5)
PROMPT_TOKENS = 200  # modelled per request: the unit's planned and recorded prompt tokens
OUTPUT_TOKENS = 50


@dataclass(frozen=True)
class Sizes:
    """The workload at one scale: the issue's 10,000,000 requests, 1,000 batches of 100 tenants,
    1,000 workers over 10 models at scale 1."""

    requests: int
    batches: int
    tenants: int
    models: int
    workers: int

    @classmethod
    def at(cls, scale: float) -> Sizes:
        batches = max(4, round(1000 * scale))
        workers = max(2, round(1000 * scale))
        requests = max(batches * 10, round(10_000_000 * scale))
        return cls(
            requests=requests,
            batches=batches,
            tenants=max(2, min(100, batches)),
            models=max(1, min(10, workers, batches)),
            workers=workers,
        )

    def model_names(self) -> list[str]:
        return [f"m{i}" for i in range(self.models)]


@dataclass(frozen=True)
class Loaded:
    batches: int
    units: int
    requests: int


def batch_sizes(sizes: Sizes, rng: random.Random) -> list[int]:
    """Requests per batch, mixed (0.2x to 1.8x the mean), summing exactly to ``sizes.requests``."""
    weights = [rng.uniform(0.2, 1.8) for _ in range(sizes.batches)]
    total = sum(weights)
    out = [max(1, math.floor(sizes.requests * w / total)) for w in weights]
    out[-1] += sizes.requests - sum(out)
    return out


def load(db: Database, sizes: Sizes, now: int, unit_size: int, seed: int = 21) -> Loaded:
    """Write the workload; returns what was written. Batch ``i`` belongs to tenant ``i % tenants``
    and runs on model ``(tenant + i // tenants) % models``, so each tenant has one batch per
    model at the full scale and tenants are alike: fairness between them is measurable."""
    rng = random.Random(seed)
    models = sizes.model_names()
    tenants = [
        {"id": f"tenant_sim{t:03d}", "name": f"sim{t:03d}", "created_at": now - 86400}
        for t in range(sizes.tenants)
    ]
    files, batches, units = [], [], []
    deadline_pool = [left for left, weight in DEADLINES for _ in range(weight)]
    for i, n in enumerate(batch_sizes(sizes, rng)):
        tenant = i % sizes.tenants
        model = models[(tenant + i // sizes.tenants) % sizes.models]
        batch_id, file_id = f"batch_sim{i:05d}", f"file-sim{i:05d}"
        created = now - rng.randint(60, 600)
        files.append(
            {
                "id": file_id,
                "tenant_id": tenants[tenant]["id"],
                "purpose": "batch",
                "filename": f"{i}.jsonl",
                "bytes": n * 300,
                "object_key": f"files/{file_id}",
                "created_at": created,
            }
        )
        n_units = math.ceil(n / unit_size)
        batches.append(
            {
                "id": batch_id,
                "tenant_id": tenants[tenant]["id"],
                "endpoint": CHAT,
                "model": model,
                "input_file_id": file_id,
                "completion_window": "24h",
                "status": BatchStatus.IN_PROGRESS.value,
                "created_at": created,
                "in_progress_at": created + 30,
                "expires_at": now + rng.choice(deadline_pool),
                "request_total": n,
                "priority": rng.choice(PRIORITIES),
                "planned_prompt_tokens": n * PROMPT_TOKENS,
            }
        )
        for seq in range(n_units):
            count = min(unit_size, n - seq * unit_size)
            units.append(
                {
                    "batch_id": batch_id,
                    "seq": seq,
                    "model": model,
                    "shard_key": f"batches/{batch_id}/shards/000000.parquet",
                    "row_start": seq * unit_size,
                    "first_line": seq * unit_size + 1,
                    "n_requests": count,
                    "status": UnitStatus.PENDING,
                    "attempts": 0,
                    "prefix_key": rng.randbytes(8),
                    "planned_prompt_tokens": count * PROMPT_TOKENS,
                }
            )
    with db.write() as s:
        s.execute(insert(Tenant), tenants)
        s.execute(insert(StoredFile), files)
        s.execute(insert(Batch), batches)
    for start in range(0, len(units), 20_000):  # bounded transactions: 10M requests are ~40k rows
        with db.write() as s:
            s.execute(insert(WorkUnit), units[start : start + 20_000])
    return Loaded(len(batches), len(units), sizes.requests)
