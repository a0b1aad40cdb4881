"""Click options for `vllm-tap daemon`: --config plus one flag per DaemonConfig field.

Generated from the dataclass so a new setting gets its flag (and its help, from DOCS) for free.
Every flag is a plain string defaulting to None: load_config parses it exactly like an environment
value and treats None as "not given", which is what keeps file < environment < flags.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import click

from .config import DaemonConfig
from .config_load import DEFAULT_CONFIG_PATH, DOCS, env_var, flag_name


def config_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Adds `config_path` and one keyword argument per DaemonConfig field to the command."""
    for field in reversed(dataclasses.fields(DaemonConfig)):
        help_text = f"{DOCS.get(field.name, '')} [env {env_var(field.name)}]".strip()
        if field.type in (bool, "bool"):  # --x / --no-x; absent means "not given" (None)
            flag = flag_name(field.name)
            f = click.option(f"{flag}/--no-{flag[2:]}", field.name, default=None, help=help_text)(f)
            continue
        f = click.option(flag_name(field.name), field.name, default=None, metavar="VALUE", help=help_text)(f)
    return click.option(
        "--config", "config_path", default=None, metavar="FILE",
        help=f"TOML settings file (default {DEFAULT_CONFIG_PATH}, if it exists).",
    )(f)
