"""`python -m experiments.tracking.slim_store ARCHIVE...`: a lease's offline-store archive repacked as .tar.xz
without the plots (PNG), which the store makes again from its metrics and records (`experiments.analysis.report`
after `import_runs`). Every other member -- records, metrics, params, server logs, links -- goes through as it was,
in the same order with the same metadata, so `import_runs` and `validate` read the slim store as the full one.

The journal keeps stores this way: a lease's plots were a third of the tracked work tree's stores and carried by
every device call."""
from __future__ import annotations

import argparse
import fnmatch
import lzma
import tarfile
from pathlib import Path

DROPPED = ("*.png",)


def slim(archive: Path, out: Path | None = None, dropped: tuple[str, ...] = DROPPED) -> dict[str, int]:
    """Write `archive` without the members matching `dropped` to `out` (default: the same name, .tar.xz);
    returns the sizes before and after and how many members were dropped."""
    out = out or archive.with_name(archive.name.split(".tar")[0] + ".tar.xz")
    tmp = out.with_name(out.name + ".tmp")
    before, removed = archive.stat().st_size, 0
    with tarfile.open(archive, "r:*") as src, lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as raw, \
            tarfile.open(fileobj=raw, mode="w", format=src.format) as dst:
        for member in src:
            if member.isfile() and any(fnmatch.fnmatch(Path(member.name).name, p) for p in dropped):
                removed += 1
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    tmp.replace(out)
    if out != archive:
        archive.unlink()
    return {"before": before, "after": out.stat().st_size, "dropped": removed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archives", nargs="+", type=Path)
    parser.add_argument("--drop", action="append", help=f"file name patterns to leave out (default: {DROPPED})")
    args = parser.parse_args(argv)
    for archive in args.archives:
        result = slim(archive, dropped=tuple(args.drop or DROPPED))
        print(f"{archive}: {result['before']:,} -> {result['after']:,} bytes, {result['dropped']} members dropped")


if __name__ == "__main__":
    main()
