"""The loopback token server the tests start: it lives in experiments/bench/loopback.py (the fidelity benchmark
runs it too); the tests import it from here."""
from experiments.bench.loopback import MODULE, LoopbackServer, prompt_key, reset, sent_times, slow_down, start_loopback

__all__ = ["MODULE", "LoopbackServer", "prompt_key", "reset", "sent_times", "slow_down", "start_loopback"]
