"""The engine loop's admission by KV footprint (scheduler/kv_admission.py): whether the feed's next
request fits the engine's KV cache beside what it holds, and what each request was planned to read
from the prefix cache.

The loop (workers/engine_loop.py) asks ``admits`` before it hands a request over, ``hold`` once
the engine took it, and ``release`` with every result. Everything here runs on the engine loop's
thread, per request: a few hashes over the prompt's token ids and some dictionary work.

The planned cache hits are the plan's rule (bench/prefix.py's ideal, scheduler.unit_plan): a
request reads the whole blocks it shares with the request handed over just before it in its cache
domain, never its last prompt token. Summed beside vLLM's measured cached tokens in the engine
sample, the two give the hit-rate gap to the plan (the watcher logs it: workers/pack_watcher.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.kv_admission import Footprint, KvLedger, OutputGrowth, footprint, prompt_blocks, shared_blocks
from scheduler.ordering import ADAPTER_MARKER_BYTE, KEY_TOKEN_BYTES, prompt_key
from scheduler.unit_plan import predicted_cached_tokens
from storage.shards import ShardRow
from workers.request_bodies import CHAT, COMPLETIONS, RESPONSES

# the endpoints whose requests grow a decoder's KV cache token by token; the others (pooling, and
# Whisper's encoder-decoder audio lines, whose cross-attention vLLM keeps apart) go by count alone
GENERATIVE = frozenset({CHAT, COMPLETIONS, RESPONSES})

DOMAINS_KEPT = 1024  # cache domains whose last request's blocks are kept for the planned hits


@dataclass
class _Candidate:
    key: str
    blocks: tuple[int, ...]
    prompt_tokens: int
    root: object
    max_tokens: int  # its output's bound: its own max_tokens, within the model's context
    sequences: int
    fp: Footprint | None = None  # as last predicted


class KvGate:
    """One engine's admission by KV footprint; ``KvGate.of`` makes it, or None without a KV cache
    description (a scripted engine) or with FREIGHT_KV_ADMISSION off."""

    def __init__(
        self, capacity_blocks: int, block_size: int, default_max_tokens: int, max_model_len: int
    ) -> None:
        self.block_size = block_size
        self.ledger = KvLedger(capacity_blocks)
        self.growth = OutputGrowth()
        self.default_max_tokens = default_max_tokens
        self.max_model_len = max_model_len
        self._candidate: _Candidate | None = None  # the request asked about last
        self._held: dict[str, tuple[tuple[int, ...], int]] = {}  # engine key -> (blocks, planned hits)
        self._last: OrderedDict[object, tuple[int, ...]] = OrderedDict()  # domain -> last blocks handed over

    @classmethod
    def of(cls, engine: Any) -> KvGate | None:
        described = getattr(engine, "kv_blocks", None)
        if described is None:
            return None
        blocks, block_size = described
        config = engine.config
        return cls(blocks, block_size, int(config.default_max_tokens or 0), int(engine.max_model_len))

    def admits(self, key: str, endpoint: str, salt: str | None, row: ShardRow, empty: bool) -> bool:
        """Whether the request of ``row`` (engine key ``key``) goes in now; ``empty``: the engine
        holds nothing (then always: nothing starves, whatever a stale ledger says). A request of
        an endpoint outside ``GENERATIVE`` always, and the gate keeps no account of it."""
        if endpoint not in GENERATIVE:
            self._candidate = None
            return True
        candidate = self._candidate
        if candidate is None or candidate.key != key:
            candidate = self._candidate = self._describe(key, salt, row)
        # predicted afresh each time it is asked: while it waits, its group's requests finish
        output = self.growth.predict(candidate.blocks, candidate.max_tokens) if candidate.max_tokens else 0
        candidate.fp = footprint(
            candidate.blocks, candidate.prompt_tokens, output, candidate.sequences, self.block_size
        )
        return empty or self.ledger.fits(candidate.fp)

    def hold(self, key: str) -> None:
        """The engine took the request ``admits`` was last asked about (one it keeps no account
        of: nothing)."""
        candidate = self._candidate
        if candidate is None:
            return
        if candidate.key != key or candidate.fp is None:
            raise ValueError(f"{key!r} was not the request asked about")
        self._candidate = None
        self.ledger.hold(key, candidate.fp)
        last = self._last.pop(candidate.root, ())
        shared = shared_blocks(last, candidate.blocks) * self.block_size
        self._held[key] = (
            candidate.blocks,
            predicted_cached_tokens(shared, candidate.prompt_tokens, self.block_size),
        )
        self._last[candidate.root] = candidate.blocks
        while len(self._last) > DOMAINS_KEPT:
            self._last.popitem(last=False)

    def release(self, key: str, output_tokens: int | None) -> int | None:
        """A result of the request (``output_tokens``: None unless it finished well): its blocks
        freed, its output length learned by its prefix groups; its planned cache hits returned."""
        held = self._held.pop(key, None)
        if held is None:
            return None
        self.ledger.release(key)
        blocks, planned = held
        if output_tokens is not None:
            self.growth.finished(blocks, output_tokens)
        return planned

    def _describe(self, key: str, salt: str | None, row: ShardRow) -> _Candidate:
        ids = _token_bytes(row)
        prompt = row.prompt_len or len(ids) // KEY_TOKEN_BYTES
        adapter = row.key[:KEY_TOKEN_BYTES] if row.key and row.key[0] >= ADAPTER_MARKER_BYTE else b""
        root = (salt, adapter)
        blocks = prompt_blocks(root, ids, self.block_size)
        room = max(0, self.max_model_len - prompt) if self.max_model_len else None
        limit = row.max_tokens if row.max_tokens is not None else self.default_max_tokens
        if room is not None:
            limit = min(limit, room)
        return _Candidate(key, blocks, prompt, root, limit, row.sequences)


def _token_bytes(row: ShardRow) -> bytes:
    """The prompt's token ids as big-endian uint32s: the ids validation stored, else the sort key
    (its first FREIGHT_SORT_KEY_TOKENS tokens, an adapter's marker first)."""
    ids: bytes | Sequence[int] | None = row.prompt_token_ids
    if isinstance(ids, bytes):
        return ids
    if ids is not None:
        return prompt_key(ids, len(ids))
    key = row.key
    return key[KEY_TOKEN_BYTES:] if key and key[0] >= ADAPTER_MARKER_BYTE else key
