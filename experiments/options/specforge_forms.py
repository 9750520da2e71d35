"""SpecForge's command lines as facts: the argparse flags of its scripts and CLI, read from source with `ast`
(no torch, no SGLang import), and the check that a composed command uses only flags its release knows.

`python -m experiments.options.specforge_forms extract --repo <SpecForge git dir>` writes
`specforge_flags.json` next to this file: the flag sets of the scripts at the v0.2.0 release commit, at the last
commit that still had `scripts/train_eagle3.py`, and at the mirror's HEAD, with the chat-template names each
registers. CI has no GitHub, so the plan is checked against that committed sheet; the installed wheel's
`specforge/cli.py` is read live with the same extractor.
"""
from __future__ import annotations

import argparse
import ast
import json
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

Reader = Callable[[str], "str | None"]

SHEET = Path(__file__).with_name("specforge_flags.json")
SOURCE = "https://github.com/sgl-project/SpecForge"
# the data scripts every revision has; training went from scripts/train_eagle3.py to the `specforge` CLI
DATA_SCRIPTS = ["scripts/prepare_data.py", "scripts/regenerate_train_data.py", "scripts/prepare_hidden_states.py"]
# label -> (revision, programs whose flags are recorded); the release commit is where version.txt became 0.2.0
REVISIONS = {
    "v0.2.0": ("73e6f808", [*DATA_SCRIPTS, "scripts/train_eagle3.py"]),
    "last-scripts": ("d5883d5b^", [*DATA_SCRIPTS, "scripts/train_eagle3.py"]),
    "head": ("HEAD", [*DATA_SCRIPTS, "specforge/cli.py"]),
}
TEMPLATES = "specforge/data/template.py"
SHELL_OPS = {"&&", "||", ";", "|", "&"}
NO_VALUE = {"store_true", "store_false", "count", "help", "version"}


def git_reader(repo: Path, rev: str) -> Reader:
    """Files of one commit of a (bare) git repository."""
    def read(path: str) -> str | None:
        proc = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{path}"], capture_output=True, text=True)
        return proc.stdout.lstrip("\ufeff") if proc.returncode == 0 else None
    return read


def dir_reader(root: Path) -> Reader:
    """Files of an unpacked tree (the installed wheel)."""
    def read(path: str) -> str | None:
        p = root / path
        return p.read_text().lstrip("\ufeff") if p.is_file() else None
    return read


def _strings(node: ast.AST | None, consts: dict[str, list[str]]) -> list[str] | None:
    """A literal list of strings: constants, tuples/lists of them, module constants, `*CONST` inside a tuple."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.Starred):
        return _strings(node.value, consts)
    if isinstance(node, ast.Tuple | ast.List):
        parts = [_strings(e, consts) for e in node.elts]
        return None if any(p is None for p in parts) else [s for p in parts for s in p]
    return None


def _module_consts(tree: ast.Module) -> dict[str, list[str]]:
    consts: dict[str, list[str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = _strings(stmt.value, consts)
            if value is not None:
                consts[stmt.targets[0].id] = value
    return consts


def _imports(tree: ast.Module) -> dict[str, str]:
    """Imported name -> dotted module it came from."""
    return {a.asname or a.name: n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            for a in n.names}


def _entry(call: ast.Call, consts: dict[str, list[str]], imports: dict[str, str]) -> dict | None:
    names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if not names or not names[0].startswith("-"):
        return None   # a positional argument
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    action = kw.get("action")
    entry = {"names": names, "required": isinstance(kw.get("required"), ast.Constant) and kw["required"].value is True,
             "takes_value": not (isinstance(action, ast.Constant) and action.value in NO_VALUE)}
    if "choices" in kw:
        choices = _strings(kw["choices"], consts)
        if choices is not None:
            entry["choices"] = choices
        else:
            expr = ast.unparse(kw["choices"])
            entry["choices_from"] = f"{imports[expr]}.{expr}" if expr in imports else expr
    return entry


class _Module:
    """One parsed source file, with what a parser helper call needs to be followed into it."""

    def __init__(self, read: Reader, path: str):
        text = read(path)
        if text is None:
            raise FileNotFoundError(path)
        self.read, self.path, self.tree = read, path, ast.parse(text)
        self.consts, self.imports = _module_consts(self.tree), _imports(self.tree)
        self.defs = {n.name: n for n in self.tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}

    def helper(self, call: ast.Call) -> tuple[_Module, ast.FunctionDef] | None:
        """`Cls.add_args(group)` or `add_x_args(group)`: the function that adds to the group, and its module."""
        f = call.func
        cls, name = (f.value.id, f.attr) if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
            else (None, f.id) if isinstance(f, ast.Name) else (None, None)
        if name is None:
            return None
        owner = cls or name
        mod = self if owner in self.defs else self._load(self.imports.get(owner))
        node = mod.defs.get(owner) if mod else None
        if cls and isinstance(node, ast.ClassDef):
            node = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        return (mod, node) if isinstance(node, ast.FunctionDef) else None

    def _load(self, module: str | None) -> _Module | None:
        if not module:
            return None
        for cand in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
            if self.read(cand) is not None:
                return _Module(self.read, cand)
        return None


def _scan(mod: _Module, body: list[ast.stmt], scope: dict[str, str], out: dict, depth: int = 0) -> None:
    """Walk one function body: which variable is which (sub)parser, their add_argument calls, helpers."""
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.Call):
            _bind(node.targets[0].id, node.value, scope)
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "add_argument" and isinstance(f.value, ast.Name) \
                and f.value.id in scope:
            entry = _entry(node, mod.consts, mod.imports)
            entries = out["parsers"].setdefault(scope[f.value.id], [])
            if entry and entry not in entries:
                entries.append(entry)
            continue
        passed = [a.id for a in node.args if isinstance(a, ast.Name) and a.id in scope]
        if passed and not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in scope):
            _follow(mod, node, scope[passed[0]], out, depth)


def _bind(var: str, call: ast.Call, scope: dict[str, str]) -> None:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
    if name == "ArgumentParser":
        scope[var] = ""
    elif name == "add_parser" and call.args and isinstance(call.args[0], ast.Constant):
        scope[var] = str(call.args[0].value)
    elif name in {"add_argument_group", "add_mutually_exclusive_group", "add_subparsers"} and owner in scope:
        scope[var] = scope[owner]


def _follow(mod: _Module, call: ast.Call, parser: str, out: dict, depth: int) -> None:
    found = mod.helper(call) if depth < 4 else None
    if found is None:
        out["unresolved"].append(f"{mod.path}: {ast.unparse(call.func)}(...) adds to a parser; not followed")
        return
    hmod, fn = found
    params = [a.arg for a in fn.args.args if a.arg not in {"self", "cls"}]
    if params:
        _scan(hmod, fn.body, {params[0]: parser}, out, depth + 1)


def program_flags(read: Reader, path: str) -> dict:
    """{"parsers": {subcommand ("" for the main parser): [flag entries]}, "unresolved": [...]} of one program."""
    mod = _Module(read, path)
    out: dict = {"parsers": {}, "unresolved": []}
    for fn in (n for n in ast.walk(mod.tree) if isinstance(n, ast.FunctionDef)):
        _scan(mod, fn.body, {}, out)
    _scan(mod, [s for s in mod.tree.body if not isinstance(s, ast.FunctionDef | ast.ClassDef)], {}, out)
    return out


def chat_templates(read: Reader) -> list[str]:
    """Names registered with `TEMPLATE_REGISTRY.register(name=...)` (or positionally)."""
    text = read(TEMPLATES)
    names = []
    for node in ast.walk(ast.parse(text or "")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register":
            arg = next((k.value for k in node.keywords if k.arg == "name"), node.args[0] if node.args else None)
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.append(arg.value)
    return sorted(set(names))


def _commit(repo: Path, rev: str) -> dict:
    fmt = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%H%n%cI%n%s", rev],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    version = git_reader(repo, fmt[0])("version.txt")
    return {"rev": rev, "commit": fmt[0], "date": fmt[1], "subject": fmt[2],
            "version_txt": version.strip() if version else None}


def extract(repo: Path) -> dict:
    """The fact sheet: per revision, its commit, each program's flags and the chat templates it registers."""
    revisions = {}
    for label, (rev, programs) in REVISIONS.items():
        meta = _commit(repo, rev)
        read = git_reader(repo, meta["commit"])
        revisions[label] = {**meta, "programs": {p: program_flags(read, p) for p in programs},
                            "chat_templates": chat_templates(read)}
    return {"source": SOURCE, "generated_by": "python -m experiments.options.specforge_forms extract --repo <git dir>",
            "revisions": revisions}


def load_sheet(label: str) -> dict:
    return json.loads(SHEET.read_text())["revisions"][label]


def _invocations(line: str, programs: dict) -> list[tuple[str, str, list[str]]]:
    """(program, subcommand, its arguments) for each SpecForge program a shell line runs."""
    tokens = shlex.split(line, comments=True)
    found, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        prog = next((p for p in programs if p.startswith("scripts/") and tok.endswith("/" + p)), None)
        sub = None
        if prog is None and tok.endswith("/scripts/" + Path(tok).name) and tok.endswith(".py"):
            prog = "scripts/" + Path(tok).name   # a script this revision does not have
        if prog is None and tok == "specforge" and i + 1 < len(tokens):
            prog, sub, i = "specforge/cli.py", tokens[i + 1], i + 1
        if prog is not None:
            end = next((j for j in range(i + 1, len(tokens)) if tokens[j] in SHELL_OPS), len(tokens))
            found.append((prog, sub or "", tokens[i + 1:end]))
            i = end
        i += 1
    return found


def _check_args(where: str, entries: list[dict], args: list[str]) -> list[str]:
    by_name = {n: e for e in entries for n in e["names"]}
    problems, used = [], set()
    for k, tok in enumerate(args):
        if not tok.startswith("-") or tok.lstrip("-").replace(".", "").isdigit():
            continue
        name, _, inline = tok.partition("=")
        entry = by_name.get(name)
        if entry is None:
            problems.append(f"{where}: unknown flag {name}")
            continue
        used.update(entry["names"])
        value = inline or (args[k + 1] if k + 1 < len(args) and entry["takes_value"] else None)
        if value is not None and "choices" in entry and value not in entry["choices"]:
            problems.append(f"{where}: {name} {value} is not one of {entry['choices']}")
    missing = [e["names"][-1] for e in entries if e["required"] and not used & set(e["names"])]
    return problems + [f"{where}: required flag {m} not given" for m in missing]


def check_commands(steps: list[str], programs: dict, templates: list[str] | None = None) -> list[str]:
    """Every flag a step passes to a SpecForge program is one that program's parser declares (exact names:
    argparse would also take an abbreviation), literal choices hold, required flags are given, and
    `--chat-template` names a template the revision registers."""
    problems = []
    for line in steps:
        for prog, sub, args in _invocations(line, programs):
            where = f"{prog} {sub}".strip()
            if prog not in programs:
                problems.append(f"{where}: no such program in this revision")
                continue
            parsers = programs[prog]["parsers"]
            if sub not in parsers:
                problems.append(f"{where}: no such subcommand")
                continue
            problems += _check_args(where, parsers[sub], args)
            if templates is not None and "--chat-template" in args:
                name = args[args.index("--chat-template") + 1]
                if name not in templates:
                    problems.append(f"{where}: chat template {name} is not registered here ({', '.join(templates)})")
    return problems


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="write the fact sheet from a SpecForge git mirror")
    ex.add_argument("--repo", type=Path, required=True)
    ex.add_argument("--out", type=Path, default=SHEET)
    args = ap.parse_args(argv)
    sheet = extract(args.repo)
    args.out.write_text(json.dumps(sheet, indent=1) + "\n")
    for label, rev in sheet["revisions"].items():
        unresolved = sum(len(p["unresolved"]) for p in rev["programs"].values())
        print(f"{label}: {rev['commit'][:10]} {rev['date'][:10]} version.txt {rev['version_txt']}, "
              f"{len(rev['programs'])} programs, {len(rev['chat_templates'])} templates, {unresolved} unresolved")


if __name__ == "__main__":
    main()
