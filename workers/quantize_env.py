"""llm-compressor's own virtual environment, for calibrated (GPTQ, AWQ) quantization.

llm-compressor pins other versions of transformers and compressed-tensors than vLLM, so it cannot
share the engine's environment. It gets a virtual environment of its own, made once (a few
minutes, about 1.5 GB) with the same CPU build of torch, and is run as a separate interpreter.

    python -m workers.quantize_env PATH     # make it (what `make install` does for the tests)
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

LLMCOMPRESSOR = "llmcompressor==0.14.0.1"
TORCH = "torch==2.13.0"  # the local CPU build; a plain range would pull CUDA wheels
STAMP = ".freight-llmcompressor"
# what llm-compressor pulls in that the CPU build of torch cannot import
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def ready(env: Path) -> bool:
    return (env / STAMP).is_file() and python_of(env).is_file()


def ensure(env: Path, echo=print) -> Path:
    """The environment's interpreter, making the environment first if it is not complete."""
    if ready(env):
        return python_of(env)
    echo(f"making llm-compressor's environment in {env} (once; a few minutes)")
    venv.EnvBuilder(with_pip=True, clear=True).create(env)
    pip = [str(python_of(env)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, LLMCOMPRESSOR], check=True)
    subprocess.run(
        [str(python_of(env)), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED],
        check=False,
        capture_output=True,
    )
    (env / STAMP).write_text(LLMCOMPRESSOR + "\n")
    return python_of(env)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m workers.quantize_env PATH")
    print(ensure(Path(sys.argv[1])))
