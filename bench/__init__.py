"""``pdserve bench``: a load generator for OpenAI-compatible streaming servers.

Modules: ``tokenizer`` (the model's tokenizer, no torch), ``datasets`` (workloads as plain
sessions of turns), ``client`` (one streamed HTTP request, timed), ``runner`` (arrivals,
concurrency, warm-ups), ``metrics`` (vLLM-compatible TTFT/ITL/TPOT/E2E and goodput),
``report`` (summary table, JSON, sweep plot), ``args`` (the options) and ``serve`` (the
``pdserve bench`` entry point).
"""
