"""`python -m vllm_tap.cli ...` is `vllm-tap ...`."""

import sys

from vllm_tap.cli.commands import main

sys.exit(main())
