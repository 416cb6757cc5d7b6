"""The pure half of ``freight models tune``: which engine settings a pilot tries, which of them the
host's memory allows, what shape class a sample is, and which measured point wins.

Why a grid and a pilot rather than a formula: the throughput of ``max_num_seqs`` and
``max_num_batched_tokens`` depends on the model, the device and the workload's prompt and output
lengths together, and vLLM's own defaults are picked for a serving latency Freight does not have.
A few engine starts on a sample of the real work settle it; this module decides what to try and
what to keep, the worker module (workers/model_tuning.py) starts the engines and times them.

Every number here is in tokens, sequences or bytes; times are seconds of the measured run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

CPU, GPU = "cpu", "gpu"
# what a point must gain over the previous defaults (and a speculative point over its plain twin)
# to be kept: the pilot's runs are short and a shared machine's drift is about 5% between them
MIN_GAIN = 0.05
# n-gram (prompt lookup) speculation: draft tokens a step and the n-gram window, vLLM's
# SpeculativeConfig fields (prompt_lookup_min..max tokens matched against the context so far)
NGRAM_DRAFT_TOKENS = 4
NGRAM: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": NGRAM_DRAFT_TOKENS,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
# the share of the host's available memory a tuned engine may plan to use (the rest: the worker's
# own process, the tokenizer, the page cache other processes rely on)
HOST_MEMORY_SHARE = 0.8
# vLLM's limits on the GPU memory fraction Freight tries
GPU_MEMORY_UTILIZATIONS = (0.9, 0.95)
# CUDA graph capture sizes tried on a GPU: vLLM's default list up to max_num_seqs, or only the
# powers of two (fewer graphs: faster start, more padding)
CUDA_GRAPH_CHOICES = ("default", "powers_of_two")


@dataclass(frozen=True)
class GridPoint:
    """One engine configuration of the pilot. ``None`` leaves a field at the previous default."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    speculative: bool = False  # vLLM's n-gram prompt-lookup speculation (NGRAM)
    gpu_memory_utilization: float | None = None  # GPU only
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # GPU only

    def engine_args(self) -> dict[str, Any]:
        """The vLLM engine arguments of this point (the fields it sets, as EngineArgs names them)."""
        args: dict[str, Any] = {}
        if self.max_num_seqs is not None:
            args["max_num_seqs"] = self.max_num_seqs
        if self.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.speculative:
            args["speculative_config"] = dict(NGRAM)
        if self.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.cudagraph_capture_sizes is not None:
            args["compilation_config"] = {"cudagraph_capture_sizes": list(self.cudagraph_capture_sizes)}
        return args

    @property
    def label(self) -> str:
        if self.max_num_seqs is None and self.max_num_batched_tokens is None and not self.speculative:
            return "the previous defaults"
        parts = [f"seqs={self.max_num_seqs}", f"tokens={self.max_num_batched_tokens}"]
        if self.gpu_memory_utilization is not None:
            parts.append(f"gpu_mem={self.gpu_memory_utilization:g}")
        if self.cudagraph_capture_sizes is not None:
            parts.append(f"graphs={len(self.cudagraph_capture_sizes)}")
        if self.speculative:
            parts.append("ngram")
        return " ".join(parts)


@dataclass(frozen=True)
class Baseline:
    """The previous defaults the pilot starts from: what a worker would start with untuned."""

    max_num_seqs: int
    max_num_batched_tokens: int
    # fields the operator set on the model (`freight models set-engine`): they win over a tuned
    # value, so the grid leaves them where they are
    explicit: frozenset[str] = frozenset()


def powers_of_two(limit: int) -> tuple[int, ...]:
    sizes, n = [], 1
    while n <= limit:
        sizes.append(n)
        n *= 2
    return tuple(sizes)


def _axis(default: int, factors: Sequence[float], floor: int) -> list[int]:
    values = {max(floor, int(default * f)) for f in factors}
    return sorted(values | {default})


def grid(
    base: Baseline,
    device: str = CPU,
    seqs: Sequence[int] | None = None,
    tokens: Sequence[int] | None = None,
    sample_lines: int | None = None,
) -> tuple[list[GridPoint], list[str]]:
    """The points a pilot measures, the previous defaults first, and the reasons for what it
    leaves out. ``seqs``/``tokens`` replace the default axes (the default, twice and four
    times ``max_num_seqs``; the default and twice ``max_num_batched_tokens``). A point needs
    ``max_num_batched_tokens >= max_num_seqs`` (vLLM refuses fewer), and a sample of at least
    ``max_num_seqs`` lines (``sample_lines``; None: not checked): a sample that cannot fill the
    sequences measures them as if they were fewer, so a point could win by its token budget alone
    and carry a sequence count nothing measured (64 lines run alike at 128 and 256 sequences).
    Speculation is not a grid axis: ``speculative_point`` adds it to the winner."""
    notes: list[str] = []
    seq_axis = list(seqs) if seqs else _axis(base.max_num_seqs, (2, 4), 1)
    token_axis = list(tokens) if tokens else _axis(base.max_num_batched_tokens, (2,), 16)
    for name, axis, default in (
        ("max_num_seqs", seq_axis, base.max_num_seqs),
        ("max_num_batched_tokens", token_axis, base.max_num_batched_tokens),
    ):
        if name in base.explicit and axis != [default]:
            notes.append(f"{name}: set on the model ({default}), which wins over a tuned value: not tuned")
            axis[:] = [default]
    points = [GridPoint(base.max_num_seqs, base.max_num_batched_tokens)]
    for s in seq_axis:
        for t in token_axis:
            point = GridPoint(s, t)
            if t < s:
                notes.append(f"{point.label}: fewer batched tokens than sequences, which vLLM refuses")
            elif sample_lines is not None and s > max(sample_lines, base.max_num_seqs):
                notes.append(
                    f"{point.label}: not measured, the sample's {sample_lines} lines cannot fill "
                    f"{s} sequences (a sample of {s} lines or more measures it)"
                )
            elif point not in points:
                points.append(point)
    if device == GPU:
        points = _gpu_points(points, base)
    else:
        notes.append(
            "gpu_memory_utilization and CUDA graph capture sizes: not tried, no GPU on this host "
            "(the CPU engine's KV cache is a byte size, FREIGHT_ENGINE_KV_CACHE_GIB's or the host's, "
            "and it runs no CUDA graphs)"
        )
    return points, notes


def _gpu_points(points: list[GridPoint], base: Baseline) -> list[GridPoint]:
    """On a GPU each sequence/token point at each memory fraction, and the winner's graph sizes
    (vLLM's default list, or powers of two up to its max_num_seqs) as a variant of the first."""
    out: list[GridPoint] = []
    for p in points:
        for u in GPU_MEMORY_UTILIZATIONS:
            if "gpu_memory_utilization" in base.explicit:
                out.append(p)
                break
            out.append(GridPoint(p.max_num_seqs, p.max_num_batched_tokens, gpu_memory_utilization=u))
    first = out[0]
    out.append(
        GridPoint(
            first.max_num_seqs,
            first.max_num_batched_tokens,
            gpu_memory_utilization=first.gpu_memory_utilization,
            cudagraph_capture_sizes=powers_of_two(first.max_num_seqs or 1),
        )
    )
    return out


def speculative_point(point: GridPoint) -> GridPoint:
    """``point`` with n-gram speculation on."""
    return GridPoint(
        point.max_num_seqs,
        point.max_num_batched_tokens,
        True,
        point.gpu_memory_utilization,
        point.cudagraph_capture_sizes,
    )


@dataclass(frozen=True)
class MemoryFacts:
    """What an engine of the model holds in host memory, from its checkpoint's config.json."""

    available_bytes: int  # the host's available memory now (MemAvailable)
    weight_bytes: int
    kv_cache_bytes: int  # the KV cache the engine reserves (FREIGHT_ENGINE_KV_CACHE_GIB on CPU)
    kv_bytes_per_token: int  # 2 (K and V) x layers x KV heads x head size x element bytes
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    element_bytes: int = 4  # activations in float32 at most


def memory_need(point: GridPoint, facts: MemoryFacts) -> int:
    """Bytes an engine at ``point`` plans to hold: weights, its KV cache, the activations of one
    step of ``max_num_batched_tokens`` tokens (hidden and MLP states, a few live at once) and the
    logits of ``max_num_seqs`` sequences (times the draft tokens under speculation)."""
    tokens = point.max_num_batched_tokens or facts.max_model_len
    seqs = point.max_num_seqs or 1
    drafts = 1 + (NGRAM_DRAFT_TOKENS if point.speculative else 0)
    activations = 4 * tokens * (facts.hidden_size + facts.intermediate_size) * facts.element_bytes
    logits = seqs * drafts * facts.vocab_size * facts.element_bytes
    return facts.weight_bytes + facts.kv_cache_bytes + activations + logits


def unfit(point: GridPoint, facts: MemoryFacts) -> str | None:
    """Why the host cannot hold ``point``, or None. Its memory need must be within
    HOST_MEMORY_SHARE of the available memory, and its KV cache must hold one block of each of
    its sequences and one sequence of the model's full length (vLLM refuses to start otherwise)."""
    need = memory_need(point, facts)
    allowed = int(facts.available_bytes * HOST_MEMORY_SHARE)
    if need > allowed:
        return f"{point.label}: needs about {need / 2**30:.2f} GiB, over {allowed / 2**30:.2f} GiB of this host's memory"
    if facts.kv_bytes_per_token and facts.kv_cache_bytes:
        kv_tokens = facts.kv_cache_bytes // facts.kv_bytes_per_token
        if kv_tokens < facts.max_model_len:
            return f"{point.label}: the KV cache holds {kv_tokens} tokens, under one {facts.max_model_len}-token sequence"
    return None


def fitting(points: Iterable[GridPoint], facts: MemoryFacts) -> tuple[list[GridPoint], list[str]]:
    """The points the host can hold, and why each other one is left out."""
    kept, notes = [], []
    for p in points:
        reason = unfit(p, facts)
        if reason is None:
            kept.append(p)
        else:
            notes.append(reason)
    return kept, notes


@dataclass(frozen=True)
class SampleShape:
    """What a sample's requests looked like on the engine (from the previous defaults' run)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


SHORT_PROMPT, LONG_PROMPT = 256, 2048  # tokens
SHORT_OUTPUT, LONG_OUTPUT = 16, 128  # tokens
SHARED = 0.5  # cached share of prompt tokens from which a sample counts as prefix-shared


def shape_class(shape: SampleShape) -> str:
    """The class a sample's tuned settings are stored under: its mean prompt length, mean output
    length and prefix sharing, each in a few buckets (``prompt-long.output-short.shared``), so a
    real file and a synthetic shape of the same profile share one entry."""
    n = max(1, shape.requests)
    prompt, output = shape.prompt_tokens / n, shape.output_tokens / n
    p = "short" if prompt < SHORT_PROMPT else "medium" if prompt < LONG_PROMPT else "long"
    o = "short" if output <= SHORT_OUTPUT else "medium" if output <= LONG_OUTPUT else "long"
    shared = shape.prompt_tokens and shape.cached_tokens / shape.prompt_tokens >= SHARED
    return f"prompt-{p}.output-{o}.{'shared' if shared else 'unique'}"


@dataclass(frozen=True)
class Measurement:
    """One point's timed run of the sample (``error``: it did not start or failed a request)."""

    point: GridPoint
    seconds: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of the measured run: the sample is the same at every point
        (greedy, fixed budgets), so this ranks the points as their run times do."""
        return self.output_tokens / self.seconds if self.seconds > 0 and self.error is None else 0.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine_args": self.point.engine_args(), "label": self.point.label}
        if self.error is not None:
            out["error"] = self.error
        else:
            out.update(seconds=round(self.seconds, 3), output_tokens=self.output_tokens,
                       prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                       tokens_per_second=round(self.tokens_per_second, 2))  # fmt: skip
        return out


@dataclass(frozen=True)
class Choice:
    """The pilot's verdict: the point kept and what it and the previous defaults measured."""

    best: Measurement
    baseline: Measurement
    notes: list[str] = field(default_factory=list)

    @property
    def engine_args(self) -> dict[str, Any]:
        """What is stored: the kept point's fields that differ from the previous defaults."""
        base = self.baseline.point.engine_args()
        return {k: v for k, v in self.best.point.engine_args().items() if base.get(k) != v}

    @property
    def gain(self) -> float:
        b = self.baseline.tokens_per_second
        return self.best.tokens_per_second / b if b > 0 else 0.0


def choose(measurements: Sequence[Measurement], min_gain: float = MIN_GAIN) -> Choice:
    """The fastest point, kept only where it beats the previous defaults (the first measurement)
    by ``min_gain``; a speculative point also has to beat its plain twin by as much, else the twin
    stands. Otherwise the defaults stand (and the stored settings are empty). Raises ValueError
    when the defaults themselves did not run: nothing is comparable then."""
    if not measurements or measurements[0].error is not None:
        reason = measurements[0].error if measurements else "nothing measured"
        raise ValueError(f"the previous defaults did not run, so nothing can be compared: {reason}")
    baseline = measurements[0]
    notes: list[str] = []
    plain = {m.point: m for m in measurements if not m.point.speculative and m.error is None}
    candidates = []
    for m in measurements:
        if m.error is not None:
            continue
        if m.point.speculative:
            twin = plain.get(GridPoint(m.point.max_num_seqs, m.point.max_num_batched_tokens, False,
                                       m.point.gpu_memory_utilization, m.point.cudagraph_capture_sizes))  # fmt: skip
            if twin is not None and m.tokens_per_second < twin.tokens_per_second * (1 + min_gain):
                notes.append(
                    f"n-gram speculation: {m.tokens_per_second:.1f} tok/s against {twin.tokens_per_second:.1f} "
                    f"without, under the {min_gain:.0%} margin: not kept"
                )
                continue
        candidates.append(m)
    best = max(candidates, key=lambda m: m.tokens_per_second)
    if best is not baseline and best.tokens_per_second < baseline.tokens_per_second * (1 + min_gain):
        notes.append(
            f"best point {best.point.label} measured {best.tokens_per_second:.1f} tok/s against "
            f"{baseline.tokens_per_second:.1f} at the previous defaults, under the {min_gain:.0%} margin: "
            "the defaults stand"
        )
        best = baseline
    return Choice(best, baseline, notes)
