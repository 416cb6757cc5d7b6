"""What one request asks of an engine, as a number the fair shares and quotas can add up (pure).

Why: a batch line is not a unit of work. One chat line may ask for up to 128 sequences (``n``),
one embeddings line for 2,048 inputs, one rerank line for a document list; counted by lines, a
tenant of such lines took about 128 times the engine of a tenant of single ones at an equal share
(measured: 2,560 : 2,560 lines in the first 20 units, about 128 : 1 in sequences). Validation
works out each valid line's two numbers from its checked body and stores them with its row:

* ``sequences``: the outputs the line asks for: its ``n`` for text generation, its inputs for
  embeddings, its pairs (documents) for score and rerank, 1 for a transcription.
* ``work``: for a model that generates, the tokens the engine computes for it: its prompt once
  (the ``n`` sequences share it) plus each sequence's expected output, its output budget
  (``max_tokens``, or the deployment's default); for a pooling model (embeddings, score, rerank),
  which generates nothing, its ``sequences``.

A model serves one task, so the units shared on one model's engines are weighed in one measure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GENERATE, EMBED, SCORE, TRANSCRIBE = "generate", "embed", "score", "transcribe"  # storage.registry's tasks

# a score or rerank body's second text list (the first is the query side): its pairs are its length
SCORE_DOCUMENTS = ("documents", "items", "data_2", "text_2")


def _count(value: Any) -> int:
    """Items of a list field (a single item: 1)."""
    return len(value) if isinstance(value, list) and value else 1


def request_sequences(task: str, body: Mapping[str, Any]) -> int:
    """The outputs a checked body asks for (see the module); at least 1."""
    if task == EMBED:
        inputs = body.get("input")
        if isinstance(inputs, list) and inputs and all(isinstance(x, int) for x in inputs):
            return 1  # one prompt given as token ids
        return _count(inputs)
    if task == SCORE:
        for name in SCORE_DOCUMENTS:
            if name in body:
                return _count(body[name])
        return 1
    if task == TRANSCRIBE:
        return 1
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def request_work(prompt_tokens: int, sequences: int, output_tokens: int | None) -> int:
    """A request's work (see the module): ``output_tokens`` is each sequence's expected output,
    None for a pooling model's request (its work is then its sequences); at least 1."""
    if output_tokens is None:
        return max(1, sequences)
    # an output of 0 (a deployment leaving the default to vLLM) still counts its sequences
    return max(0, prompt_tokens) + max(1, sequences) * max(1, output_tokens)
