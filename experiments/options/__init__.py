"""Runners of options that are more than one measurement, each named by its option yaml's `runner._target_`:
train_head (D: train an EAGLE-3 head, then evaluate it), specforge_plan (D on the box), budget (E offline).

May import config, harness, tracking, eagle3 and moe.
"""
