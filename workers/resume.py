"""Resuming a batch, the workers' half (issue #48 part 3): a batch made with ``resume_from`` runs
only the lines of its input file that the earlier batch left without a result worth keeping, and
its files carry the earlier batch's, so the chain ends in one output file and one error file that
hold every line of the input once.

The earlier batch's files are the merged files of its own chain (a resume of a resume reads the
files of the batch it resumes, which already carry the ones before), so one step back is always
enough. A line is *settled* when the earlier batch's output file holds it, or its error file holds
it with an error not worth retrying (``workers.results.worth_retrying``); validation skips the
settled lines (``settled``, a set of the 16-byte digests ``validation.FileChecks`` keeps of
custom_ids: bounded memory, a million lines about 100 MB of Python set at worst), and finalization
writes them first into the new batch's files (``carried``), exactly the same lines.

Usage and cost stay each batch's own; the new batch's ``chain_usage`` sums the chain's
(``chain_usage``), shown in its ``x_freight``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy.orm import Session

from storage.models import Batch, StoredFile
from storage.objectstore import CHUNK, iter_lines
from storage.result_order import line_custom_id
from storage.runtime import Runtime
from workers.results import worth_retrying


def digest(custom_id: bytes) -> bytes:
    """A custom_id's 16-byte digest, as ``validation.FileChecks`` keeps them."""
    return hashlib.blake2b(custom_id, digest_size=16).digest()


def _file_key(s: Session, file_id: str | None) -> str | None:
    if file_id is None:
        return None
    record = s.get(StoredFile, file_id)
    return None if record is None else record.object_key


def earlier_files(rt: Runtime, batch_id: str) -> tuple[str | None, str | None]:
    """The object keys of the output and error files of the batch ``batch_id`` (None: it has none)."""
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        if batch is None:
            return None, None
        return _file_key(s, batch.output_file_id), _file_key(s, batch.error_file_id)


def settled(rt: Runtime, earlier_id: str) -> frozenset[bytes]:
    """The digests of the custom_ids the batch ``earlier_id`` settled: its output file's lines and
    its error file's lines not worth retrying (what a resume of it skips)."""
    output_key, error_key = earlier_files(rt, earlier_id)
    found: set[bytes] = set()
    if output_key is not None:
        with rt.store.open(output_key) as stream:
            for raw in iter_lines(stream):
                if raw.strip():
                    found.add(digest(line_custom_id(raw).encode()))
    if error_key is not None:
        with rt.store.open(error_key) as stream:
            for raw in iter_lines(stream):
                if raw.strip():
                    line = json.loads(raw)
                    if not worth_retrying(line):
                        found.add(digest(str(line["custom_id"]).encode()))
    return frozenset(found)


def carried(rt: Runtime, earlier_id: str, kind: str, counts: dict[str, int]) -> Iterator[bytes]:
    """The bytes of the earlier batch's file of ``kind`` ("output" or "errors") that the resumed
    batch's file of that kind begins with: every output line; the error lines not worth retrying
    (the others are this batch's to run). Counts the lines into ``counts[kind]``."""
    output_key, error_key = earlier_files(rt, earlier_id)
    key = output_key if kind == "output" else error_key
    if key is None:
        return
    with rt.store.open(key) as stream:
        if kind == "output":
            while chunk := stream.read(CHUNK):
                counts[kind] += chunk.count(b"\n")
                yield chunk
            return
        for raw in iter_lines(stream):
            if raw.strip() and not worth_retrying(json.loads(raw)):
                counts[kind] += 1
                yield raw + b"\n"


# a batch's own figures the chain sums: (chain_usage key, Batch column)
CHAIN_FIELDS = (
    ("request_completed", "request_completed"),
    ("input_tokens", "prompt_tokens"),
    ("cached_tokens", "cached_tokens"),
    ("output_tokens", "completion_tokens"),
    ("engine_seconds", "engine_seconds"),
    ("cost_micros", "cost_micros"),
)


def own_usage(batch: Batch) -> dict[str, Any]:
    """One batch's own figures, as ``chain_usage`` counts them (a chain of one)."""
    usage: dict[str, Any] = {"batches": 1}
    for key, column in CHAIN_FIELDS:
        usage[key] = getattr(batch, column) or 0
    return usage


def chain_usage(s: Session, batch: Batch) -> dict[str, Any] | None:
    """The usage and cost of ``batch`` and every batch it resumes, summed (None: not a resume).
    Read from the earlier batch's own ``chain_usage`` (already the sum of those before it)."""
    if batch.resumed_from is None:
        return None
    earlier = s.get(Batch, batch.resumed_from)
    before = own_usage(earlier) if earlier is not None and earlier.chain_usage is None else None
    if earlier is not None and earlier.chain_usage is not None:
        before = earlier.chain_usage
    total = own_usage(batch)
    if before is not None:
        for key, value in before.items():
            total[key] = total.get(key, 0) + value
    total["engine_seconds"] = round(total["engine_seconds"], 3)
    total["total_tokens"] = total["input_tokens"] + total["output_tokens"]
    return total
