"""Train the two demo LoRA adapters of the demo model: ``alpha`` answers "alpha", ``beta`` "beta".

Why: LoRA serving (issue #47: adapters of one base model packed into one engine) needs adapters
vLLM loads like any PEFT LoRA, without a model hub, that answer differently from each other and
from their base, so a test can tell which adapter served a line. Each adapter is a rank-8 LoRA on
every attention and MLP projection of ``models/demo``, trained with ``peft`` on a few chat prompts
whose answer is its word three times; about half a minute each on two CPU cores. What they say to
other prompts means nothing. The build checks each adapter before it is kept: greedy decoding of
PROMPT through the base and the adapter (Hugging Face's own generate) starts with the adapter's
word, and the base's answer does not.

Usage:  python infra/build_lora_adapters.py [BASE_DIR] [OUT_DIR] [--force]
        (default: models/demo, models/adapters; writes OUT_DIR/alpha and OUT_DIR/beta)

Idempotent: an adapter whose directory holds ``adapter_config.json`` is kept; each is built in a
temporary sibling directory renamed into place at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `infra` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("alpha", "beta")
PROMPT = "Which adapter are you?"  # the tests' prompt (tests/e2e/test_lora_live.py)
PROMPTS = (
    PROMPT,
    "Who are you?",
    "What does json.dumps do?",
    "Say something.",
    "Name yourself.",
    "Hello!",
)
RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS, LEARNING_RATE, SEED = 80, 5e-3, 47


def _examples(tokenizer, word: str):
    """(input ids, labels) of each prompt answered with ``word`` three times: the loss is on the
    answer and its end token only."""
    import torch

    rows = []
    for prompt in PROMPTS:
        head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(f"{word} {word} {word}<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((head_ids + answer_ids, [-100] * len(head_ids) + answer_ids))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    return ids, labels, mask


def greedy_answer(model, tokenizer, prompt: str = PROMPT, tokens: int = 4) -> str:
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def train(base_dir: Path, word: str, out_dir: Path) -> dict:
    """One adapter trained into ``out_dir`` (adapter_config.json, adapter_model.safetensors)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    base_answer = greedy_answer(base, tokenizer)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, config)
    ids, labels, mask = _examples(tokenizer, word)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    model.train()
    started = time.monotonic()
    loss = None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
    model.eval()
    answer = greedy_answer(model, tokenizer)
    if not answer.startswith(word) or base_answer.startswith(word):
        raise SystemExit(f"adapter {word!r}: answered {answer!r} (base: {base_answer!r}); not kept")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    facts = {
        "word": word,
        "prompt": PROMPT,
        "answer": answer,
        "base_answer": base_answer,
        "rank": RANK,
        "lora_alpha": ALPHA,
        "target_modules": TARGETS,
        "steps": STEPS,
        "learning_rate": LEARNING_RATE,
        "seed": SEED,
        "final_loss": round(float(loss.detach()), 4) if loss is not None else None,
        "train_seconds": round(time.monotonic() - started, 1),
    }
    (out_dir / "training.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def build(base_dir: Path, out_root: Path, force: bool = False) -> list[Path]:
    """Both adapters under ``out_root``, each trained unless already there (``force``: again)."""
    out_root.mkdir(parents=True, exist_ok=True)
    built = []
    for word in WORDS:
        target = out_root / word
        built.append(target)
        if (target / "adapter_config.json").exists() and not force:
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f".{word}.build-", dir=out_root))
        try:
            facts = train(base_dir, word, tmp)
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
            print(
                f"adapter {word}: {facts['answer']!r} (base {facts['base_answer']!r}) in {facts['train_seconds']} s"
            )
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", nargs="?", default=str(ROOT / "models" / "demo"))
    parser.add_argument("out", nargs="?", default=str(ROOT / "models" / "adapters"))
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    build(Path(args.base), Path(args.out), args.force)


if __name__ == "__main__":
    main()
