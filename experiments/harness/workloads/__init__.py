"""Workloads: prompt files and datasets -> conversations (formats, loader, sharegpt), token ids (render),
and which conversation is sent when (sampling)."""
