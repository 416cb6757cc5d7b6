"""Which units to dispatch next and how to pack them, as pure functions over frozen snapshots.

Two separate decisions:

* **Selection** (``dispatch_order``): urgent units first, earliest deadline first; the rest are
  shared fairly between tenants (the tenant with the least work in flight on the model goes
  next), and within one tenant by its own priority, then between its batches of equal priority
  fairly too (the batch with the least work in flight and taken goes next, the earlier
  deadline on a tie), so no batch waits behind others indefinitely. Urgency is capped per tenant
  (``urgent_share``): a tenant already holding more than that share of the work in flight
  while another tenant has work pending or in flight gets no precedence from its deadlines, so no
  tenant can take the engines by submitting batches that are always in a hurry.

  Shares count work (``Candidate.weight``), not lines: one chat line may ask for 128 sequences and
  one embeddings line for 2,048 inputs, so counted by lines a tenant of such lines took about 128
  times the engine of a tenant of single ones at an equal share of lines. A unit's work is what
  validation summed over its rows (``scheduler.request_work``); a unit that has none recorded
  weighs its requests.
* **Layout** (``plan_packs``): the selected units of one model, from any batch and any tenant, are
  sorted by prefix-cache domain, then by the prompt-prefix key of their first request and cut into packs of about
  ``pack_requests`` requests. A pack is what one worker feeds its engine in one go, so small jobs
  share large batches, and units whose prompts start alike land in the same pack, where the worker
  merges their (already sorted) requests so vLLM's prefix cache computes each prefix once.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Candidate:
    unit_id: int
    model: str
    batch_id: str
    tenant_id: str
    deadline: int  # epoch seconds: the batch's expires_at
    priority: int  # the batch's own priority; higher first among its tenant's batches
    created_at: int
    seq: int
    n_requests: int
    prefix_key: bytes = b""
    urgent: bool = False
    domain: str = ""  # its prefix-cache domain: units of different domains never share a prefix
    work: int = 0  # the work its rows ask for (scheduler.request_work); 0: not recorded

    @property
    def weight(self) -> int:
        """What the unit counts for in the fair shares: its work, or its requests when it has
        none recorded (units planned before work was, or made by hand)."""
        return self.work if self.work > 0 else self.n_requests


@dataclass(frozen=True)
class Pack:
    model: str
    unit_ids: tuple[int, ...]
    n_requests: int
    urgent: tuple[int, ...] = ()  # the units still urgent after the share cap: the worker runs them first


def _deadline_order(c: Candidate) -> tuple:
    return (c.deadline, -c.priority, c.created_at, c.batch_id, c.seq)


def _batch_order(c: Candidate, held: int) -> tuple:
    """A tenant's batches: its own priority first, then the least work held (in flight and
    taken in this pass), then deadline."""
    return (-c.priority, held, c.deadline, c.created_at, c.batch_id)


class _TenantQueue:
    """One tenant's units waiting for selection: its batches in ``_batch_order``, each batch's
    units in file order (``seq``)."""

    def __init__(self, units: list[Candidate], batch_load: Mapping[str, int]) -> None:
        by_batch: dict[str, list[Candidate]] = defaultdict(list)
        for c in units:
            by_batch[c.batch_id].append(c)
        # each batch's units, its next one last
        self.units = {b: sorted(us, key=lambda c: c.seq, reverse=True) for b, us in by_batch.items()}
        self.held = {b: batch_load.get(b, 0) for b in self.units}
        self.heap = [(_batch_order(us[-1], self.held[b]), b) for b, us in self.units.items()]
        heapq.heapify(self.heap)

    def __bool__(self) -> bool:
        return bool(self.heap)

    def pop(self) -> Candidate:
        _, batch = heapq.heappop(self.heap)
        unit = self.units[batch].pop()
        self.held[batch] += unit.weight
        if self.units[batch]:
            heapq.heappush(self.heap, (_batch_order(self.units[batch][-1], self.held[batch]), batch))
        return unit


def dispatch_order(
    candidates: Iterable[Candidate],
    tenant_load: Mapping[str, int],
    urgent_share: float = 1.0,
    *,
    share_load: Mapping[str, int] | None = None,
    batch_load: Mapping[str, int] | None = None,
) -> list[Candidate]:
    """Urgent units by deadline, then the rest by fair share: work already in flight per
    tenant (``share_load``, default ``tenant_load``) plus the work of the units taken so far
    (``Candidate.weight``) decide whose unit comes next; within a tenant, its priority, then work
    in flight per batch (``batch_load``) plus that taken, so its batches of equal priority take
    turns. Every load is in the units of ``Candidate.weight``.

    ``urgent_share``: an urgent unit goes ahead only while its tenant holds at most this share of
    the work in flight (``tenant_load``) and taken, or no other tenant has work pending or in
    flight; otherwise it waits its turn in its tenant's fair-share queue and is returned with
    ``urgent=False``. Another tenant's requests in flight count as waiting: on the worker they
    wait behind every urgent request (scheduler.feed_order), so a stream of urgent packs would
    starve them there."""
    pending = list(candidates)
    waiting: dict[str, int] = defaultdict(int)  # units not yet placed, per tenant
    per_tenant: dict[str, list[Candidate]] = defaultdict(list)
    for c in pending:
        waiting[c.tenant_id] += 1
        if not c.urgent:
            per_tenant[c.tenant_id].append(c)
    load: dict[str, int] = defaultdict(int, tenant_load)
    share: dict[str, int] = defaultdict(int, tenant_load if share_load is None else share_load)
    order: list[Candidate] = []
    for c in sorted((c for c in pending if c.urgent), key=_deadline_order):
        others_wait = any(waiting[t] or load[t] for t in waiting.keys() | load.keys() if t != c.tenant_id)
        if not others_wait or load[c.tenant_id] <= urgent_share * sum(load.values()):
            order.append(c)
            load[c.tenant_id] += c.weight
            share[c.tenant_id] += c.weight
            waiting[c.tenant_id] -= 1
        else:
            per_tenant[c.tenant_id].append(replace(c, urgent=False))
    queues = {tenant: _TenantQueue(units, batch_load or {}) for tenant, units in per_tenant.items()}
    heap = [(share[tenant], tenant) for tenant in queues]
    heapq.heapify(heap)
    while heap:
        held, tenant = heapq.heappop(heap)
        unit = queues[tenant].pop()
        order.append(unit)
        if queues[tenant]:
            heapq.heappush(heap, (held + unit.weight, tenant))
    return order


def plan_packs(
    candidates: Iterable[Candidate],
    queued_packs: Mapping[str, int],
    *,
    depth: int,
    pack_requests: int,
    tenant_load: Mapping[str, int],
    urgent_share: float = 1.0,
    model_load: Mapping[str, Mapping[str, int]] | None = None,
    batch_load: Mapping[str, int] | None = None,
) -> list[Pack]:
    """Packs to queue now, in the order to send them: at most ``depth`` queued per model.

    ``tenant_load``: work in flight per tenant on every model (the urgent share's measure);
    ``model_load``: model -> tenant -> work in flight on that model, the fair share of each
    model's packs (absent: ``tenant_load``); ``batch_load``: work in flight per batch, the
    turns of a tenant's batches (see ``dispatch_order``). The packs themselves are cut by
    requests (``pack_requests``): how many a worker feeds its engine at once.

    Every unit is in at most one pack; a pack holds units of one model only, at least one unit,
    and more than ``pack_requests`` requests only when a single unit is that large.
    """
    by_model: dict[str, list[Candidate]] = defaultdict(list)
    for c in candidates:
        by_model[c.model].append(c)
    planned: list[tuple[int, Pack]] = []  # (best selection rank inside, pack)
    for model in sorted(by_model):
        room = depth - queued_packs.get(model, 0)
        if room <= 0:
            continue
        budget = room * pack_requests
        chosen: list[tuple[int, Candidate]] = []
        order = dispatch_order(
            by_model[model],
            tenant_load,
            urgent_share,
            share_load=None if model_load is None else model_load.get(model, {}),
            batch_load=batch_load,
        )
        for rank, c in enumerate(order):
            if budget <= 0:
                break
            chosen.append((rank, c))
            budget -= c.n_requests
        chosen.sort(key=lambda rc: (rc[1].domain, rc[1].prefix_key, rc[1].batch_id, rc[1].seq))
        current: list[tuple[int, Candidate]] = []
        size = 0
        packs: list[list[tuple[int, Candidate]]] = []
        for rc in chosen:
            if current and size + rc[1].n_requests > pack_requests:
                packs.append(current)
                current, size = [], 0
            current.append(rc)
            size += rc[1].n_requests
        if current:
            packs.append(current)
        ranked = sorted(((min(rank for rank, _ in m), m) for m in packs), key=lambda rm: rm[0])
        for best, members in ranked[:room]:  # uneven cuts: the least urgent packs wait a tick
            units = tuple(c.unit_id for _, c in members)
            urgent = tuple(c.unit_id for _, c in members if c.urgent)
            planned.append((best, Pack(model, units, sum(c.n_requests for _, c in members), urgent)))
    planned.sort(key=lambda rp: (rp[0], rp[1].model))
    return [pack for _, pack in planned]
