"""`jaxserve cache {ls,prune}`: what the weight cache holds, and making room.

    jaxserve cache ls                       entries (model, variant, size, last used), the total
    jaxserve cache prune                    old-format entries, then the least recently used past
                                            the cap ($JAXSERVE_CACHE_MAX_BYTES, default 20 GiB)
    jaxserve cache prune --max-bytes 5GiB   ... past 5 GiB instead
    jaxserve cache prune --all              every weight entry and jax's compiled programs (xla/)
    add --dry-run to see what would go; --cache-dir for another cache than $JAXSERVE_CACHE

Also `python -m jaxserve.weights.cache_admin`. Imports no jax.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import sys
from pathlib import Path

from jaxserve.weights import cache
from jaxserve.weights.sizes import format_bytes, parse_bytes

COMPILED = "xla"  # jax's persistent compilation cache (jaxserve.engine.builder.enable_compilation_cache)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxserve cache",
        description="List or prune the converted-weight cache.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("ls", "list the entries"), ("prune", "remove entries to fit a size")):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument(
            "--cache-dir", type=Path, default=None, help="the cache (default $JAXSERVE_CACHE or ~/.cache/jaxserve)"
        )
    prune = sub.choices["prune"]
    how = prune.add_mutually_exclusive_group()
    how.add_argument(
        "--max-bytes",
        type=parse_bytes,
        metavar="SIZE",
        help=f"keep at most SIZE of weights (e.g. 5GiB); default ${cache.MAX_BYTES_ENV} or 20 GiB",
    )
    how.add_argument(
        "--all", action="store_true", help=f"remove every weight entry and the compiled programs ({COMPILED}/)"
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cache_dir = args.cache_dir or cache.default_cache_dir()
    if args.command == "ls":
        list_cache(cache_dir)
    else:
        prune_cache(cache_dir, args.max_bytes, args.all, args.dry_run)
    return 0


def list_cache(cache_dir: Path) -> None:
    entries = cache.list_entries(cache_dir)
    width = max([len("MODEL"), *(len(e.model) for e in entries)])
    print(f"{'MODEL':<{width}}  {'VARIANT':<24}  {'SIZE':>10}  LAST USED")
    for e in sorted(entries, key=lambda e: -e.last_used):
        variant = e.variant + (" (base)" if e.meta.get("lossless") else "")
        print(f"{e.model:<{width}}  {variant:<24}  {format_bytes(e.size):>10}  {_when(e.last_used)}")
    total = sum(e.size for e in entries)
    print(f"total: {len(entries)} entries, {format_bytes(total)} (cap {format_bytes(cache.max_bytes_from_env())})")
    files, size = _compiled(cache_dir)
    if files:
        print(f"compiled programs ({cache_dir / COMPILED}): {files} files, {format_bytes(size)}")


def prune_cache(cache_dir: Path, max_bytes: int | None, everything: bool, dry_run: bool) -> None:
    verb = "would remove" if dry_run else "removed"
    if everything:
        gone = cache.list_entries(cache_dir)
        if not dry_run:
            for entry in gone:
                cache.remove(entry)
    else:
        cap = cache.max_bytes_from_env() if max_bytes is None else max_bytes
        gone = cache.evict_to_fit(cache_dir, cap, dry_run=dry_run)
        stale = [e for e in cache.list_entries(cache_dir) if e.stale and e not in gone]
        if not dry_run:
            for entry in stale:  # old-format entries go whatever the size: nothing reads them
                cache.remove(entry)
        gone += stale
    for entry in gone:
        print(f"{verb} {entry.model} {entry.variant} ({format_bytes(entry.size)})")
    freed = sum(e.size for e in gone)
    files, size = _compiled(cache_dir)
    if everything and files:
        if not dry_run:
            shutil.rmtree(cache_dir / COMPILED, ignore_errors=True)
        print(f"{verb} compiled programs ({files} files, {format_bytes(size)})")
        freed += size
    print(f"{verb} {len(gone)} entries, {format_bytes(freed)}")


def _compiled(cache_dir: Path) -> tuple[int, int]:
    files = [p for p in (cache_dir / COMPILED).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


if __name__ == "__main__":
    sys.exit(main())
