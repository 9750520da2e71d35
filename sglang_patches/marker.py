"""`reach_marker`: a harmless patch that proves the patches reach SGLang's worker processes.

It wraps `SpeculativeAlgorithm.from_string`, which every scheduler process calls while it starts
(`Scheduler.__init__`, `ModelRunner.__init__`), and, the first time it runs in a process, writes one event
line (pid, process name) to the server log. What it returns is untouched.
"""
from __future__ import annotations

import functools

from sglang_patches import Patch, Targets, When, register

TARGET = "sglang.srt.speculative.spec_info:SpeculativeAlgorithm.from_string"
_seen_in_process: list[bool] = []


def _apply(t: Targets) -> None:
    original = t.get(TARGET)          # bound to the class

    @functools.wraps(original)
    def from_string(cls, name):
        if not _seen_in_process:
            from sglang_patches.applying import EVENT_PREFIX, emit, process_identity
            _seen_in_process.append(True)
            emit(EVENT_PREFIX, {"patch": "reach_marker", "called": TARGET, **process_identity()})
        return original(name)

    from_string.__specws_patch__ = "reach_marker"
    t.replace(TARGET, classmethod(from_string))


register(Patch(
    name="reach_marker",
    fixes="nothing: marks a call every SGLang scheduler process makes at start-up, so the server log shows "
          "which processes ran patched code (proof that patches reach the spawned scheduler/TP workers)",
    link="https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/speculative/spec_info.py",
    sglang_versions=">=0.5.14,<0.6",
    when=When(),
    targets=(TARGET,),
    apply=_apply,
))
