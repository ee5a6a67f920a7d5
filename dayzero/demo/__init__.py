"""A tiny DeepSeek-V4 checkpoint in the real on-disk layout, built locally for tests and the CLI."""

from dayzero.demo.checkpoint import DEMO_CONFIG, DEMO_VERSION, build_demo_checkpoint, demo_checkpoint

__all__ = ["DEMO_CONFIG", "DEMO_VERSION", "build_demo_checkpoint", "demo_checkpoint"]
