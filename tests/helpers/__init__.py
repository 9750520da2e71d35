"""Servers and fixtures the tests share (the loopback token server); bench scripts use them too."""
