"""Tools around vllm-tap that are not shared formats: benchmarks, the demo, process launchers for
tests and benchmarks, and the tiny random models they use. Package `vllm_tap.tools`; the core
(`vllm_tap`), the daemon and the client never import it."""
