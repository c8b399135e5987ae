"""`--config FILE.yaml`, as vLLM's: a YAML mapping of flag names to values.

    # serve.yaml: jaxserve serve --config serve.yaml --port 9000
    model: ./Qwen3-0.6B
    max-num-seqs: 64              # or max_num_seqs
    kv-cache-memory-bytes: 4GiB   # values as they are written on the command line
    enable-prefix-caching: false  # a switch: true or false
    served-model-name: [qwen, default]

Flags on the command line win over the file's values; a key that is no flag of the
command is an error naming it. The file's values are parsed by the command's own parser,
so each is checked (types, choices) as the same flag typed would be.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read flags from a YAML file (keys: flag names, with - or _; values as on the command line); "
        "flags given on the command line win",
    )


def parse_with_config(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`p.parse_args(argv)`, the values of argv's --config file (if any) standing in for the defaults."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    if path is not None:
        p.set_defaults(**config_values(p, path))
    return p.parse_args(argv)


def config_values(p: argparse.ArgumentParser, path: str) -> dict:
    """The flags' values (by dest) the YAML file at `path` sets, parsed by `p`; exits
    through `p.error` on an unreadable file or an unknown key."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        p.error(f"--config: cannot read {path}: {e.strerror}")
    except yaml.YAMLError as e:
        p.error(f"--config {path} is not YAML: {e}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        p.error(f"--config {path}: want a mapping of flag names to values, got a {type(data).__name__}")
    # NOTE: argparse lists its actions in no public attribute.
    flags = {s: a for a in p._actions for s in a.option_strings if s.startswith("--")}
    tokens, dests = [], set()
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = flags.get(flag)
        if action is None or flag in ("--config", "--help"):
            p.error(f"--config {path}: unknown key {key!r}: {p.prog} has no flag {flag}")
        given = flag_tokens(flag, action, value)
        if given is None:
            p.error(f"--config {path}: {key}: {value!r} is not a value for {flag}")
        tokens += given
        if given or isinstance(action, argparse.BooleanOptionalAction):
            dests.add(action.dest)
    parsed = p.parse_args(tokens)
    return {dest: getattr(parsed, dest) for dest in dests}


def flag_tokens(flag: str, action: argparse.Action, value) -> list[str] | None:
    """`value` as the command line would give it to `flag` (None: it cannot be given)."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            return None
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            on, off = action.option_strings[:2]
            return [on if value == (flag == on) else off]
        return [flag] if value else []  # false: as if not given
    if value is None:
        return None
    if isinstance(value, list) and action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = value if isinstance(value, list) else [value]
        return [flag, *map(_text, values)]
    return [flag, _text(value)]


def _text(value) -> str:
    """A YAML value as typed: mappings and lists as JSON (--speculative-config, --allowed-origins)."""
    return json.dumps(value) if isinstance(value, (dict, list, bool)) else str(value)
