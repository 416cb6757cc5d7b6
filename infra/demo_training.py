"""Train the demo model's weights on text that ships with Python: the standard library's source.

Why: a random-weight model writes noise, which a newcomer reads as "broken", and it makes every
quality figure (INT4 against 16-bit agreement, logprob comparisons) meaningless. A few minutes of
training on the standard library's source and docstrings gives a model that completes prompts
with recognisable words and code, and a held-out perplexity that says how good it is.

The corpus is the standard library of the interpreter that runs this script, without its tests
and demos; files are split into training and held-out sets by a hash of their relative path, so
the split does not depend on the order of a directory listing. Two kinds of sample:
- a window of source text (comments, docstrings and code), starting with BOS as completions do;
- a chat turn in the demo tokenizer's ChatML: the user asks what a function or class does and the
  assistant answers with its docstring, so chat prompts are answered with English; or, in some
  turns, with a compact JSON object about it, so structured outputs close their JSON.
Special tokens are never targets, so training pushes their logits down: the model almost never
ends a turn by itself and outputs run to ``max_tokens``, as the test suite and benchmarks expect
(their token counts stay fixed by the request, not by the model).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import random
import re
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Parts of the standard library that are tests, demos or vendored tools, not library text.
_SKIP_PARTS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "turtledemo",
    "lib2to3",
    "__pycache__",
}
_QUESTIONS = [
    "What does {name} do?",
    "Explain {name}.",
    "Describe {name} in one sentence.",
    "What is {name} for?",
]
_JSON_QUESTIONS = [
    "Describe {name} as JSON.",
    "Answer in JSON: what does {name} do?",
    "Is {name} a class?",
    "Label {name}.",
]
_SYSTEMS = ["You answer in one short sentence.", "You are a helpful assistant.", "Answer briefly."]


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights (with the seed and the Python version)."""

    steps: int = 600
    batch: int = 16  # sequences a step
    seq_len: int = 256  # tokens a sequence, BOS included
    lr: float = 3e-3
    warmup: int = 50  # steps of linear warm-up before the cosine decay
    weight_decay: float = 0.1
    chat_fraction: float = 0.3  # share of sequences that are a chat turn
    json_fraction: float = 0.3  # share of chat turns answered in JSON
    held_out_every: int = 20  # one file in this many (by path hash) is held out
    eval_sequences: int = 64  # held-out windows perplexity is measured on
    seed: int = 0


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, tests and demos left out, in a stable order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_PARTS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(relative: str, every: int) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest()[:8], 16) % every == 0


def docstring_pairs(source: str) -> Iterator[tuple[str, str]]:
    """(qualified name, first paragraph of its docstring) for the functions and classes of a module."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and not node.name.startswith("_"):
                first = doc.split("\n\n")[0].strip()
                if 20 <= len(first) <= 600:
                    yield node.name, " ".join(first.split())


def chat_text(rng: random.Random, name: str, answer: str, questions: list[str] = _QUESTIONS) -> str:
    system = f"<|im_start|>system\n{rng.choice(_SYSTEMS)}<|im_end|>\n" if rng.random() < 0.5 else ""
    question = rng.choice(questions).format(name=name)
    return f"<s>{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}"


def json_answer(rng: random.Random, name: str, doc: str) -> str:
    """A compact JSON answer about a function or class, in one of a few shapes (objects of strings,
    booleans, numbers and lists, and a tool-call list), as structured outputs ask for. Without
    them the model, trained on indented Python, filled a JSON schema's optional whitespace until
    the token budget ran out."""
    kind = "class" if name[:1].isupper() else "function"
    summary = doc.split(". ")[0].rstrip(".") + "."
    words = [w for w in re.findall(r"[a-z]+", doc.lower()) if len(w) > 3]
    shapes: list[Any] = [
        {"name": name, "summary": summary},
        {"name": name, "kind": kind},
        {"label": "yes" if kind == "class" else "no", "name": name},
        {"positive": kind == "function", "kind": kind},
        {"name": name, "tags": words[:3], "count": len(words)},
        {"answer": summary, "score": round(rng.random(), 2)},
        [{"name": name, "parameters": {"text": summary}}],
    ]
    return json.dumps(rng.choice(shapes))


class Corpus:
    """Token streams of the training and held-out files, and the docstring pairs of each."""

    def __init__(self, tokenizer: Any, config: TrainConfig, root: Path | None = None) -> None:
        root = Path(root or sysconfig.get_paths()["stdlib"])
        texts: dict[bool, list[str]] = {False: [], True: []}
        self.pairs: dict[bool, list[tuple[str, str]]] = {False: [], True: []}
        for path in stdlib_files(root):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            held = is_held_out(path.relative_to(root).as_posix(), config.held_out_every)
            texts[held].append(text)
            self.pairs[held].extend(docstring_pairs(text))
        self.tokenizer = tokenizer
        self.files = {k: len(v) for k, v in texts.items()}
        self.tokens = {k: self._stream(v) for k, v in texts.items()}

    def _stream(self, texts: list[str]) -> list[int]:
        ids: list[int] = []
        for enc in self.tokenizer.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
        return ids

    def window(self, rng: random.Random, held: bool, seq_len: int, bos: int) -> list[int]:
        stream = self.tokens[held]
        start = rng.randrange(len(stream) - seq_len)
        return [bos, *stream[start : start + seq_len - 1]]

    def chat(self, rng: random.Random, held: bool, seq_len: int, json_fraction: float = 0.0) -> list[int]:
        name, answer = rng.choice(self.pairs[held])
        if rng.random() < json_fraction:
            text = chat_text(rng, name, json_answer(rng, name, answer), _JSON_QUESTIONS)
        else:
            text = chat_text(rng, name, answer)
        return self.tokenizer.encode(text, add_special_tokens=False).ids[:seq_len]


def training_batch(
    corpus: Corpus, rng: random.Random, cfg: TrainConfig, held: bool, special: set[int], pad: int, bos: int
) -> tuple[Any, Any]:
    import torch

    rows, labels = [], []
    for _ in range(cfg.batch):
        ids = (
            corpus.chat(rng, held, cfg.seq_len, cfg.json_fraction)
            if rng.random() < cfg.chat_fraction
            else corpus.window(rng, held, cfg.seq_len, bos)
        )
        # Targets are the next token; special tokens and padding are never targets (-100).
        target = [t if t not in special else -100 for t in ids[1:]] + [-100]
        pad_n = cfg.seq_len - len(ids)
        rows.append(ids + [pad] * pad_n)
        labels.append(target + [-100] * pad_n)
    return torch.tensor(rows), torch.tensor(labels)


def _loss(model: Any, rows: Any, labels: Any) -> Any:
    import torch.nn.functional as F

    logits = model(input_ids=rows).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, :-1].reshape(-1), ignore_index=-100
    )


def held_out_perplexity(
    model: Any, corpus: Corpus, cfg: TrainConfig, special: set[int], pad: int, bos: int
) -> float:
    """exp(mean next-token loss) over a fixed set of held-out windows (source text only)."""
    import torch

    rng = random.Random(cfg.seed + 1)
    eval_cfg = TrainConfig(**{**asdict(cfg), "batch": 16, "chat_fraction": 0.0})
    losses = []
    model.eval()
    with torch.no_grad():
        for _ in range(max(1, cfg.eval_sequences // eval_cfg.batch)):
            rows, labels = training_batch(corpus, rng, eval_cfg, True, special, pad, bos)
            losses.append(float(_loss(model, rows, labels)))
    model.train()
    return math.exp(sum(losses) / len(losses))


def train(
    model: Any, tokenizer: Any, special_ids: set[int], pad: int, bos: int, cfg: TrainConfig,
    log: Any = print, root: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Train ``model`` (float32, in place) on the standard library (or the .py files under
    ``root``) and return the record written beside the weights."""
    import platform

    import torch

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    t0 = time.monotonic()
    corpus = Corpus(tokenizer, cfg, root)
    log(
        f"corpus: {corpus.files[False]} training files ({len(corpus.tokens[False]):,} tokens), "
        f"{corpus.files[True]} held out ({len(corpus.tokens[True]):,} tokens), {time.monotonic() - t0:.1f} s"
    )
    before = held_out_perplexity(model, corpus, cfg, special_ids, pad, bos)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    start = time.monotonic()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        rows, labels = training_batch(corpus, rng, cfg, False, special_ids, pad, bos)
        loss = _loss(model, rows, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == cfg.steps - 1:
            log(f"step {step}/{cfg.steps} loss {loss.item():.3f} ({time.monotonic() - start:.0f} s)")
    seconds = time.monotonic() - start
    after = held_out_perplexity(model, corpus, cfg, special_ids, pad, bos)
    log(f"held-out perplexity {before:.1f} before training, {after:.2f} after ({seconds:.0f} s)")
    return {
        "config": asdict(cfg),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus": {
            "training_files": corpus.files[False],
            "training_tokens": len(corpus.tokens[False]),
            "held_out_files": corpus.files[True],
            "held_out_tokens": len(corpus.tokens[True]),
        },
        "held_out_perplexity": {"before": round(before, 2), "after": round(after, 3)},
        "train_seconds": round(seconds, 1),
        "machine": platform.processor() or platform.machine(),
    }


def write_record(out_dir: Path, record: dict[str, Any]) -> None:
    (Path(out_dir) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
