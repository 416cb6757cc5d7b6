"""INT4 weight-only (W4A16) checkpoints that vLLM loads on CPU and GPU.

Two ways, both ending in compressed-tensors ``pack-quantized`` (the format and package vLLM pins):

- round-to-nearest, without calibration data: scales from each 128-weight group's absolute
  maximum, computed here with compressed-tensors' own ``calculate_qparams`` and packed by its
  ``ModelCompressor``; no data is needed and nothing is downloaded;
- GPTQ or AWQ, with the user's own calibration prompts: run by llm-compressor, which pins other
  versions of transformers and compressed-tensors than vLLM does, so it runs in its own virtual
  environment (``workers.quantize_env``), fed a file of rendered prompts.

The output is written beside its destination and renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from storage.checkpoint_config import read_config
from storage.registry import quantization_of
from workers.checkpoint import read_header

SCHEMES = ("w4a16",)
METHODS = ("auto", "rtn", "gptq", "awq")
# decoder-only families whose Linear layers vLLM's WNA16 kernels and llm-compressor both handle
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
)
KERNEL_MULTIPLE = 32  # vLLM's CPU WNA16 kernel needs both dimensions of every weight in multiples of 32
UNQUANTIZED = ("embed_tokens", "lm_head", "norm")  # kept at full precision
CALIBRATION_SCRIPT = Path(__file__).with_name("llmcompressor_job.py")

Progress = Callable[[int, int], None]  # (modules done, modules in all)


class QuantizeError(Exception):
    """Why a checkpoint cannot be quantized; the message names the file, tensor or option."""


@dataclass(frozen=True)
class QuantizeRequest:
    source: Path
    destination: Path
    scheme: str = "w4a16"
    group_size: int = 128
    method: str = "auto"  # auto: GPTQ when calibration prompts are given, round-to-nearest without
    calibration: tuple[str, ...] = ()  # rendered prompts (text), at most a few hundred

    @property
    def resolved_method(self) -> str:
        if self.method != "auto":
            return self.method
        return "gptq" if self.calibration else "rtn"


def quantizable(config: dict) -> bool:
    """Whether round-to-nearest INT4 here covers a checkpoint of this config.json (its architecture)."""
    return any(a in ARCHITECTURES for a in config.get("architectures") or [])


def linear_weights(source: Path) -> Iterator[tuple[str, list[int]]]:
    """(name, shape) of every 2-D weight that will be quantized, from the safetensors headers."""
    for file in sorted(source.glob("*.safetensors")):
        for name, info in read_header(file).items():
            if name == "__metadata__" or not name.endswith(".weight") or len(info["shape"]) != 2:
                continue
            if any(part in name.split(".") for part in UNQUANTIZED):
                continue
            yield name, [int(d) for d in info["shape"]]


def check(request: QuantizeRequest) -> dict:
    """Refuse, with the reason, what the quantizer or vLLM's kernels cannot take; the config if fine."""
    if request.scheme not in SCHEMES:
        raise QuantizeError(f"unsupported scheme {request.scheme!r}: supported: {', '.join(SCHEMES)}")
    if request.method not in METHODS:
        raise QuantizeError(f"unsupported method {request.method!r}: supported: {', '.join(METHODS)}")
    if request.resolved_method in ("gptq", "awq") and not request.calibration:
        raise QuantizeError(f"{request.resolved_method} needs calibration prompts (--calibration FILE.jsonl)")
    if request.resolved_method == "awq" and not _has_accelerator():
        raise QuantizeError("awq needs a GPU (llm-compressor's AWQ does not run on a CPU): use gptq here")
    if request.group_size <= 0 or request.group_size % KERNEL_MULTIPLE:
        raise QuantizeError(f"--group-size must be a positive multiple of {KERNEL_MULTIPLE}")
    config_file = request.source / "config.json"
    if not request.source.is_dir():
        raise QuantizeError(f"{request.source}: no such checkpoint directory")
    if not config_file.is_file():
        raise QuantizeError(f"{request.source}: not a checkpoint (no config.json)")
    if request.destination.exists() and any(request.destination.iterdir()):
        raise QuantizeError(f"{request.destination}: already exists and is not empty")
    config = read_config(request.source)
    existing = quantization_of(config)
    if existing != "none":
        raise QuantizeError(f"{request.source}: already quantized ({existing}); register it as it is")
    architectures = config.get("architectures") or []
    if not quantizable(config):
        raise QuantizeError(
            f"{request.source}: architecture {', '.join(architectures) or 'unknown'} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    tensors = list(linear_weights(request.source))
    if not tensors:
        raise QuantizeError(f"{request.source}: no safetensors weights to quantize")
    for name, (out_features, in_features) in tensors:
        if out_features % KERNEL_MULTIPLE or in_features % KERNEL_MULTIPLE:
            raise QuantizeError(
                f"{name}: shape {out_features}x{in_features}: vLLM's INT4 CPU kernel needs both "
                f"dimensions to be multiples of {KERNEL_MULTIPLE}"
            )
        if in_features % request.group_size:
            raise QuantizeError(
                f"{name}: {in_features} input features are not a multiple of --group-size {request.group_size}"
            )
    return config


def _has_accelerator() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def quantize(
    request: QuantizeRequest, progress: Progress | None = None, env_python: Path | None = None
) -> Path:
    """Write the INT4 checkpoint of ``request.source`` to ``request.destination``; returns it."""
    check(request)
    destination = request.destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        if request.resolved_method == "rtn":
            _round_to_nearest(request, staging, progress)
        else:
            if env_python is None:
                raise QuantizeError("calibrated quantization needs llm-compressor's environment")
            _calibrated(request, staging, env_python)
        if quantization_of(read_config(staging)) != "w4a16":
            raise QuantizeError("the written checkpoint does not describe W4A16 weights")
        if destination.exists():
            destination.rmdir()  # empty: check() refused a non-empty one
        staging.rename(destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


def _round_to_nearest(request: QuantizeRequest, out: Path, progress: Progress | None) -> None:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(request.source), dtype=torch.bfloat16)
    group = request.group_size
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    modules = [m for _, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    with torch.no_grad():
        for done, module in enumerate(modules, 1):
            w = module.weight.float()
            groups = w.reshape(w.shape[0], w.shape[1] // group, group)
            scale, zero = calculate_qparams(
                groups.amin(-1), groups.amax(-1), module.quantization_scheme.weights
            )
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
            module.weight_zero_point.copy_(zero.to(module.weight_zero_point.dtype))
            module.quantization_status = QuantizationStatus.FROZEN
            if progress:
                progress(done, len(modules))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(str(request.source)).save_pretrained(str(out))


def _calibrated(request: QuantizeRequest, out: Path, env_python: Path) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(list(request.calibration), f)
        prompts = f.name
    try:
        argv = [
            str(env_python),
            str(CALIBRATION_SCRIPT),
            "--source", str(request.source),
            "--destination", str(out),
            "--method", request.resolved_method,
            "--group-size", str(request.group_size),
            "--prompts", prompts,
        ]  # fmt: skip
        # its progress bars go straight to the user's terminal
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        done = subprocess.run(argv, stdout=sys.stderr, stderr=sys.stderr, env=env, check=False)
        if done.returncode != 0:
            raise QuantizeError(f"llm-compressor {request.resolved_method} failed (exit {done.returncode})")
    finally:
        os.unlink(prompts)
