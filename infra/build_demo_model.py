"""Build Freight's demo model: a tiny Llama with a locally trained tokenizer.

Why: tests, CI and local demos need a real checkpoint that vLLM (CPU or GPU) and
transformers load like any Hugging Face model, without network access to a model hub.

The demo model (the default shape) is trained on the Python standard library's source
(infra/demo_training.py), so it completes prompts with recognisable words and code and its
quality figures mean something. Training takes about a quarter of an hour on two CPU cores, too
slow for `make run`, so the trained checkpoint is committed in infra/demo_model/ (with
training.json: its configuration, corpus and held-out perplexity) and a build copies it.
`--train` reproduces it. Other shapes (the benchmark models) get random weights (fixed seed):
they measure speed, not text.

Usage:  python infra/build_demo_model.py [OUT_DIR] [--force] [--train] [--hidden N --layers N
            --heads N --kv-heads N --intermediate N]     (default: models/demo, the shape below)
        python infra/build_demo_model.py infra/demo_model --train --force   (refresh the commit)

Idempotent: if OUT_DIR/config.json exists the build is skipped unless --force is given.
The build goes to a temporary sibling directory that is renamed into place at the end,
so an interrupted build never leaves a directory that looks complete.

Shape: hidden 256, 4 layers, 4 attention heads (head_dim 64), 2 KV heads, MLP 768,
vocab 4096, 2048 positions, bf16 safetensors. Every linear dimension is a multiple of
128, so INT4 kernels that need K and N to be multiples of 32 (or 128) apply.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `infra` importable (for --train)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEED = 0
VOCAB_SIZE = 4096
# The trained demo checkpoint, committed (tokenizer, config, bf16 weights, training.json).
TRAINED = Path(__file__).resolve().parent / "demo_model"


@dataclass(frozen=True)
class Shape:
    """Transformer dimensions. The default is the demo model; benchmarks may ask for a larger one
    (`--hidden 512 --layers 8 ...`) so that compute, not per-step overhead, dominates."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768

    def check(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden must divide by heads and heads by kv_heads: {self}")
        for dim in (self.hidden, self.intermediate, self.hidden // self.heads * self.kv_heads):
            if dim % 32:
                raise ValueError(f"every linear dimension must be a multiple of 32 (INT4 kernels): {self}")


MAX_POSITIONS = 2048

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

# ChatML. `content` may be null for assistant turns that only carried tool calls.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A word list to draw English-like sentences from (kept as text: one long list literal is unreadable).
_WORD_TEXT = """
the of and to in a is that for it as was with be by on not he i this are or his from at which
but have an they you were her she there one all we their been has when who will more no if out
so said what up its about into than them can only other new some could time these two may then
do first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go
came right used take three states himself few house use during without again place american
around however home small found thought went say part once general high upon school every does
got united left number course war until always away something fact though water less public put
think almost hand enough far took head yet government system better set told nothing night end
why called didn find look going asked later knew point next program city business give group
toward young days let room president side social present given several order national possible
rather second face per among form important often things looked early white case large become
big need four within felt along children saw best church ever least power development light
thought seemed family interest want members mind country area others done turned although open
problem certain kind began thing whole court seen half service question provide model batch
token request queue worker engine cache prefix result output input file line status error retry
deadline priority price cost budget throughput latency memory storage bucket object upload
download server client document summary answer translate classify extract review report invoice
customer order product
"""
_WORDS = _WORD_TEXT.split()

_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
_PUNCT = [".", ",", "!", "?", ";", ":", " -", " (", ")", "'s", ' "', '"']


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES).capitalize())
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
    text = " ".join(words)
    if rng.random() < 0.3:
        cut = rng.randrange(len(text))
        text = text[:cut] + rng.choice(_PUNCT) + text[cut:]
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!"])


def _json_line(rng: random.Random) -> str:
    obj = {
        rng.choice(_WORDS): rng.choice(
            [rng.randint(-1000, 1000), round(rng.uniform(-10, 10), 3), rng.choice(_WORDS), True, None]
        )
        for _ in range(rng.randint(1, 5))
    }
    if rng.random() < 0.3:
        obj["items"] = [rng.randint(0, 9) for _ in range(rng.randint(0, 4))]
    return json.dumps(obj, indent=rng.choice([None, None, 2]))


def _chat_sample(rng: random.Random) -> str:
    turns = [f"{IM_START}system\n{_sentence(rng)}{IM_END}\n"] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        turns.append(f"{IM_START}user\n{_sentence(rng)}{IM_END}\n")
        turns.append(f"{IM_START}assistant\n{_sentence(rng)} {_sentence(rng)}{IM_END}\n")
    return "".join(turns)


def build_corpus(n_docs: int = 6000, seed: int = SEED) -> list[str]:
    """Deterministic English-like text, digits, punctuation, JSON and ChatML turns."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        kind = rng.random()
        if kind < 0.55:
            docs.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 6))))
        elif kind < 0.75:
            docs.append(_json_line(rng))
        elif kind < 0.9:
            docs.append(_chat_sample(rng))
        else:
            docs.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 9))) for _ in range(8)))
    return docs


def build_tokenizer(out_dir: Path) -> None:
    """Train a byte-level BPE (every UTF-8 string tokenizes) and write HF tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Completions (add_special_tokens=True) get a BOS like Llama; chat prompts get it from
    # the template, because vLLM and transformers render chat with add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [EOS, IM_START],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}, indent=2) + "\n"
    )


def special_ids(tokenizer: Any) -> dict[str, int]:
    """The ids of SPECIAL_TOKENS in a demo tokenizer (a `tokenizers.Tokenizer`)."""
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"not a demo tokenizer: no {missing}")
    return ids


def llama_config(ids: dict[str, int], shape: Shape) -> Any:
    """The transformers config of a model of ``shape`` with the demo tokenizer's special ids: the
    demo and benchmark models' and the embedding model's (infra/build_embed_model.py)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD],
        torch_dtype="bfloat16",
    )


def build_weights(out_dir: Path, ids: dict[str, int], shape: Shape, train: bool = False) -> None:
    """Llama weights (fixed seed), random or trained on the standard library
    (infra/demo_training.py), saved as bf16 safetensors with config files."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    config = llama_config(ids, shape)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    if train:
        from tokenizers import Tokenizer

        from infra.demo_training import TrainConfig, write_record
        from infra.demo_training import train as train_model

        tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
        record = train_model(model, tokenizer, set(ids.values()), ids[PAD], ids[BOS], TrainConfig())
        write_record(out_dir, record)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids[BOS],
        eos_token_id=[ids[IM_END], ids[EOS]],
        pad_token_id=ids[PAD],
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    ).save_pretrained(out_dir)


def build_atomically(out_dir: Path, force: bool, fill: Callable[[Path], None]) -> bool:
    """Have ``fill`` write a model into a temporary sibling of ``out_dir``, then rename it into
    place, so an interrupted build never leaves a directory that looks complete and concurrent
    builds of one directory (test sessions, ``make``) leave one whole result. False when an
    existing build was kept (``force`` rebuilds it)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and not force:
        return False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    try:
        fill(tmp)
        # mkdtemp makes a 0700 directory; a model directory is meant to be shared.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if (out_dir / "config.json").exists() and not force:
            return False  # another process finished the same build first
        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            return False  # lost a race to a concurrent build of the same directory
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def build_on_demo_tokenizer(
    out_dir: Path, force: bool, build_weights: Callable[[Path, dict[str, int]], None], readme: str
) -> bool:
    """A small model of random weights beside the demo tokenizer (the demo embedding model's and
    cross-encoder's recipe): ``build_weights(dir, special token ids)`` writes the weights, and
    ``readme`` says what it is. False when an existing build was kept."""

    def fill(tmp: Path) -> None:
        build_tokenizer(tmp)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        build_weights(tmp, {t: tok.token_to_id(t) for t in SPECIAL_TOKENS})
        (tmp / "README.md").write_text(readme)

    return build_atomically(Path(out_dir), force, fill)


def build_command(
    argv: list[str] | None, description: str, default_dir: str, what: str, build: Callable[[Path, bool], bool]
) -> int:
    """The command line of a model builder: ``OUT_DIR [--force]``, and a line saying what it did."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir", nargs="?", default=default_dir, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if build(Path(args.out_dir), args.force):
        print(f"built {what} in {args.out_dir} ({time.monotonic() - start:.1f} s)")
    else:
        print(f"{args.out_dir}/config.json exists; kept it (use --force to rebuild)")
    return 0


def build(out_dir: Path, force: bool = False, shape: Shape = Shape(), train: bool = False) -> bool:
    """Build into out_dir; returns False when an existing build was kept. The default shape
    copies the committed trained checkpoint unless ``train`` asks to train it again."""
    shape.check()
    copy = shape == Shape() and not train and (TRAINED / "model.safetensors").exists()
    if copy and (Path(out_dir) / "config.json").exists():
        # A copy made before the committed checkpoint changed (or an older random-weight build)
        # is replaced: its training record differs from the committed one.
        mine = Path(out_dir) / "training.json"
        force = force or not mine.exists() or mine.read_bytes() != (TRAINED / "training.json").read_bytes()

    def fill(tmp: Path) -> None:
        if copy:
            for f in TRAINED.iterdir():
                if f.is_file():
                    shutil.copyfile(f, tmp / f.name)
            return
        build_tokenizer(tmp)
        from tokenizers import Tokenizer

        ids = special_ids(Tokenizer.from_file(str(tmp / "tokenizer.json")))
        assert [ids[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS))), ids
        build_weights(tmp, ids, shape, train=train)
        (tmp / "README.md").write_text(
            "Freight demo model: a small Llama trained on the Python standard library's source\n"
            "(held-out perplexity in training.json), with a locally trained byte-level BPE.\n"
            "Built by infra/build_demo_model.py --train.\n"
            if train
            else "Freight model for benchmarks: random weights (seed 0), locally trained byte-level BPE.\n"
            "Built by infra/build_demo_model.py; outputs are noise by design (it measures speed).\n"
        )

    return build_atomically(out_dir, force, fill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default="models/demo", help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    parser.add_argument("--train", action="store_true", help="train the weights (about 15 min on 2 cores)")
    default = Shape()
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(default, name))
    args = parser.parse_args(argv)
    shape = Shape(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    start = time.monotonic()
    try:
        built = build(Path(args.out_dir), force=args.force, shape=shape, train=args.train)
    except ValueError as exc:
        parser.error(str(exc))
    if built:
        print(f"built demo model in {args.out_dir} ({time.monotonic() - start:.1f} s)")
    else:
        print(f"{args.out_dir}/config.json exists; kept it (use --force to rebuild)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
