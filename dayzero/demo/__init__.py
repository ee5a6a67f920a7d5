"""A tiny DeepSeek-V4 checkpoint in the real on-disk layout, built locally for tests and the CLI."""
