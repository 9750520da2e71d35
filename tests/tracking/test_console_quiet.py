"""A quiet console (experiments.tracking.console_guard.quiet_console): no MLflow progress bar while artifacts
download, no wrapping at 80 columns when stdout and stderr are pipes, INFO log lines (MLflow's database set-up, a
level's deadline) in the log file and off the console unless verbose; and the heartbeat of a server that is
starting, with the phase read from its log (experiments.harness.server). Each console case runs in a fresh
interpreter whose output is a pipe, beside the same case without quiet_console, which shows what it removes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments.config.paths import ROOT
from experiments.harness.launch import LaunchSpec
from experiments.harness.server import EngineStartError, Server, startup_phase

LONG = "the-start " + "x" * 300 + " the-end"

SCRIPT = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    quiet, verbose, tmp = sys.argv[1] == "quiet", sys.argv[2] == "verbose", Path(sys.argv[3])
    logging.basicConfig(level=logging.INFO, handlers=[logging.StreamHandler(sys.stdout),
                                                     logging.FileHandler(tmp / "job.log")])
    import rich
    from experiments.tracking import lifecycle
    if quiet:
        from experiments.tracking.console_guard import quiet_console
        quiet_console(verbose)
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp / 'm.db'}")
    exp = client.create_experiment("quiet", artifact_location=str(tmp / "art"))
    run = client.create_run(exp).info.run_id
    client.log_text(run, "hello", "records/r.jsonl")
    client.download_artifacts(run, "records", str(tmp))
    logging.getLogger("experiments.harness.client").info("concurrency 1 repetition 0: level deadline 1128 s")
    logging.getLogger("experiments.harness.client").warning("a warning stays on the console")
    lifecycle.console.print("LONG")
    rich.print("LONG")
""").replace("LONG", LONG)


def run_script(tmp: Path, quiet: bool, verbose: bool = False) -> tuple[str, str]:
    """(console output, log file) of SCRIPT in a fresh interpreter, stdout and stderr pipes."""
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "COLUMNS")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, "quiet" if quiet else "loud",
                           "verbose" if verbose else "-", str(tmp)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr, (tmp / "job.log").read_text()


def test_no_progress_bar_no_wrapping_and_info_lines_to_the_log_file_only(tmp_path: Path) -> None:
    quiet, log = run_script(tmp_path / "quiet", quiet=True)
    loud, _ = run_script(tmp_path / "loud", quiet=False)
    # what quiet_console removes is there without it
    assert "Downloading artifacts" in loud and "level deadline 1128 s" in loud
    assert "Creating initial MLflow database tables" in loud and LONG not in loud
    assert "Downloading artifacts" not in quiet and "it/s" not in quiet
    assert [line for line in quiet.splitlines() if LONG in line] == [LONG, LONG]   # each on one line, whole
    assert "level deadline" not in quiet and "Creating initial MLflow database tables" not in quiet
    assert "a warning stays on the console" in quiet
    assert "level deadline 1128 s" in log and "Creating initial MLflow database tables" in log


def test_verbose_shows_the_info_lines(tmp_path: Path) -> None:
    out, _ = run_script(tmp_path / "verbose", quiet=True, verbose=True)
    assert "level deadline 1128 s" in out and "Creating initial MLflow database tables" in out
    assert "Downloading artifacts" not in out


VLLM_LOG = """\
(APIServer pid=3480) INFO 12-05 19:44:27 [model.py:733] Resolved architecture: LlamaForCausalLM
(APIServer pid=3480) WARNING 12-05 19:44:27 [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs
(APIServer pid=3480) INFO 12-05 19:44:27 [compilation.py:317] Enabled custom fusions: norm_quant, act_quant
(EngineCore pid=3496) INFO 12-05 19:44:38 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model=
(Worker pid=3509) INFO 12-05 19:44:49 [cpu_model_runner.py:68] Starting to load model /m/SmolLM2-135M-Instruct...
Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]
(Worker pid=2086) INFO 12-05 21:45:21 [cpu_model_runner.py:87] Warming up model for the compilation...
(EngineCore pid=3496) INFO 12-05 19:44:51 [kv_cache_utils.py:2327] CPU KV cache size: 93,184 tokens
(Worker pid=3509) INFO 12-05 19:44:52 [gpu_model_runner.py:1] Capturing CUDA graphs (decode, FULL): 100%
(APIServer pid=3480) INFO 12-05 19:44:54 [entry.py:140] Starting vLLM server on http://127.0.0.1:30641
"""
PHASES = ["starting Python, importing the engine", "starting Python, importing the engine",
          "starting Python, importing the engine", "initialising the engine", "loading weights", "loading weights",
          "compiling", "allocating the KV cache, warming up", "capturing CUDA graphs", "starting its HTTP server"]


def test_the_phase_is_read_from_the_end_of_the_server_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    assert startup_phase(log) == "no log yet"
    lines = VLLM_LOG.splitlines(keepends=True)
    for n, phase in enumerate(PHASES, start=1):   # a disabled feature or a file name is no phase
        log.write_text("".join(lines[:n]))
        assert startup_phase(log) == phase, lines[n - 1]


def test_a_starting_server_says_how_long_and_in_which_phase(tmp_path: Path, capsys) -> None:
    log = tmp_path / "server.log"
    log.write_text(VLLM_LOG.splitlines(keepends=True)[4])
    server = Server(LaunchSpec("vllm", sys.executable, "x", [], {}, "/health", port=9), log, label="A")
    server.heartbeat_s = 0.3
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(EngineStartError, match="not healthy after 1 s"):
            server._await_health(1.0, 0.1)
    finally:
        server.proc.kill()
        server.proc.wait()
    beats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("A: vllm starting, ")]
    assert len(beats) >= 2 and all(line.endswith(" s: loading weights") for line in beats)


def test_no_level_progress_bar_into_a_log() -> None:
    """A level's progress bar is drawn on a terminal only: into a pipe (a log, CI) nothing of it is written."""
    script = textwrap.dedent("""
        from experiments.harness.client import level_progress
        with level_progress() as progress:
            task = progress.add_task("A concurrency 1", total=2)
            progress.advance(task, 2)
        print("after the level")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "after the level" and "━" not in done.stdout + done.stderr
