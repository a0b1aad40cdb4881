"""`python -m vllm_tap.cli ...` is `vllm-tap ...`."""

import sys

from .commands import main

sys.exit(main())
