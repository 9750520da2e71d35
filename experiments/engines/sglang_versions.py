"""SGLang flag names by release. Configs and the adapter write today's names (SGLang 0.5.23); the
command line is rewritten for the SGLang installed in the interpreter that will serve it.

Each rename was read in the releases' own `python/sglang/srt/server_args.py` (wheels 0.5.6, 0.5.8, 0.5.9,
0.5.10, 0.5.12, 0.5.13, 0.5.14, 0.5.23); docs/reference/sglang-versions.md lists what was found where.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from functools import cache

from packaging.specifiers import SpecifierSet
from packaging.version import Version


@dataclass(frozen=True)
class FlagRename:
    new: str              # today's name: what configs and the adapter write
    old: str              # the name releases in `old_in` know instead
    old_in: SpecifierSet  # releases that do not know `new`
    why: str


RENAMES: tuple[FlagRename, ...] = (
    FlagRename("--speculative-ngram-max-trie-depth", "--speculative-ngram-branch-length", SpecifierSet("<0.5.10"),
               "0.5.10 renamed branch_length (default 18) to max_trie_depth (default 18) and dropped "
               "--speculative-ngram-{min,max}-match-window-size, whose role max_trie_depth took over"),
    FlagRename("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs", SpecifierSet("<0.5.14"),
               "0.5.14 split CUDA-graph settings into -decode/-prefill, keeping the old name as a deprecated "
               "alias; 0.5.23 no longer accepts the old name"),
    FlagRename("--cuda-graph-bs-decode", "--cuda-graph-bs", SpecifierSet("<0.5.14"),
               "same split as --cuda-graph-max-bs-decode"),
)


def flags_for_version(args: list[str], version: str) -> list[str]:
    """`args` with every renamed flag spelled as `version` knows it (today's name -> old name for older
    releases, and an old name -> today's name for releases that have today's). Values are left alone."""
    v = Version(version)
    out = []
    for arg in args:
        if not arg.startswith("--"):
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        for rename in RENAMES:
            old_release = rename.old_in.contains(v, prereleases=True)
            if old_release and name == rename.new:
                name = rename.old
            elif not old_release and name == rename.old:
                name = rename.new
        out.append(name + eq + value)
    return out


@dataclass(frozen=True)
class InstalledSGLang:
    version: str      # importlib.metadata's version of the `sglang` distribution
    origin: str       # where `import sglang` resolves in that interpreter


_PROBE = ("import importlib.metadata as m, importlib.util as u, json; s = u.find_spec('sglang'); "
          "print(json.dumps(None if s is None else {'version': m.version('sglang'), 'origin': s.origin}))")


def installed_sglang(python: str) -> InstalledSGLang | None:
    """The SGLang that `python` imports with this process's environment (PYTHONPATH included); cached.
    A metadata lookup in a subprocess: it does not import SGLang."""
    return _probe(python, os.environ.get("PYTHONPATH", ""))


@cache
def _probe(python: str, pythonpath: str) -> InstalledSGLang | None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, env=env)
    except OSError:
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return InstalledSGLang(**found) if found else None
