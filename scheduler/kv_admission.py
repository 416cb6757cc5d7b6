"""KV-aware admission: whether the feed's next request fits the engine's KV cache beside the
requests it already holds, each shared prefix counted once.

Why: vLLM admits a waiting request as soon as its prompt's blocks are free and reserves nothing for
the output it will grow. When the running requests' outputs outgrow the cache it preempts the
newest running request (its blocks freed, its prompt and output so far computed again later), and
a new request's blocks evict cached prefix blocks no running request holds: often the prefix the
feed's next requests were sorted to read. The engine window (scheduler/engine_window.py) counts
sequences and sees neither. So the engine loop hands over the feed's next request only if every
request in the engine, each grown to its predicted output, still fits:

* vLLM's block accounting: a request ends holding ``ceil((prompt + output) / block_size)`` blocks;
  the whole blocks of its prompt are shared through the prefix cache with every request whose
  prompt starts with the same whole blocks (same cache salt, same LoRA adapter), so they count once
  however many requests hold them. A block is named, as vLLM names it, by a hash chained over the
  blocks before it (``prompt_blocks``): two prompts share the blocks up to their first difference.
* output growth: from the finished requests of the request's prefix group, the deepest of its
  whole prompt blocks with at least ``MIN_SAMPLES`` finished requests: their ``GROWTH_QUANTILE``
  of output tokens, never above the request's own ``max_tokens``; with no such history its
  ``max_tokens`` (``OutputGrowth``).
* the first request into an empty engine is always admitted, so nothing starves (one that alone
  overflows the cache is left to vLLM).

Requests are never reordered: a request that does not fit waits (first) until enough finish, so
the feed's urgent-first, turn-taking order (scheduler/feed_order.py) is the order of admission.

Pure logic: the engine loop (workers/kv_gate.py) gives the token ids and the cache's size.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.ordering import KEY_TOKEN_BYTES

GROWTH_QUANTILE = 0.9  # of a prefix group's finished output tokens: the growth admission reserves
MIN_SAMPLES = 4  # finished requests a prefix group needs before its history replaces max_tokens
GROUP_SAMPLES = 32  # finished output lengths kept per prefix block (the latest)
GROUPS_KEPT = 4096  # prefix blocks with a history kept (least recently finished dropped first)


def prompt_blocks(root: object, ids: bytes, block_size: int) -> tuple[int, ...]:
    """The names of a prompt's whole KV blocks: block i's hash chains the root's (cache salt,
    adapter) and every token up to its end, so equal names mean equal prefixes, as vLLM's block
    hashes do. ``ids``: the prompt's token ids as big-endian uint32s (scheduler.ordering's keys)."""
    step = block_size * KEY_TOKEN_BYTES
    names: list[int] = []
    name = hash(root)
    for end in range(step, len(ids) + 1, step):
        name = hash((name, ids[end - step : end]))
        names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class Footprint:
    """What a request holds in the KV cache at its end: ``blocks``, the names of its prompt's whole
    blocks (shareable); ``own``, the rest (its prompt's partial block and its output's), in blocks."""

    blocks: tuple[int, ...]
    own: int


def footprint(
    blocks: tuple[int, ...], prompt_tokens: int, output_tokens: int, sequences: int, block_size: int
) -> Footprint:
    """A request's footprint: ``sequences`` outputs (n > 1) share the prompt, each grows its own."""
    per_sequence = math.ceil((prompt_tokens + output_tokens) / block_size) - len(blocks)
    return Footprint(blocks, max(0, per_sequence) * max(1, sequences))


class KvLedger:
    """The KV blocks the requests in the engine will hold, each shared prompt block once."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._refs: dict[int, int] = {}  # shared block name -> requests holding it
        self._own = 0  # blocks of no other request's, summed over the requests held
        self._held: dict[str, Footprint] = {}

    def __len__(self) -> int:
        return len(self._held)

    @property
    def used(self) -> int:
        """Blocks in use at the held requests' predicted ends."""
        return len(self._refs) + self._own

    def cost(self, fp: Footprint) -> int:
        """Blocks ``fp`` would add: its own, and its prompt blocks no held request holds yet."""
        return fp.own + sum(1 for b in fp.blocks if b not in self._refs)

    def fits(self, fp: Footprint) -> bool:
        """Whether it may go in: into an empty engine always (nothing starves), else within capacity."""
        return not self._held or self.used + self.cost(fp) <= self.capacity

    def hold(self, key: str, fp: Footprint) -> None:
        if key in self._held:
            raise ValueError(f"{key!r} is already held")
        self._held[key] = fp
        self._own += fp.own
        for b in fp.blocks:
            self._refs[b] = self._refs.get(b, 0) + 1

    def release(self, key: str) -> Footprint | None:
        fp = self._held.pop(key, None)
        if fp is None:
            return None
        self._own -= fp.own
        for b in fp.blocks:
            left = self._refs[b] - 1
            if left:
                self._refs[b] = left
            else:
                del self._refs[b]
        return fp


class OutputGrowth:
    """Output tokens predicted per prefix group from its finished requests (see the module docstring)."""

    def __init__(
        self,
        quantile: float = GROWTH_QUANTILE,
        min_samples: int = MIN_SAMPLES,
        samples: int = GROUP_SAMPLES,
        groups: int = GROUPS_KEPT,
    ) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self.samples = samples
        self.groups = groups
        self._seen: OrderedDict[int, deque[int]] = OrderedDict()  # prefix block -> output tokens

    def predict(self, blocks: Sequence[int], max_tokens: int) -> int:
        """Output tokens to reserve for a request with these prompt blocks and this ``max_tokens``."""
        for block in reversed(blocks):
            seen = self._seen.get(block)
            if seen is not None and len(seen) >= self.min_samples:
                ranked = sorted(seen)
                at = max(0, math.ceil(self.quantile * len(ranked)) - 1)
                return min(max_tokens, ranked[at])
        return max_tokens

    def finished(self, blocks: Sequence[int], output_tokens: int) -> None:
        """A request with these prompt blocks finished with ``output_tokens``: every prefix group it
        belongs to (each of its blocks) learns it."""
        seen = self._seen
        for block in blocks:
            history = seen.get(block)
            if history is None:
                history = seen[block] = deque(maxlen=self.samples)
            else:
                seen.move_to_end(block)
            history.append(output_tokens)
        while len(seen) > self.groups:
            seen.popitem(last=False)


def shared_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading block names two prompts share: the whole blocks the later one reads from the
    earlier one's cache entries."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
