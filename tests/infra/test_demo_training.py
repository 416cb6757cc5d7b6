"""The demo model's training (infra/demo_training.py) and build (infra/build_demo_model.py): what it
trains on, what it never learns to emit, and that `make model` serves the committed checkpoint."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from infra import demo_training as dt
from infra.build_demo_model import BOS, PAD, TRAINED, Shape, build, llama_config, special_ids

TOKENIZER = TRAINED / "tokenizer.json"
DOC = '''"""Module {i}: helpers that read and write configuration files."""


def read_config_{i}(path):
    """Return the configuration stored in the file at path, as a dictionary of strings."""
    with open(path) as f:
        return dict(line.split("=", 1) for line in f)


class Writer{i}:
    """Write configuration values to a file, one name and value on each line."""
'''


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


def small_corpus(root: Path, files: int = 12) -> Path:
    for i in range(files):
        (root / f"mod{i}.py").write_text(DOC.format(i=i) * 6)
    (root / "test").mkdir()
    (root / "test" / "test_mod.py").write_text("def test_x():\n    assert True\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "dep.py").write_text("X = 1\n")
    return root


def test_the_corpus_is_the_library_without_tests_demos_or_installed_packages(tmp_path: Path) -> None:
    root = small_corpus(tmp_path)
    found = [p.relative_to(root).as_posix() for p in dt.stdlib_files(root)]
    assert found == sorted(found) and len(found) == 12 and all("/" not in f for f in found)
    real = dt.stdlib_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert len(real) > 300 and not any(
        {"test", "site-packages", "idlelib"} & set(p.relative_to(stdlib).parts) for p in real
    )


def test_the_held_out_split_depends_on_the_path_only() -> None:
    names = [f"pkg/mod{i}.py" for i in range(2000)]
    held = [n for n in names if dt.is_held_out(n, 20)]
    assert 60 < len(held) < 140  # about one in twenty
    assert held == [n for n in reversed(names) if dt.is_held_out(n, 20)][::-1]  # order does not matter


def test_docstring_pairs_answer_chat_questions_and_broken_sources_give_none() -> None:
    pairs = list(dt.docstring_pairs(DOC.format(i=1)))
    assert (
        "read_config_1",
        "Return the configuration stored in the file at path, as a dictionary of strings.",
    ) in pairs
    assert ("Writer1", "Write configuration values to a file, one name and value on each line.") in pairs
    assert list(dt.docstring_pairs("def broken(:\n")) == []
    text = dt.chat_text(random.Random(0), "read_config", "Return the configuration.")
    assert text.startswith("<s>") and text.endswith("<|im_start|>assistant\nReturn the configuration.")
    assert not text.endswith("<|im_end|>\n")  # a turn is never closed: the model is not taught to stop


def test_some_chat_turns_answer_in_compact_json(tokenizer: Tokenizer, tmp_path: Path) -> None:
    corpus = dt.Corpus(tokenizer, dt.TrainConfig(held_out_every=2), small_corpus(tmp_path))
    rng = random.Random(3)
    for _ in range(20):
        text = tokenizer.decode(corpus.chat(rng, False, 256, json_fraction=1.0), skip_special_tokens=False)
        answer = text.split("<|im_start|>assistant\n", 1)[1]
        # compact: exactly what json.dumps writes, no other whitespace for the model to learn
        assert json.dumps(json.loads(answer)) == answer, answer
    plain = tokenizer.decode(corpus.chat(random.Random(3), False, 256), skip_special_tokens=False)
    assert not plain.split("<|im_start|>assistant\n", 1)[1].startswith(("{", "["))


def test_special_tokens_and_padding_are_never_targets(tokenizer: Tokenizer, tmp_path: Path) -> None:
    cfg = dt.TrainConfig(batch=8, seq_len=64, chat_fraction=0.5, held_out_every=2)
    corpus = dt.Corpus(tokenizer, cfg, small_corpus(tmp_path))
    ids = special_ids(tokenizer)
    special = set(ids.values())
    rows, labels = dt.training_batch(corpus, random.Random(1), cfg, False, special, ids[PAD], ids[BOS])
    assert rows.shape == labels.shape == (8, 64)
    assert all(int(r[0]) == ids[BOS] for r in rows)  # every sample starts as a prompt does
    targets = {int(t) for t in labels.flatten()}
    assert not targets & special and -100 in targets
    for row, label in zip(rows.tolist(), labels.tolist(), strict=True):
        for i, token in enumerate(row[1:]):  # each label is the next token, unless it is special
            assert label[i] == (token if token not in special else -100)


def test_training_lowers_held_out_perplexity_and_records_it(tokenizer: Tokenizer, tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    ids = special_ids(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        llama_config(ids, Shape(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128))
    )
    cfg = dt.TrainConfig(steps=40, batch=4, seq_len=64, warmup=5, held_out_every=2, eval_sequences=16)
    record = dt.train(model, tokenizer, set(ids.values()), ids[PAD], ids[BOS], cfg, log=lambda _: None,
                      root=small_corpus(tmp_path))  # fmt: skip
    ppl = record["held_out_perplexity"]
    assert ppl["after"] < ppl["before"] / 4  # the held-out files share the training files' text
    assert record["corpus"]["held_out_files"] >= 1 and record["corpus"]["training_files"] >= 1
    assert record["config"]["steps"] == 40 and record["train_seconds"] > 0


def test_the_build_copies_the_committed_trained_checkpoint(tmp_path: Path) -> None:
    assert build(tmp_path / "demo")
    for f in TRAINED.iterdir():
        assert (tmp_path / "demo" / f.name).read_bytes() == f.read_bytes(), f.name
    record = json.loads((tmp_path / "demo" / "training.json").read_text())
    assert record["held_out_perplexity"]["after"] < 20  # the figure README and docs quote
    assert not build(tmp_path / "demo")  # kept; --force rebuilds
    (tmp_path / "demo" / "training.json").unlink()  # an older build (random weights, or retrained since)
    assert (
        build(tmp_path / "demo")
        and (tmp_path / "demo" / "training.json").read_bytes() == (TRAINED / "training.json").read_bytes()
    )


def test_other_shapes_get_random_weights_and_no_training_record(tmp_path: Path) -> None:
    shape = Shape(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128)
    assert build(tmp_path / "bench", shape=shape)
    assert not (tmp_path / "bench" / "training.json").exists()
    config = json.loads((tmp_path / "bench" / "config.json").read_text())
    assert config["hidden_size"] == 64 and "random weights" in (tmp_path / "bench" / "README.md").read_text()
    assert (tmp_path / "bench" / "tokenizer.json").read_bytes() == TOKENIZER.read_bytes()  # one tokenizer
