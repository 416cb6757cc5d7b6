"""Submit examples/requests.jsonl to a running Freight with the official openai client, wait, print.

    FREIGHT_API_KEY=fk-... python examples/submit.py [FILE] [--base-url http://127.0.0.1:8080/v1]

The demo model is tiny and trained only on the Python standard library, so the sample questions ask
about the standard library; its answers read as docstring English, not as facts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("file", nargs="?", default=str(Path(__file__).with_name("requests.jsonl")))
    parser.add_argument(
        "--base-url", default=os.environ.get("FREIGHT_API_URL", "http://127.0.0.1:8080") + "/v1"
    )
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ["FREIGHT_API_KEY"])

    with open(args.file, "rb") as fh:
        uploaded = client.files.create(file=fh, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"source": "examples/submit.py"},
    )  # fmt: skip
    print(f"submitted {batch.id} ({uploaded.filename}, {uploaded.bytes} bytes)")
    deadline = time.monotonic() + args.timeout
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() > deadline:
            print(f"gave up waiting: {batch.id} is still {batch.status}", file=sys.stderr)
            return 1
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
        counts = batch.request_counts
        print(f"  {batch.status:<11} {counts.completed + counts.failed}/{counts.total} done", flush=True)
    print(f"{batch.id}: {batch.status}; usage {batch.usage.model_dump() if batch.usage else None}")
    cost = (batch.model_extra or {}).get("x_freight", {}).get("cost")
    if cost:  # Freight's extension block: what the engine time cost, and per 1M tokens
        per_1m = cost["per_1m_tokens"]["all"]
        print(
            f"  cost ${cost['total']:.6f} for {cost['engine_seconds']} engine s"
            + (f" (${per_1m:.4f} per 1M tokens)" if per_1m is not None else "")
        )
    if batch.status == "failed":
        for error in batch.errors.data:
            print(f"  line {error.line}: {error.code}: {error.message}")
        return 1
    if batch.output_file_id:
        for raw in client.files.content(batch.output_file_id).text.splitlines()[:4]:
            line = json.loads(raw)
            choice = line["response"]["body"]["choices"][0]
            print(f"  {line['custom_id']}: {choice['message']['content'][:70]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
