"""Domain rows -> OpenAI wire objects. The only place that knows the JSON field names."""

from __future__ import annotations

from typing import Any

from api.services.paging import Page
from api.services.readiness import Readiness
from scheduler.cost import cost_summary
from storage.adapters import AdapterEntry
from storage.models import (
    Batch,
    Estimate,
    StoredFile,
    Upload,
    UploadPart,
    WebhookDelivery,
    WebhookEndpoint,
)
from storage.registry import GENERATE, ModelEntry
from storage.status import BatchStatus, EstimateStatus


def file_object(f: StoredFile) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "expires_at": f.expires_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
    }


def upload_object(u: Upload, file: StoredFile | None = None) -> dict[str, Any]:
    """OpenAI's Upload; ``file`` is the File object once it is completed."""
    return {
        "id": u.id,
        "object": "upload",
        "bytes": u.bytes,
        "created_at": u.created_at,
        "expires_at": u.expires_at,
        "filename": u.filename,
        "purpose": u.purpose,
        "status": u.status,
        "file": file_object(file) if file is not None else None,
    }


def upload_part_object(p: UploadPart) -> dict[str, Any]:
    return {"id": p.id, "object": "upload.part", "created_at": p.created_at, "upload_id": p.upload_id}


def estimate_object(e: Estimate) -> dict[str, Any]:
    """A dry run, shaped like a batch where the fields mean the same (the openai client's
    ``batches.create``/``retrieve`` read it), with the answer in ``estimate`` once ``completed``."""
    return {
        "id": e.id,
        "object": "batch.estimate",
        "endpoint": e.endpoint,
        "model": e.model,
        "errors": e.errors,
        "input_file_id": e.input_file_id,
        "completion_window": e.completion_window,
        "status": e.status,
        "created_at": e.created_at,
        "completed_at": e.finished_at if e.status == EstimateStatus.COMPLETED else None,
        "failed_at": e.finished_at if e.status == EstimateStatus.FAILED else None,
        "metadata": e.metadata_,
        "estimate": e.result,
    }


def batch_object(b: Batch, running: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """``running``: (completed, failed) so far in its running units (services.batches.running_counts)."""
    completed = min(b.request_completed + running[0], b.request_total)
    failed = min(b.request_failed + running[1], b.request_total - completed)
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "model": b.model,
        "errors": b.errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": b.created_at,
        "in_progress_at": b.in_progress_at,
        "expires_at": b.expires_at,
        "finalizing_at": b.finalizing_at,
        "completed_at": b.completed_at,
        "failed_at": b.failed_at,
        "expired_at": b.expired_at,
        "cancelling_at": b.cancelling_at,
        "cancelled_at": b.cancelled_at,
        "request_counts": {
            "total": b.request_total,
            "completed": completed,
            "failed": failed,
        },
        "metadata": b.metadata_,
        "usage": {
            "input_tokens": b.prompt_tokens,
            "input_tokens_details": {"cached_tokens": b.cached_tokens},
            "output_tokens": b.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": b.prompt_tokens + b.completion_tokens,
        },
        # Freight's own fields; OpenAI clients keep unknown fields (``batch.model_extra``)
        "x_freight": {
            "priority": b.priority,
            "deadline": b.expires_at,
            "eta": b.eta_at if not BatchStatus(b.status).is_terminal else None,
            "at_risk": b.at_risk_since is not None,
            "at_risk_since": b.at_risk_since,
            "sla_met": b.sla_met,
            "warnings": b.warnings or [],
            # cached prompt tokens / prompt tokens, as vLLM reported them per request
            "cache_hit_rate": round(b.cached_tokens / b.prompt_tokens, 4) if b.prompt_tokens else None,
            # what the prefix-sorted plan predicts for the whole batch (known once it is validated)
            "planned_cache_hit_rate": (
                round(b.planned_cached_tokens / b.planned_prompt_tokens, 4)
                if b.planned_prompt_tokens
                else None
            ),
            "cost": cost_summary(b),
            # a resume (issue #48 part 3): the batch whose unsettled lines this one runs, and once
            # final the usage and cost of the whole chain summed (each batch's own stay its own)
            "resumed_from": b.resumed_from,
            "chain_usage": b.chain_usage,
        },
    }


def list_object(p: Page, render: Any) -> dict[str, Any]:
    data = [render(row) for row in p.rows]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": p.has_more,
    }


def model_object(e: ModelEntry) -> dict[str, Any]:
    """OpenAI's model object; what Freight knows of it besides (quantization, prices) under x_freight."""
    price = e.list_price
    return {
        "id": e.name,
        "object": "model",
        "created": e.created_at,
        "owned_by": "freight",
        "x_freight": {
            # generate: chat and completions; embed: /v1/embeddings
            "task": e.task,
            "quantization": e.quantization,
            "max_model_len": e.max_model_len,
            "parameters": e.parameters,
            "weight_bytes": e.weight_bytes,
            # vLLM's parser names: a tool-call parser serves tool_choice "auto"; a reasoning
            # parser splits message.reasoning out and serves a Responses body's `reasoning`
            "tool_call_parser": e.tool_call_parser,
            "reasoning_parser": e.engine_args.get("reasoning_parser") or None,
            "instance_price_per_hour": e.instance_price_per_hour,
            "list_price_per_1m": None
            if price is None
            else {"input": price.input, "cached_input": price.cached_input, "output": price.output},
        },
    }


def adapter_object(a: AdapterEntry) -> dict[str, Any]:
    """A LoRA adapter as the model id it is served as: OpenAI's model object with vLLM's
    ``parent`` (the base model), as ``vllm serve --lora-modules`` lists adapters; its path on the
    servers is not shown to tenants."""
    return {
        "id": a.name,
        "object": "model",
        "created": a.created_at,
        "owned_by": "freight",
        "parent": a.base,
        "x_freight": {"task": GENERATE, "adapter": True, "base": a.base, "lora_rank": a.rank},
    }


def readiness_object(r: Readiness) -> dict[str, Any]:
    """``/readyz``'s body: ready or not, the failed dependencies, and each check's outcome and time.
    Unauthenticated, so no targets or error messages (they name internal hosts and buckets): those
    are in the API's log (api/services/readiness.py)."""
    return {
        "status": "ready" if r.ready else "unready",
        "failed": r.failed,
        "checks": {c.name: {"ok": c.ok, "seconds": c.seconds} for c in r.checks},
    }


def webhook_endpoint_object(e: WebhookEndpoint, show_secret: bool = False) -> dict[str, Any]:
    """A webhook endpoint; its signing secret only in the answer that created it or rotated it."""
    shown: dict[str, Any] = {
        "id": e.id,
        "object": "webhook_endpoint",
        "url": e.url,
        "events": list(e.events or ()),
        "status": e.status,
        "status_at": e.status_at,
        "disabled_reason": e.disabled_reason,
        "created_at": e.created_at,
        # after a rotation: until when deliveries are signed with the replaced secret too
        "previous_secret_expires_at": e.previous_secret_until,
    }
    if show_secret:
        shown["secret"] = e.secret
    return shown


def webhook_delivery_object(d: WebhookDelivery) -> dict[str, Any]:
    """One entry of a delivery log: the event, where it went, and how its attempts went."""
    return {
        "id": f"whdel_{d.id}",
        "object": "webhook_delivery",
        "endpoint_id": d.endpoint_id,
        "event": {"id": d.event_id, "type": d.event_type, "created_at": d.created_at, "batch_id": d.batch_id},
        "status": d.status,
        "status_at": d.status_at,
        "attempts": d.attempts,
        "next_attempt_at": int(d.next_attempt_at) if d.status == "pending" else None,
        "last_attempt_at": int(d.last_attempt_at) if d.last_attempt_at is not None else None,
        "last_status_code": d.last_status_code,
        "last_error": d.last_error,
    }


def webhook_list(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": False}
