"""The demo vision-language model (infra/build_vlm_model.py): what the build writes, and that vLLM
serves it, counting an image's tokens in the prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

from infra.build_demo_model import TRAINED, VOCAB_SIZE
from infra.build_vlm_model import IMAGE, IMAGE_SEQ_LEN, VISION_TOKENS, build

REPO = Path(__file__).resolve().parents[2]

# A square image of any size is 2 x 2 tiles and the whole image shrunk to one: 5 x 16 image tokens,
# and 14 markers (a <fake_token_around_image> and a <row_R_col_C> before each tile, a newline after
# each row and one more, and <fake_token_around_image><global-img> ... <fake_token_around_image>).
SQUARE_IMAGE_TOKENS = 5 * IMAGE_SEQ_LEN + 14

# One process of its own: vLLM's engine, inline (no engine-core process to spawn from pytest),
# leaves nothing behind in the test process.
CHAT = """
import base64, io, json, sys
from PIL import Image
from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], enforce_eager=True, seed=0, max_num_seqs=4,
          kv_cache_memory_bytes=32 * 1024 * 1024)
buf = io.BytesIO()
Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, "PNG")
url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
params = SamplingParams(max_tokens=4, temperature=0)
text = llm.chat([{"role": "user", "content": "What is in the picture?"}], params)[0]
image = llm.chat([{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": url}},
    {"type": "text", "text": "What is in the picture?"},
]}], params)[0]
print("RESULT " + json.dumps({
    "text_prompt_tokens": len(text.prompt_token_ids),
    "image_prompt_tokens": len(image.prompt_token_ids),
    "image_token_ids": image.prompt_token_ids.count(int(sys.argv[2])),
    "answer_tokens": len(image.outputs[0].token_ids),
}))
"""


def test_the_build_is_an_idefics3_on_the_demo_tokenizer_and_is_kept_once_built(tmp_path: Path) -> None:
    out = tmp_path / "vlm"
    assert build(out) is True
    assert build(out) is False  # idempotent: an existing build is kept
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    demo = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
    # the demo vocabulary unchanged, the vision tokens after it, all inside the model's embeddings
    assert all(tok.id_to_token(i) == demo.id_to_token(i) for i in range(VOCAB_SIZE))
    assert [tok.token_to_id(t) for t in VISION_TOKENS] == list(
        range(VOCAB_SIZE, VOCAB_SIZE + len(VISION_TOKENS))
    )
    assert config["image_token_id"] == tok.token_to_id(IMAGE)
    assert tok.get_vocab_size() <= config["text_config"]["vocab_size"]
    assert demo.encode("What does json.dumps do?").ids == tok.encode("What does json.dumps do?").ids

    from transformers import AutoTokenizer, Idefics3Processor

    processor = Idefics3Processor.from_pretrained(str(out))
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"  # no torchvision
    assert processor.image_seq_len == IMAGE_SEQ_LEN
    rendered = AutoTokenizer.from_pretrained(str(out)).apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == "<s><|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n"


def test_vllm_serves_it_and_counts_the_image_in_the_prompt(vlm_model: Path) -> None:
    image_token = Tokenizer.from_file(str(vlm_model / "tokenizer.json")).token_to_id(IMAGE)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    done = subprocess.run(
        [sys.executable, "-c", CHAT, str(vlm_model), str(image_token)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    # the image part is one <image> in the template, which vLLM's processor replaces by the image's
    # tokens: the prompt tokens vLLM reports (and usage counts) include them
    assert result["image_prompt_tokens"] == result["text_prompt_tokens"] + SQUARE_IMAGE_TOKENS
    assert result["image_token_ids"] == 5 * IMAGE_SEQ_LEN
    assert result["answer_tokens"] > 0
