"""The one module that drives vLLM's engine, so a vLLM upgrade changes one place.

Why the engine-level API (`LLMEngine.add_request` + `step()`) rather than
`LLM.generate(list)`: `generate` drains the running batch to zero at the end of each
call, while a worker that keeps adding requests as others finish keeps the batch full
across work units and holds only a bounded window of a huge input in memory.

`Engine.run` takes any iterable of `EngineRequest`s and yields exactly one
`EngineResult` per request, in completion order:

* status 200: `body` is the OpenAI response body (see `workers.request_bodies`);
* status 400: the request itself is at fault (bad parameter, prompt too long...),
  reported immediately, never disturbing the other requests;
* status 500: the engine failed this request (vLLM reported an error for it, or the
  response could not be built);
* status 499 (`ABORTED_STATUS`, nginx's "client closed request"): `should_abort()`
  returned True before the request finished; `error.code` is "aborted". Every request
  not finished by then gets one, including those still in the iterable.

If vLLM's engine itself dies, `run` raises: nothing more can run in this process.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.engine_window import engine_window
from workers.embeddings import EmbeddingFailed, PooledLine, submit_embeddings
from workers.engine_lifetime import PARENT_ENV, START_ERROR_ENV
from workers.images import inline_images
from workers.lora import LoraAdapters
from workers.rendering import RenderedRequest, build_response_body, render_request, token_counts
from workers.request_bodies import EMBEDDINGS, ParsedRequest, RequestError, parse_body, serves
from workers.request_shapes import ParsedShapes
from workers.scoring import SCORING_ENDPOINTS, ScoredLine, ScoringFailed, cross_encoder, submit_scoring
from workers.tool_calls import ModelParsers
from workers.transcription import AUDIO_ENDPOINTS, SpeechLines, TranscribedLine, TranscriptionFailed

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from vllm.v1.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

ABORTED_STATUS = 499
ABORT_POLL_SECONDS = 0.5
ENGINE_STOP_SECONDS = 1.0  # how long vLLM may take to stop its processes before they are killed
PROMPT_MEAN_WEIGHT = 0.05  # the newest request's weight in the running mean of prompt lengths


@dataclass(frozen=True)
class EngineConfig:
    """How to start one engine. None means vLLM's default (or the environment's).

    `kv_cache_bytes` sets vLLM's `kv_cache_memory_bytes` (0 or None: vLLM's default; on CPU
    an operator's `VLLM_CPU_KVCACHE_SPACE` overrides it). `default_max_tokens` is the output
    budget for requests that do not give one (None: the context left after the prompt).
    `engine_args` are the model's other vLLM engine arguments (workers/engine_args.py), passed to
    EngineArgs over Freight's own (a `reasoning_parser` among them also reads reasoning out of
    chat answers into `message.reasoning`). `stats` turns vLLM's stat logging on, whose Prometheus metrics
    (`stats_registry`) a worker serves with FREIGHT_ENGINE_METRICS_BIND; off, it costs nothing.
    """

    model_path: str
    served_name: str
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    default_max_tokens: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    quantization: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    stats: bool = False
    core: str = "auto"  # where vLLM's engine core runs: FREIGHT_ENGINE_CORE (see `core_inline`)
    tool_call_parser: str | None = None  # the registry's: serves tool_choice "auto" (workers/tool_calls.py)
    # "embed": vLLM's pooling runner, /v1/embeddings (and scores by cosine); "score": a cross-encoder
    # on the pooling runner, /v1/score and /v1/rerank only (storage/registry.py: TASKS)
    task: str = "generate"
    max_audio_seconds: float = 600.0  # an audio line's longest audio (FREIGHT_MAX_AUDIO_SECONDS)
    sizing: str = ""  # where the batch and KV-cache sizes came from (workers/bootstrap.py: engine_sizes)


# Structured outputs (response_format's schemas, forced tool calls) write JSON without optional
# whitespace. JSON's grammar allows any amount of it between tokens, and a model that favours
# whitespace there (code models do after a closing quote) can fill the whole max_tokens budget
# with it and leave the line unparsable: measured on the trained demo model, five tests' schema and
# tool-call outputs ran to their budget. OpenAI's structured outputs are compact too. vLLM takes the
# option only with an explicit backend; xgrammar is the one its "auto" tries first, and schemas it
# cannot compile (multipleOf, uniqueItems, ...) fail their own line with vLLM's reason instead of
# falling back to guidance. A model's own structured_outputs_config engine arg replaces this whole
# (say {"backend": "guidance", "disable_any_whitespace": true} for guidance's wider coverage).
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


def engine_arguments(config: EngineConfig, stored: str | None, quantized: bool) -> dict[str, Any]:
    """vLLM's EngineArgs for ``config`` (``stored``, ``quantized``: the checkpoint's weights, as
    ``workers.checkpoint.stored_dtype`` reads them)."""
    kwargs: dict[str, Any] = {}
    if config.quantization is not None:
        kwargs["quantization"] = config.quantization
    if config.kv_cache_bytes:
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_bytes)
    if config.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.max_model_len:
        kwargs["max_model_len"] = config.max_model_len
    if config.block_size:
        kwargs["block_size"] = config.block_size
    base: dict[str, Any] = {
        "model": config.model_path,
        "served_model_name": config.served_name,
        "max_num_seqs": config.max_num_seqs,
        "enforce_eager": config.enforce_eager,
        "seed": config.seed,
        # on, vLLM's default: on wherever the model supports it. Forced on, a pooling model
        # with bidirectional attention or MEAN/CLS pooling would run with a cache vLLM warns
        # "may produce incorrect outputs" (workers/prefix_caching.py predicts the same rule)
        "enable_prefix_caching": None if config.enable_prefix_caching else False,
        # off unless its metrics are served (see _count_step_outputs), or vLLM traces requests:
        # its request spans are made from the stats (their absence fails an assertion)
        "disable_log_stats": not (config.stats or config.engine_args.get("otlp_traces_endpoint")),
        "dtype": serving_dtype(config.dtype, stored, quantized, native_half=native_half_precision()),
    }
    if config.task in ("embed", "score"):  # vLLM's pooling runner; a *ForCausalLM checkpoint is converted
        base["runner"] = "pooling"
    else:
        base["structured_outputs_config"] = dict(STRUCTURED_OUTPUTS)
    # the model's own engine arguments over Freight's (workers/bootstrap.py: engine_config)
    return {**base, **kwargs, **config.engine_args}


@dataclass(frozen=True)
class EngineRequest:
    """One request of a run; `key` (the caller's custom_id) must be unique within the run."""

    key: str
    endpoint: str
    body: dict
    parsed: ParsedRequest | None = None
    prompt_token_ids: Sequence[int] | None = None  # rendered at validation: used, not re-rendered
    validated: bool = False  # the body passed validation and is a fresh copy (see parse_body)
    # prefix-cache isolation: requests share cached blocks only with requests of the same salt
    # (vLLM hashes it into the first block); None shares with every unsalted request
    cache_salt: str | None = None
    # the decoded images of the body's image references, by digest (workers/images.py); None: none
    images: Callable[[str], Any] | None = None
    # the stored bytes of an audio line's reference (a file id resolved at validation:
    # workers/media_files.py); None: it has none
    audio: Callable[[str], bytes] | None = None
    # its unit's span as W3C trace headers ({"traceparent": ...}): vLLM's own span of the request
    # becomes its child where the engine traces requests (`Engine.traces_requests`); None: untraced
    trace_headers: Mapping[str, str] | None = None


@dataclass(frozen=True)
class EngineResult:
    """The outcome of one request; token counts are 0 unless status_code is 200."""

    key: str
    status_code: int
    body: dict | None = None
    error: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    adapter: str | None = None  # the LoRA adapter that served it (workers/lora.py); None: the base

    @property
    def ok(self) -> bool:
        return self.status_code == 200


@dataclass(frozen=True)
class EngineStats:
    """A cheap snapshot of the engine's batch and this process's counters.

    ``running`` is the number of requests the last engine step advanced (vLLM's running batch);
    ``waiting`` the rest of what this process has in the engine.
    """

    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0


HALF_DTYPES = ("bfloat16", "float16", "half")


def serving_dtype(requested: str, stored: str | None, quantized: bool, native_half: bool) -> str:
    """vLLM's ``dtype`` for an engine: ``requested`` unless it is ``auto``.

    ``auto`` serves the checkpoint as stored, except a 16-bit unquantized checkpoint on hardware
    without native 16-bit float math, which is served in float32: on an x86 CPU without
    AVX512-BF16 or AMX, vLLM still picks BF16 and its matmuls are emulated (measured on an AVX2
    host: the 16M-parameter bench model 7x and the demo model 2.7x slower than in float32).
    Quantized checkpoints keep their kernels' activation dtype."""
    if requested != "auto" or quantized or native_half:
        return requested
    return "float32" if (stored or "bfloat16") in HALF_DTYPES else "auto"


# The engine running inline in this process, if any. vLLM's distributed state (its model-parallel
# groups) belongs to the process: two inline engines would share it, and the first one's shutdown
# would tear it down under the second (measured: "pipeline model parallel group is not
# initialized" at the second's next step).
_inline_engine: Engine | None = None


def core_inline(core: str) -> bool:
    """Whether vLLM's engine core runs inside this process (FREIGHT_ENGINE_CORE): "inline" or
    "process" as asked; "auto" inline on a CPU unless an inline engine already runs here or this
    process holds what vLLM cannot start beside (`_unscannable_global`). On a CPU the separate core
    buys no overlap (the model's step and the scheduler share the same cores) and costs a process
    start, the model's load in another interpreter and a copy of every request and output through
    ZeroMQ: inline, the demo engine started in 19.5 s instead of 50 s and decoded 1,600 tokens/s
    instead of 1,270 (AVX2 host, 2026-11-27). On a GPU vLLM's own layout is kept."""
    if core == "process":
        return False
    if core == "auto":
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or _inline_engine is not None:
            return False
        blocker = _unscannable_global()
        if blocker is not None:
            log.info("the engine core gets a process of its own: this process holds %s", blocker)
        return blocker is None
    if _inline_engine is not None:
        raise EngineUnsupported(
            f"an engine ({_inline_engine.config.served_name}) already runs inline in this process; "
            "one process holds one inline engine (FREIGHT_ENGINE_CORE=process for more)"
        )
    if (blocker := _unscannable_global()) is not None:
        raise EngineUnsupported(
            f"vLLM cannot start inline in a process holding {blocker} (FREIGHT_ENGINE_CORE=process)"
        )
    return True


def _unscannable_global() -> str | None:
    """A module global vLLM's CPU start-up trips over, as ``module.name``, or None.

    Starting its model runner, vLLM rebinds Triton kernels by scanning every loaded module's
    globals with ``hasattr(value, "__dict__")``, which lets through any error but AttributeError:
    an unbound context proxy (Flask's ``current_app`` outside an app context) raises RuntimeError
    and the start fails. An engine worker imports no such module; a process that also serves HTTP
    (a test run, say) may. The same scan, in the same order, costs tens of milliseconds."""
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        for attr, value in list((namespace or {}).items()):
            try:
                hasattr(value, "__dict__")
            except Exception:
                return f"{name}.{attr}"
    return None


def native_half_precision() -> bool:
    """Whether this machine computes in BF16 natively: GPUs and non-x86 CPUs as vLLM assumes;
    x86 CPUs only with AVX512-BF16 or AMX."""
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu() or current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return True
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


INT4_KERNEL = "cpu_gemm_wna16"  # vLLM's CPU weight-only INT4 matmul (W4A16, GPTQ, AWQ)


def int4_kernel_missing() -> str | None:
    """Why this machine cannot run weight-only INT4 checkpoints, or None if it can.

    vLLM-CPU builds its INT4 kernel only into its AVX-512 extensions: on an AVX2-only x86 CPU an
    INT4 checkpoint loads and then fails at its first step (measured here). GPUs are not checked."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    import torch

    current_platform.import_kernels()  # the extension this CPU gets (_C, _C_AVX512 or _C_AVX2)
    if hasattr(torch.ops._C, INT4_KERNEL):
        return None
    return (
        f"this CPU cannot run INT4 checkpoints: vLLM's build for it has no weight-only INT4 kernel "
        f"({INT4_KERNEL}; vLLM-CPU has one only for AVX-512 CPUs). Serve the unquantized checkpoint "
        "here, or run INT4 models on AVX-512 CPUs or GPUs"
    )


def gpus_missing(config: EngineConfig) -> str | None:
    """Why this worker cannot run the model's tensor x pipeline parallel engine, or None.

    On GPUs a worker owns tensor_parallel_size x pipeline_parallel_size devices, those its
    CUDA_VISIBLE_DEVICES shows it; with fewer, vLLM would fail inside its worker processes with a
    device error far from the cause. Other platforms are left to vLLM."""
    world = int(config.engine_args.get("tensor_parallel_size") or 1) * int(
        config.engine_args.get("pipeline_parallel_size") or 1
    )
    if world <= 1:
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return None
    import torch

    seen = torch.cuda.device_count()
    if seen >= world:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
    return (
        f"tensor_parallel_size x pipeline_parallel_size needs {world} GPUs but this worker sees {seen} "
        f"(CUDA_VISIBLE_DEVICES={visible}): start it with {world} devices in CUDA_VISIBLE_DEVICES"
    )


class EngineUnsupported(RuntimeError):
    """This machine cannot run the checkpoint (raised before vLLM's processes start)."""


class EngineStartFailed(RuntimeError):
    """vLLM refused or failed to start the engine (a model's engine arguments this machine cannot
    honour, say); the message names the model, its engine arguments and vLLM's reason in one line."""


def _start_failure(config: EngineConfig, exc: BaseException, core_error: str) -> EngineStartFailed:
    """One line for the operator: vLLM's own reason. A failure inside vLLM's engine process reaches
    this process only as "Engine core initialization failed"; the engine process's own first error
    (``core_error``, workers/engine_lifetime.py) is the reason then. The traceback is in the log."""
    from workers.engine_args import describe

    causes: list[str] = []
    seen: BaseException | None = None if core_error else exc
    while seen is not None and len(causes) < 4:
        text = (str(seen).strip().splitlines() or [type(seen).__name__])[0]
        if text not in causes:
            causes.append(text)
        seen = seen.__cause__ or seen.__context__
    if core_error:  # the front end's own line says only "see root cause above"
        causes = [f"{core_error.rstrip('.')} (in vLLM's engine process)"]
    args = describe(config.engine_args)
    where = f" with engine args {args}" if args else ""
    return EngineStartFailed(
        f"model {config.served_name!r}: vLLM could not start its engine{where}: {'; '.join(causes)[:600]}"
    )


def _render_and_add(engine: Engine, request: EngineRequest, lora: Any) -> tuple[RenderedRequest, str]:
    """One chat or completions line rendered and handed to vLLM; its vLLM request id."""
    rendered = engine.render(request)
    request_id = f"freight-{next(engine._ids)}"
    engine_input = rendered.engine_input
    if request.cache_salt:
        engine_input = {**engine_input, "cache_salt": request.cache_salt}
    trace = request.trace_headers  # None unless Freight traces this request's unit
    if trace is not None and not engine.traces_requests:
        trace = None
    llm = engine._llm
    try:
        llm.add_request(
            request_id, engine_input, rendered.sampling_params, lora_request=lora, trace_headers=trace
        )
    except BaseException:
        # vLLM registers a request's output before its core takes it: none is to come
        llm.abort_request([request_id])
        raise
    return rendered, request_id


def _error(key: str, status: int, code: str, message: str, param: str | None = None) -> EngineResult:
    return EngineResult(key=key, status_code=status, error={"code": code, "message": message, "param": param})


def _refusal(key: str, exc: Exception, what: str) -> EngineResult:
    """The result of a line the engine could not take (``what``: "the request", "the
    transcription"): the line's own fault as its 4xx, anything else a 500 (logged)."""
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, RequestError):
        return _error(key, exc.status_code, exc.code, exc.message, exc.param)
    # vLLM's input checks (JSON schema, logprobs limit, vocabulary...) blame the request
    if isinstance(exc, (VLLMClientError, ValueError, TypeError)):
        message = str(exc.args[0]) if exc.args else str(exc)
        return _error(key, 400, "invalid_request", message[:1000], getattr(exc, "parameter", None))
    log.exception("%s of %r could not be submitted", what, key)
    return _error(key, 500, "internal_error", f"The engine could not accept {what}: {exc}"[:1000])


@dataclass
class _InFlight:
    key: str
    # PooledLine: an embeddings line (workers/embeddings.py); ScoredLine: a score or rerank line
    # (workers/scoring.py); each is several vLLM requests; TranscribedLine: an audio line (a
    # language detection, then the transcription: workers/transcription.py)
    rendered: RenderedRequest | PooledLine | ScoredLine | TranscribedLine
    seqs: int
    # vLLM's ids of the request: one, or one per input of an embeddings request
    request_ids: list[str] = field(default_factory=list)
    model: str | None = None  # the LoRA adapter that serves it (its response's model); None: the base


@dataclass
class _Counters:
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    advanced: int = 0  # requests the engine core advanced in its last step

    def count(self, result: EngineResult) -> None:
        if result.ok:
            self.finished += 1
        elif result.status_code == ABORTED_STATUS:
            self.aborted += 1
        else:
            self.failed += 1


class _AbortPoll:
    """A run's ``should_abort``, asked at most every ABORT_POLL_SECONDS (False in between, and
    always when there is none)."""

    __slots__ = ("_last_poll", "_should_abort")

    def __init__(self, should_abort: Callable[[], bool] | None) -> None:
        self._should_abort = should_abort
        self._last_poll = float("-inf")

    def __call__(self) -> bool:
        should_abort = self._should_abort
        if should_abort is None or time.monotonic() - self._last_poll < ABORT_POLL_SECONDS:
            return False
        self._last_poll = time.monotonic()
        return bool(should_abort())


def _count_step_outputs(llm: LLMEngine, counters: _Counters) -> None:
    """Count the requests each engine step advanced, from the core's own outputs.

    vLLM's stat logging would give the same figure (``SchedulerStats.num_running_reqs``) but costs
    the front end about a tenth of a small model's throughput on CPU (per-token iteration stats,
    the logging and Prometheus loggers it always adds), so Freight runs with it off and counts.
    """
    core = llm.engine_core
    get_output = core.get_output

    def counted() -> Any:
        outputs = get_output()
        counters.advanced = len(outputs.outputs)
        return outputs

    core.get_output = counted


def _count_preemptions(llm: LLMEngine, engine: Engine) -> None:
    """Count vLLM's preemptions (a running request's KV blocks freed for want of room, its work
    computed again later: what KV-aware admission avoids, workers/kv_gate.py) in
    ``engine.preemptions``, where the scheduler runs in this process (an inline core). With a
    core process of its own they stay None here: vLLM's stat logging counts them
    (``vllm:num_preemptions``, FREIGHT_ENGINE_METRICS_BIND)."""
    scheduler = getattr(getattr(llm.engine_core, "engine_core", None), "scheduler", None)
    preempt = getattr(scheduler, "_preempt_request", None)
    if preempt is None:
        return
    engine.preemptions = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        engine.preemptions = (engine.preemptions or 0) + 1
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counted  # type: ignore[union-attr]


def stats_registry() -> CollectorRegistry:
    """The Prometheus registry vLLM's stat loggers write this process's engine metrics to (the
    global one, unless PROMETHEUS_MULTIPROC_DIR makes vLLM aggregate across processes); filled once
    an engine with `EngineConfig.stats` runs."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()


class Engine:
    """A warm vLLM engine for one model; create it with `Engine.start(config)`."""

    def __init__(self, config: EngineConfig, llm: LLMEngine) -> None:
        self.config = config
        self.dtype = str(llm.model_config.dtype).removeprefix("torch.")  # what it computes in
        self._llm = llm
        self._counters: _Counters = _Counters()
        self._still_running = 0  # requests still running after the last step
        self._kv_bound = False  # the last step left requests waiting with sequence slots free
        self._mean_prompt = 0.0  # prompt tokens of the requests handed over lately (running mean)
        scheduler = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
        self._token_budget = int(getattr(scheduler, "max_num_batched_tokens", None) or 2048)
        self._default_sampling = dict(llm.model_config.get_diff_sampling_param())
        self._ids = itertools.count()  # vLLM request ids: freight-<n>
        self._live: dict[str, _InFlight] = {}  # vLLM request id -> what it is
        self._by_key: dict[str, _InFlight] = {}  # caller's key -> what it is
        self._load = 0  # sequences in the engine
        self._in_flight = 0
        self._running = False
        self._parsers: ModelParsers | None = None  # the model's tool-call and reasoning parsers, if any
        self._shapes = ParsedShapes()  # lines of a shape seen before are not parsed again
        # the base's LoRA adapters, each line's LoRARequest (workers/lora.py); None: a line's model
        # is not read (the worker's start sets it when the registry is at hand)
        self.loras: LoraAdapters | None = None
        self._cross_encoder: Any = None  # vLLM's pair renderer of a "score" model, made at its first line
        self._speech: SpeechLines | None = None  # a "transcribe" model's audio lines, from its first
        self.inline = False  # vLLM's engine core runs inside this process (`core_inline`; see start)
        # the running engine's own configuration (vLLM's VllmConfig): what it was started with, the
        # model's engine arguments applied
        self.vllm_config: Any = llm.vllm_config
        # whether vLLM keeps a prefix cache for this engine (its own decision: see ``start``)
        self.prefix_caching = bool(llm.vllm_config.cache_config.enable_prefix_caching)
        # (blocks a request can hold, tokens per block) of vLLM's KV cache, for admission by KV
        # footprint (workers/kv_gate.py): its blocks but the one null block vLLM keeps; None when
        # vLLM has not said, or keeps no prefix cache (then no prompt block is shared either)
        self.kv_blocks = _kv_blocks(llm.vllm_config.cache_config, self.prefix_caching)
        self.tokenizer: Any = llm.get_tokenizer()  # a Hugging Face tokenizer as wrapped by vLLM
        self.max_model_len = int(llm.model_config.max_model_len)
        self.preemptions: int | None = None  # vLLM's, counted where its scheduler is inline
        # vLLM's own request tracing is on (the model's otlp_traces_endpoint engine argument): a
        # text-generation request's trace_headers are handed to it; off, they are dropped
        self.traces_requests = llm.vllm_config.observability_config.otlp_traces_endpoint is not None

    @classmethod
    def start(cls, config: EngineConfig) -> Engine:
        """Start vLLM's engine (inline or in processes of its own: `core_inline`; call from worker
        start-up, not import)."""
        _set_env_defaults(config)
        from vllm.engine.arg_utils import EngineArgs

        from workers.checkpoint import stored_dtype

        stored, quantized = stored_dtype(config.model_path)
        quantized = quantized or config.quantization is not None
        if quantized and (reason := int4_kernel_missing()) is not None:
            raise EngineUnsupported(f"{config.served_name} ({config.model_path}): {reason}")
        if (reason := gpus_missing(config)) is not None:
            raise EngineUnsupported(f"model {config.served_name!r}: {reason}")
        arguments = engine_arguments(config, stored, quantized)
        inline = core_inline(config.core)
        _choose_core(inline)
        started = time.monotonic()
        fd, error_file = tempfile.mkstemp(prefix="freight-engine-start-")
        os.close(fd)
        os.environ[START_ERROR_ENV] = error_file  # the engine process writes its first error there
        try:
            llm = _new_llm(EngineArgs(**arguments), inline)
        except Exception as exc:
            log.exception("the engine for %s did not start", config.served_name)
            raise _start_failure(config, exc, _read_and_remove(error_file)) from exc
        finally:
            os.environ.pop(START_ERROR_ENV, None)
            _read_and_remove(error_file)
            if inline:  # vLLM seeded this process's `random` with the engine's fixed seed: every
                random.seed()  # worker would draw the same jitter (Celery's retry backoff uses it)
        engine = cls(config, llm)
        if inline:
            global _inline_engine
            _inline_engine = engine
            engine.inline = True
        try:  # checked against the engine's tokenizer, as `vllm serve` checks it at start
            engine._parsers = ModelParsers.load(
                config.tool_call_parser,
                config.engine_args.get("reasoning_parser"),
                llm.get_tokenizer(),
                llm.model_config,
            )
        except Exception as exc:
            engine.shutdown()
            raise EngineStartFailed(
                f"model {config.served_name!r}: tool-call parser {config.tool_call_parser!r}, "
                f"reasoning parser {config.engine_args.get('reasoning_parser')!r}: {exc}"
            ) from exc
        _count_step_outputs(llm, engine._counters)
        _count_preemptions(llm, engine)
        scheduler = llm.vllm_config.scheduler_config
        log.info(
            "engine for %s ready in %.1fs (core %s, max_model_len=%d, max_num_seqs=%d, max_num_batched_tokens=%d, "
            "dtype=%s, kv_cache_dtype=%s, prefix_caching=%s)",
            config.served_name,
            time.monotonic() - started,
            "inline" if engine.inline else "process",
            engine.max_model_len,
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
            engine.dtype,
            llm.vllm_config.cache_config.cache_dtype,
            engine.prefix_caching,
        )
        return engine

    # ------------------------------------------------------------------ properties

    @property
    def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(
            running=c.advanced,
            waiting=max(0, len(self._live) - c.advanced),
            in_flight=self._in_flight,
            finished=c.finished,
            failed=c.failed,
            aborted=c.aborted,
        )

    # ------------------------------------------------------------------ running

    def render(self, request: EngineRequest) -> RenderedRequest:
        """Parse (unless already parsed) and render one request; raises RequestError."""
        parsers = self._parsers
        parsed = request.parsed or self._shapes.parse(
            request.endpoint,
            request.body,
            validated=request.validated,
            auto_tools=parsers is not None and parsers.auto_tools,
            reasoning=parsers is not None and parsers.reasoning,
            scope=request.cache_salt,
        )
        if parsed.endpoint != request.endpoint:
            raise RequestError("invalid_request", "The parsed request is for another endpoint.", "url")
        if request.images is not None and parsed.is_chat:
            inline_images(parsed.request.messages, request.images)
        return render_request(
            parsed,
            self._llm.renderer,
            default_max_tokens=self.config.default_max_tokens,
            default_sampling_params=self._default_sampling,
            prompt_token_ids=request.prompt_token_ids,
            parsers=self._parsers,
            shapes=self._shapes,
            decode_at_end=True,  # where exact, each answer decoded whole once it finishes
        )

    # ------------------------------------------------------------------ feeding

    @property
    def window(self) -> int:
        """Sequences to keep in the engine (running + waiting) so no step finds a free slot idle,
        and no more: the order of the rest stays the feed's to decide (scheduler/engine_window.py)."""
        return engine_window(
            self.config.max_num_seqs,
            self._still_running,
            self._kv_bound and bool(self._live),  # an empty engine (all aborted, say) starts afresh
            self._token_budget,
            self._mean_prompt,
        )

    @property
    def load(self) -> int:
        """Sequences now in the engine (a request with ``n=2`` counts twice)."""
        return self._load

    def add(self, request: EngineRequest) -> EngineResult | None:
        """Hand one request to the engine: None if accepted, else its (400/500) result at once.

        ``request.key`` must be unique among the requests in the engine. Together with `step` and
        `abort` this is the continuous-feeding API: callers top the engine up to `window` between
        steps, so the running batch never drains while work is waiting.
        """
        if request.key in self._by_key:
            raise ValueError(f"request key {request.key!r} is already in the engine")
        submitted = self._submit(request)
        if isinstance(submitted, EngineResult):
            self._counters.count(submitted)
            return submitted
        entry = submitted
        rendered = entry.rendered
        if isinstance(rendered, (PooledLine, ScoredLine, TranscribedLine)):  # tokens per sequence
            prompt = rendered.prompt_tokens // max(1, entry.seqs)
        else:
            prompt = len(rendered.prompt_token_ids)
        self._mean_prompt += (prompt - self._mean_prompt) * (PROMPT_MEAN_WEIGHT if self._mean_prompt else 1.0)
        for request_id in entry.request_ids:
            self._live[request_id] = entry
        self._by_key[entry.key] = entry
        self._load += entry.seqs
        self._in_flight = len(self._live)
        return None

    def step(self) -> list[EngineResult]:
        """One engine step; the results of the requests that finished in it."""
        results: list[EngineResult] = []
        finished = 0
        for output in self._llm.step():
            if not getattr(output, "finished", False):
                continue
            finished += 1
            entry = self._live.pop(output.request_id, None)
            if entry is None:
                continue  # aborted meanwhile
            many = isinstance(entry.rendered, (PooledLine, ScoredLine, TranscribedLine))
            if many and not entry.rendered.collect(output):  # type: ignore[union-attr]
                continue  # an embeddings, scoring or chunked audio line ends with its last sequence
            result = None
            if isinstance(entry.rendered, TranscribedLine) and entry.rendered.detecting:
                assert self._speech is not None  # it submitted the line
                request_id = f"freight-{next(self._ids)}"
                try:  # its language detected: now the audio, a request per chunk
                    chunk_ids = self._speech.transcribe(entry.rendered, output, request_id)
                except Exception as exc:
                    result = _refusal(entry.key, exc, "the transcription")
                else:
                    self._live.update(dict.fromkeys(chunk_ids, entry))
                    self._in_flight = len(self._live)
                    continue
            self._forget(entry)
            if result is None:
                result = _finish(
                    entry, output, entry.model or self.config.served_name, self.tokenizer, self._parsers
                )
            self._counters.count(result)
            results.append(result)
        # the requests still running, and whether vLLM left some waiting with sequence slots free:
        # then its KV cache, not max_num_seqs, is what bounds the batch (see ``window``)
        advanced = self._counters.advanced
        self._still_running = max(0, advanced - finished)
        self._kv_bound = len(self._live) > self._still_running and advanced < self.config.max_num_seqs
        return results

    def abort(self, keys: Iterable[str]) -> list[EngineResult]:
        """Stop these requests (keys not in the engine are ignored); their 499 results."""
        entries = [self._by_key[k] for k in keys if k in self._by_key]
        if not entries:
            return []
        request_ids = [i for entry in entries for i in entry.request_ids if i in self._live]
        self._abort_in_engine(request_ids)
        message = "The run was stopped before this request finished."
        results = []
        for request_id in request_ids:
            self._live.pop(request_id)
        for entry in entries:
            self._forget(entry)
            self._counters.aborted += 1
            results.append(_error(entry.key, ABORTED_STATUS, "aborted", message))
        return results

    def _forget(self, entry: _InFlight) -> None:
        self._by_key.pop(entry.key, None)
        self._load -= entry.seqs
        self._in_flight = len(self._live)

    def run(
        self,
        requests: Iterable[EngineRequest],
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[EngineResult]:
        """Run requests with continuous batching; yield one result per request as each finishes.

        Requests are pulled lazily, keeping about `window` sequences in the engine.
        `should_abort` is polled at most every 0.5 s between engine steps. Closing the
        iterator early aborts what is still in the engine. One run at a time per engine.
        """
        if self._running:
            raise RuntimeError("Engine.run is already in progress; runs cannot overlap")
        self._running = True
        pending = iter(requests)
        mine: set[str] = set()
        exhausted = False
        abort_requested = _AbortPoll(should_abort)

        def stop_everything() -> Iterator[EngineResult]:
            yield from self.abort(list(mine))
            mine.clear()
            message = "The run was stopped before this request finished."
            for request in pending:
                self._counters.aborted += 1
                yield _error(request.key, ABORTED_STATUS, "aborted", message)

        try:
            while True:
                if abort_requested():
                    yield from stop_everything()
                    return
                while not exhausted and (self._load < self.window or not mine):
                    try:
                        request = next(pending)
                    except StopIteration:
                        exhausted = True
                        break
                    rejected = self.add(request)
                    if rejected is not None:
                        yield rejected
                        if abort_requested():  # a long run of bad lines never reaches a step
                            yield from stop_everything()
                            return
                        continue
                    mine.add(request.key)
                if not mine:
                    if exhausted:
                        return
                    continue
                for result in self.step():
                    mine.discard(result.key)
                    yield result
        finally:
            if mine:  # closed early or failed: leave nothing running for the next run
                self.abort(list(mine))
            self._running = False

    def _submit(self, request: EngineRequest) -> _InFlight | EngineResult:
        from vllm.multimodal.cache.base import MultiModalCacheMissError

        key = request.key
        if not serves(self.config.task, request.endpoint):
            what = {
                "embed": "an embedding model",
                "score": "a cross-encoder",
                "transcribe": "a speech model",
            }.get(self.config.task, "a text-generation model")
            return _error(
                key,
                400,
                "invalid_model",
                f"{self.config.served_name} is {what}; it does not serve {request.endpoint}.",
                "model",
            )
        try:
            if request.endpoint == EMBEDDINGS:  # one vLLM pooling request per input of the line
                parsed = request.parsed or parse_body(
                    request.endpoint, request.body, validated=request.validated
                )
                prefix = f"freight-{next(self._ids)}"
                pooled = submit_embeddings(
                    self._llm,
                    parsed.request,
                    request.prompt_token_ids,
                    prefix,
                    request.cache_salt,
                    self._abort_in_engine,
                )
                return _InFlight(key, pooled, len(pooled.request_ids), pooled.request_ids)
            if request.endpoint in SCORING_ENDPOINTS:  # one pooling request per pair (or text)
                return self._submit_scoring(request)
            if request.endpoint in AUDIO_ENDPOINTS:  # Whisper: the audio in the encoder's input
                parsed = request.parsed or parse_body(
                    request.endpoint, request.body, validated=request.validated
                )
                if self._speech is None:
                    config = self.config
                    self._speech = SpeechLines(
                        self._llm,
                        config.max_audio_seconds,
                        config.default_max_tokens,
                        self._default_sampling,
                        self.max_model_len,
                    )
                line = self._speech.submit(parsed.request, f"freight-{next(self._ids)}", request.audio)
                return _InFlight(key, line, len(line.chunks), line.request_ids)
            lora = None if self.loras is None else self.loras.request_for(request.body.get("model"))
            try:
                rendered, request_id = _render_and_add(self, request, lora)
            except MultiModalCacheMissError as miss:
                # vLLM's frontend took these images as sent to the core by a rendering that never
                # reached it (a line refused after it was rendered, as for its context length): it
                # forgets them, and the line is rendered again with its images attached
                cache = self._llm.renderer.mm_processor_cache
                for mm_hash in miss.mm_hashes if cache is not None else ():
                    cache.invalidate(mm_hash)
                rendered, request_id = _render_and_add(self, request, lora)
        except Exception as exc:
            return _refusal(key, exc, "the request")
        return _InFlight(key, rendered, rendered.parsed.n, [request_id], lora and lora.lora_name)

    def _submit_scoring(self, request: EngineRequest) -> _InFlight:
        """A score or rerank line into the engine: pairs on a cross-encoder, texts on an embedding
        model (workers/scoring.py); raises RequestError for the line's fault."""
        parsed = request.parsed or parse_body(request.endpoint, request.body, validated=request.validated)
        if self.config.task == "score" and self._cross_encoder is None:
            self._cross_encoder = cross_encoder(self._llm)
        prefix = f"freight-{next(self._ids)}"
        scored = submit_scoring(
            self._llm, parsed.request, prefix, request.cache_salt, self._abort_in_engine, self._cross_encoder
        )
        return _InFlight(request.key, scored, len(scored.request_ids), scored.request_ids)

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        try:
            self._llm.abort_request(request_ids)
        except Exception:
            log.exception("aborting %d requests in vLLM failed", len(request_ids))

    def shutdown(self) -> None:
        """Stop vLLM's engine (and its processes); the engine is unusable afterwards."""
        global _inline_engine
        llm, self._llm = self._llm, None
        if llm is None:
            return
        self._speech = None  # it holds the engine too
        if _inline_engine is self:
            _inline_engine = None
        self.inline = False
        try:
            # vLLM waits 5 s for its engine process to exit on SIGTERM and it always took them all
            # (the engine core waits on its model-runner process); by now every unit was recorded
            # or handed back (PackRunner.close), so nothing in there is worth a wait
            llm.engine_core.shutdown(timeout=ENGINE_STOP_SECONDS)
        finally:
            try:
                llm.renderer.shutdown()
            except Exception:
                log.debug("renderer shutdown failed", exc_info=True)


def _finish_embeddings(key: str, line: PooledLine | ScoredLine, served_name: str) -> EngineResult:
    """An embeddings or scoring line's result: prompt tokens only, as a pooling line writes none."""
    try:
        body, cached = line.response(served_name)
    except (EmbeddingFailed, ScoringFailed) as exc:
        return _error(key, 500, "internal_error", str(exc))
    except Exception as exc:
        log.exception("response for %r could not be built", key)
        return _error(key, 500, "internal_error", f"The response could not be built: {exc}"[:1000])
    return EngineResult(key, 200, body, prompt_tokens=line.prompt_tokens, cached_tokens=cached)


def _finish_audio(key: str, line: TranscribedLine) -> EngineResult:
    """An audio line's result: the text, usage by the audio's duration (workers/transcription.py)."""
    try:
        body, completion = line.response()
    except TranscriptionFailed as exc:
        return _error(key, 500, "internal_error", str(exc))
    except Exception as exc:
        log.exception("response for %r could not be built", key)
        return _error(key, 500, "internal_error", f"The response could not be built: {exc}"[:1000])
    return EngineResult(key, 200, body, prompt_tokens=line.prompt_tokens, completion_tokens=completion)


def _finish(
    entry: _InFlight, output: Any, served_name: str, tokenizer: Any, parsers: ModelParsers | None
) -> EngineResult:
    """The result of a request the engine finished: its response body in OpenAI's shape."""
    if isinstance(entry.rendered, (PooledLine, ScoredLine)):
        return _finish_embeddings(entry.key, entry.rendered, served_name)
    if isinstance(entry.rendered, TranscribedLine):
        return _finish_audio(entry.key, entry.rendered)
    failed = [c for c in output.outputs if c.finish_reason == "error"]
    if failed or not output.outputs:
        return _error(entry.key, 500, "internal_error", "The engine failed while generating this request.")
    try:
        body = build_response_body(
            entry.rendered,
            output,
            model=served_name,
            tokenizer=tokenizer,
            parsers=parsers,
        )
    except Exception as exc:
        log.exception("response for %r could not be built", entry.key)
        return _error(entry.key, 500, "internal_error", f"The response could not be built: {exc}"[:1000])
    prompt, cached, completion = token_counts(body)
    return EngineResult(
        key=entry.key,
        status_code=200,
        body=body,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        adapter=entry.model,
    )


def _new_llm(args: Any, inline: bool) -> LLMEngine:
    """vLLM's engine for ``args``. An inline core is built on a short-lived thread of its own, so
    that the OpenMP thread pool its start-up makes (model load, profiling, the compile warm-up)
    ends with that thread. The engine loop steps it from another thread (workers/engine_loop.py),
    and OpenMP keeps one pool per thread that starts parallel work: with the starting thread's pool
    alive beside the loop's, the process holds more OpenMP threads than the host has cores, and
    libgomp then lets each pool's threads spin only briefly before they sleep, so the loop's worker
    thread slept and woke at every one of a step's parallel regions and a core stood partly idle
    (bench/README.md, "The engine worker's cores"). The loop's thread then owns the one pool, as
    the thread that starts and steps ``LLM.chat`` does. A core in a process of its own starts on
    the calling thread: the kernel ties the core's death signal to it (workers/engine_lifetime.py).
    """
    from vllm.v1.engine.llm_engine import LLMEngine

    if not inline:
        return LLMEngine.from_engine_args(args, enable_multiprocessing=True)
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            built["llm"] = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
        except BaseException as exc:  # re-raised on the caller's thread
            built["error"] = exc

    thread = threading.Thread(target=build, name="freight-engine-start", daemon=True)
    thread.start()
    thread.join()
    if "error" in built:
        raise built["error"]
    return built["llm"]


def _kv_blocks(cache: Any, prefix_caching: bool) -> tuple[int, int] | None:
    blocks = int(cache.num_gpu_blocks or 0) - 1
    if blocks < 1 or not prefix_caching:
        return None
    return blocks, int(cache.block_size)


def _read_and_remove(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        os.unlink(path)
    except OSError:
        return ""
    return text


def _choose_core(inline: bool) -> None:
    """Tell vLLM where its engine core runs. vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING in several
    places (its CPU platform picks the executor by it), and an inline engine core makes vLLM cache
    its environment variables for the life of the process: the cache is dropped first, so each
    start reads the environment as it is now."""
    from vllm import envs

    envs.disable_envs_cache()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if inline else "1"


def _set_env_defaults(config: EngineConfig) -> None:
    """Environment vLLM reads at start-up; set only where the operator has not."""
    # On CPU vLLM keeps one core for its front end by default; a batch worker has no
    # front end to speak of, so the engine gets every core (see design notes).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # Self-hosted, often air-gapped: no usage reports to vLLM's servers.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # The engine core dies with this process (workers/engine_lifetime.py): it must be spawned,
    # and so are its own workers (the variable is read in both). Forking the core's workers from
    # it instead saved 5.5 s of each start but ran the engine 22% slower on CPU (384 prompts of
    # 300 tokens on models/bench: 14.9 s against 12.2 s, two alternating pairs, 2026-11-26).
    os.environ[PARENT_ENV] = str(os.getpid())
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if config.kv_cache_bytes and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        log.warning(
            "VLLM_CPU_KVCACHE_SPACE=%s overrides kv_cache_bytes=%d on CPU",
            os.environ["VLLM_CPU_KVCACHE_SPACE"],
            config.kv_cache_bytes,
        )
