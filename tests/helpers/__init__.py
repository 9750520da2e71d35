"""Servers and fixtures the tests share (the fault proxy, busy outsiders, loopback runs; the loopback token server
itself is experiments/bench/loopback.py, re-exported by loopback_server.py)."""
