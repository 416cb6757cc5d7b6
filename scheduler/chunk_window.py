"""Which of a tenant's batches get the validation chunk slots that come free.

A tenant's large inputs are validated in chunks (workers/validation_chunks.py), and the tenant
keeps at most a fixed number of chunks queued or running, whatever number of its batches are
being validated: so one tenant's uploads, however many, take that many places in the control
plane's validation queue and no more, and another tenant's file waits behind at most that many.
Each slot that comes free goes to the tenant's batch with the fewest chunks in flight (ties: the
earlier batch), so a batch that arrives while another holds every slot gets its share as the
other's chunks end, instead of waiting for the whole of the first; and a lone batch has them all.

Pure logic (water-filling): no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def share_slots(room: int, batches: Sequence[tuple[K, int, int]]) -> dict[K, int]:
    """How many more chunks each batch sends. ``batches``: (batch, chunks in flight, chunks not
    yet sent), earliest first; ``room``: the free slots. Each slot goes in turn to the batch with
    the fewest in flight that has an unsent chunk (ties: the earlier). Batches given nothing are
    left out of the result."""
    in_flight = [sent for _, sent, _ in batches]
    unsent = [waiting for _, _, waiting in batches]
    given = [0] * len(batches)
    for _ in range(max(0, room)):
        open_ = [i for i in range(len(batches)) if unsent[i] > given[i]]
        if not open_:
            break
        pick = min(open_, key=lambda i: (in_flight[i] + given[i], i))
        given[pick] += 1
    return {batches[i][0]: n for i, n in enumerate(given) if n}
