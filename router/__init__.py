"""The OpenAI-compatible router: tokenization, prefix-aware (prefill, decode) routing, failover.

Never imports torch, the engine or kvtransfer (a router image installs without them).
"""
