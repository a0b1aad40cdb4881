"""Subscribe to captures from the daemon (numpy only; no torch, no vllm)."""
