"""Where a plan runs: the bundle's folder on the host ($SPECWS_DEST, default /tmp/specws; `bin/h200 install` lays it
out) and the results' folder ($OUT, default $SPECWS_DEST/out), both set by the host's environment, and the step kinds
every lease plan shares: one run or one multirun through the ordinary runner (the plan's common overrides first,
the step's own after them: Hydra applies overrides in order, so where both set a key the step's value wins), each
followed by the offline store packed into $OUT/runs.tar.gz."""
from __future__ import annotations

import glob
import os
import shutil
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from experiments.plans.steps import Step

RUN = ("python3", "-m", "experiments.run")


@dataclass(frozen=True)
class Host:
    """The bundle's folder and the results' folder of a plan."""
    dest: Path
    out: Path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Host:
        environ = os.environ if environ is None else environ
        dest = Path(environ.get("SPECWS_DEST") or "/tmp/specws")
        return cls(dest, Path(environ.get("OUT") or dest / "out"))

    @property
    def store(self) -> str:
        return f"offline://{self.dest}/runs"

    @property
    def cache(self) -> Path:
        return self.dest / "cache"

    @property
    def done(self) -> Path:
        return self.dest / "plan.done"

    def env(self, keep_pythonpath: bool = False, **extra: str) -> dict[str, str]:
        """This process's environment with the bundle's: its cache, no network, unbuffered output, and the
        bundle's site on PYTHONPATH (keep_pythonpath: unless this process has one)."""
        kept = os.environ.get("PYTHONPATH") if keep_pythonpath else None
        site = kept or str(self.dest / "site")
        return {**os.environ, "SPECWS_CACHE": str(self.cache), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": site, **extra}

    def pack_store(self) -> None:
        """The offline store into $OUT/runs.tar.gz (nothing while there is no store yet)."""
        pack(self.out / "runs.tar.gz", self.dest, ["runs"])


def pack(archive: Path, root: Path, names: Sequence[str]) -> None:
    """The named folders of root that exist into a gzipped tarball."""
    present = [n for n in names if (root / n).exists()]
    if not present:
        return
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name in present:
            tar.add(root / name, arcname=name)


def copy_logs(pattern: str, folder: Path) -> None:
    """Every file matching the glob pattern into folder."""
    for path in glob.glob(pattern):
        shutil.copy(path, folder)


def runner(host: Host, logs: Path, name: str, common: Sequence[str], *overrides: str) -> Step:
    """One measured run through the ordinary runner, then the store packed and its server logs copied to logs."""
    hydra = host.dest / "hydra" / name

    def after() -> None:
        host.pack_store()
        copy_logs(f"{hydra}/*.log", logs)

    return Step(name, (*RUN, *common, *overrides, f"hydra.run.dir={hydra}"), after=after)


def multirun(host: Host, name: str, common: Sequence[str], *overrides: str) -> Step:
    """One Hydra multirun through the ordinary runner, then the store packed."""
    return Step(name, (*RUN, "-m", *common, *overrides, f"hydra.sweep.dir={host.dest / 'sweeps' / name}"),
                after=host.pack_store)


def py(module: str, *args: str) -> tuple[str, ...]:
    """The host's python3 running a module."""
    return ("python3", "-m", module, *args)
