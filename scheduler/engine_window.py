"""How many sequences an engine worker keeps inside vLLM (running plus waiting).

Enough waiting that no engine step finds a free slot idle, and no more: vLLM serves its waiting
queue first come, first served, so every request handed over early is one whose place the feed
(scheduler/feed_order.py) can no longer choose, next to prefix-mates that arrive later.

* While sequence slots bound the batch: ``WINDOW_PER_SEQ`` times ``max_num_seqs``, so a step that
  frees every slot finds as many waiting.
* While something else bounds it (the last step left requests waiting with slots free): the
  requests still running plus what one step can start. That is at least
  ``KV_BOUND_WAITING_PER_SEQ`` of ``max_num_seqs`` (when the KV cache is full vLLM starts a few
  as others finish), and at least one step's prefill token budget (``max_num_batched_tokens``) in
  prompts of the mean length: a step bounded by its token budget also leaves requests waiting
  with slots free, and with tiny prompts it starts a hundred of them at once. Measured before the
  token term (bench/request_rate.py, 20,000 requests of ~20 prompt tokens and 1-4 output tokens,
  256 sequences): the worker kept 32 waiting, vLLM ran about 40 requests a step against about 73
  in process, and Freight reached 0.85x the in-process engine's requests/s.
* Two steps' budgets, not one (``PREFILL_STEPS_AHEAD``): vLLM's engine core is its own process and
  starts its next step as soon as one ends, while the worker is still reading that step's outputs
  and handing over more requests; with one step's worth waiting, every other step found the
  queue empty and only decoded. Measured with the Engine alone (6,000 requests of the
  request-rate shape, the demo model, 256 sequences, a loaded 2-core box): one step ahead, 235
  steps of 64 requests; two, 131 of 115; four, 131 of 114.
"""

from __future__ import annotations

import math

WINDOW_PER_SEQ = 2  # sequences held in the engine (running + waiting) per max_num_seqs
KV_BOUND_WAITING_PER_SEQ = 1 / 8  # waiting beyond the running ones while slots are not the bound
PREFILL_STEPS_AHEAD = 2  # steps' prefill token budgets held waiting while slots are not the bound


def engine_window(
    max_num_seqs: int,
    still_running: int,
    slots_free_with_waiting: bool,
    token_budget: int,
    mean_prompt_tokens: float,
) -> int:
    """Sequences to keep in the engine after the last step.

    ``still_running``: requests the last step advanced that did not finish;
    ``slots_free_with_waiting``: the last step left requests waiting with sequence slots free;
    ``token_budget``: the engine's max_num_batched_tokens; ``mean_prompt_tokens``: of the
    requests handed over lately (prompt tokens, before any cache hit: an upper bound on a
    request's prefill cost, so the estimate errs towards fewer waiting)."""
    full = max(1, WINDOW_PER_SEQ * max_num_seqs)
    if not slots_free_with_waiting:
        return full
    by_slots = max(2, round(KV_BOUND_WAITING_PER_SEQ * max_num_seqs))
    by_tokens = math.ceil(PREFILL_STEPS_AHEAD * token_budget / max(1.0, mean_prompt_tokens))
    return max(1, min(full, still_running + max(by_slots, by_tokens)))
