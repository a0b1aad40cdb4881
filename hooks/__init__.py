"""Inside vLLM: the worker plugin that copies opted-in rows into this rank's ring."""
