"""Chat output formats per model family: reasoning, tool calls and the grammars that force a call.

output.py: the deltas and the streaming parser's machinery; deepseek.py (V3.1 markers, DSML for V3.2
and V4), kimi.py (Kimi K2 / K3), harmony.py (gpt-oss); formats.py: the formats by name and the one a
checkpoint's template or model type picks. docs/server.md, "Tool calls and reasoning".
"""
