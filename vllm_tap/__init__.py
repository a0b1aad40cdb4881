"""vllm-tap: taps raw logits and hidden states out of a running vLLM, delivered out of band.

This core package holds what the hooks (inside vLLM), the daemon and the client share: the ring
layout, the wire format and the capture spec. It imports neither torch nor vllm.
"""

__version__ = "0.1.0"
