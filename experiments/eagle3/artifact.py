"""The committed EAGLE-3 head for the embedded target, so a fresh machine serves option C without training.

    python -m experiments.eagle3.artifact install [--force]   # bin/setup: committed head → the cache
    python -m experiments.eagle3.artifact publish HEAD_DIR     # a trained head (vLLM layout) → the repo

The artifact is the vLLM-layout folder only (config.json, model.safetensors in bf16, specws_eagle3.json with how it
was trained); `install` writes `<cache>/eagle3/heads/smollm2_135m` and its SGLang sibling (aux ids − 1). `install`
leaves an existing head alone unless --force or it is an earlier committed head it installed itself. The committed
head was trained on an H200 (`experiments.eagle3.gpu`, 16,384 template + 24,576 self-written prompts, 2,026 steps;
docs/journal/2026-11-30-cpu/option-d.md §9); `+option=D` trains into `<cache>/eagle3/heads/smollm2_135m-option-d`
and `publish` promotes a head that measures better.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "smollm2_135m"
FILES = ("config.json", "model.safetensors", "specws_eagle3.json")


MARKER = "specws_artifact.sha256"    # written by install: the sha256 of the committed weights it copied


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install(dst: Path | None = None, force: bool = False) -> dict[str, Path] | None:
    """Copy the committed head into the cache; None when one is already there (and not `force`). A head that an
    earlier install copied and nobody changed since (its marker matches its weights) is replaced when the
    committed head changed, so a `git pull` + `bin/setup` serves the new one; any other head is left alone."""
    from experiments.eagle3.data import eagle3_cache
    from experiments.eagle3.export import copy_head

    dst = Path(dst) if dst else eagle3_cache() / "heads" / "smollm2_135m"
    if not (ARTIFACT / "model.safetensors").exists():
        if (dst / "model.safetensors").exists() and not force:
            return None
        raise FileNotFoundError(f"no committed head at {ARTIFACT}: train one with +option=D")
    committed = _sha256(ARTIFACT / "model.safetensors")
    if (dst / "model.safetensors").exists() and not force:
        recorded = (dst / MARKER).read_text().strip() if (dst / MARKER).exists() else None
        if recorded != _sha256(dst / "model.safetensors") or recorded == committed:
            return None       # not a head install copied (or changed since), or already the committed one
    done = copy_head(ARTIFACT, dst)
    (dst / MARKER).write_text(committed + "\n")
    return done


def publish(src: Path) -> Path:
    """Replace the committed artifact with the head in `src` (checked by loading it first)."""
    from experiments.eagle3.export import load_head

    load_head(src)
    ARTIFACT.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if Path(src, name).exists():
            shutil.copyfile(Path(src, name), ARTIFACT / name)
    return ARTIFACT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.eagle3.artifact", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install")
    i.add_argument("--force", action="store_true")
    i.add_argument("--dst", type=Path, default=None)
    pub = sub.add_parser("publish")
    pub.add_argument("src", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "install":
        try:
            done = install(a.dst, a.force)
        except FileNotFoundError as exc:
            print(f"eagle3 head: {exc}")
            return 0
        print(f"eagle3 head installed: {done['vllm']} and {done['sglang']}" if done
              else "eagle3 head: the cache already has one (--force replaces it)")
    else:
        print(f"published to {publish(a.src)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
