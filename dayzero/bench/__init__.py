"""`dayzero bench`: offline throughput and latency of the engine (or of a server behind --url) over a
random-token workload, in the layout of `sglang.bench_serving` / `vllm bench serve`.

workload.py   the requests: seeded random token ids, fixed or uniformly spread lengths
offline.py    the engine driven step by step under a concurrency limit, every token timed
client.py     the same over HTTP: streaming /v1/completions of an OpenAI-compatible server
baseline.py   the same requests through transformers' generate (--vs transformers)
metrics.py    per-request records and their summary (TTFT, TPOT, ITL, E2E; vLLM's JSON keys)
report.py     the printed report; plot.py the PNG; command.py the command itself
"""
