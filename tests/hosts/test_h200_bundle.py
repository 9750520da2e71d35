"""The H200 bundle, built tiny in a temporary folder: its parts arrive one install call at a time, and a joined
file cut short or corrupted between calls is refused by name before anything is installed."""
from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest

from experiments.hosts.h200_bundle import MANIFEST_RESERVE, install, split_parts

MODEL_BYTES = 200 * 1024


def tiny_wheel(folder: Path) -> None:
    """A pure-Python wheel pip installs offline: proof that `install` reached the pip step."""
    info = "tiny_pkg-1.0.dist-info"
    files = {"tiny_pkg/__init__.py": "VALUE = 1\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / "tiny_pkg-1.0-py3-none-any.whl", "w") as zf:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            zf.writestr(name, text)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """Three parts: the model cut in two (p1, p2), the wheel (p3)."""
    staging = tmp_path / "staging"
    (staging / "model").mkdir(parents=True)
    (staging / "wheels").mkdir()
    (staging / "model" / "model.gguf").write_bytes(os.urandom(MODEL_BYTES))
    tiny_wheel(staging / "wheels")
    manifest = split_parts(staging, tmp_path / "parts", MANIFEST_RESERVE + 100 * 1024)
    assert manifest["parts"] == 3 and list(manifest["joined"]) == ["model/model.gguf"]
    return tmp_path / "parts"


def arrive(parts: Path, tmp_path: Path, *names: str) -> Path:
    """The bundle folder of one device call: only the parts that travelled with it."""
    call = tmp_path / f"call-{'-'.join(names) or 'none'}"
    call.mkdir()
    for name in names:
        shutil.copytree(parts / name, call / name)
    return call


def test_parts_arriving_one_call_at_a_time_install_once_complete(bundle: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    assert install(arrive(bundle, tmp_path, "p1"), dest) is False
    assert install(arrive(bundle, tmp_path, "p2"), dest) is False
    assert (dest / "incoming" / "model" / "model.gguf").stat().st_size == MODEL_BYTES
    assert install(arrive(bundle, tmp_path, "p3"), dest) is True
    assert (dest / "site" / "tiny_pkg" / "__init__.py").exists()


@pytest.mark.parametrize("damage", ["cut_short", "corrupted"])
def test_a_joined_file_damaged_between_calls_is_refused_before_anything_is_installed(
        bundle: Path, tmp_path: Path, damage: str) -> None:
    dest = tmp_path / "dest"
    assert install(arrive(bundle, tmp_path, "p1", "p2"), dest) is False
    joined = dest / "incoming" / "model" / "model.gguf"
    data = joined.read_bytes()
    joined.write_bytes(data[: len(data) // 2] if damage == "cut_short" else data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(SystemExit, match="joined model/model.gguf is corrupt"):
        install(arrive(bundle, tmp_path, "p3"), dest)
    assert not (dest / "site").exists()          # nothing installed
    # its chunks are intact: the next call joins it again, verified, and installs
    assert install(arrive(bundle, tmp_path), dest) is True
    assert joined.read_bytes() == data and (dest / "site" / "tiny_pkg").is_dir()


def test_a_corrupt_chunk_is_refused_by_name(bundle: Path, tmp_path: Path) -> None:
    chunk = bundle / "p2" / "model" / "model.gguf.chunk01"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(SystemExit, match=r"model/model.gguf.chunk01 is corrupt"):
        install(arrive(bundle, tmp_path, "p1", "p2", "p3"), tmp_path / "dest")
    assert not (tmp_path / "dest" / "site").exists()
