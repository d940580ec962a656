"""The forecast as a short table for a person (``shards plan`` prints it on stderr; the JSON goes to stdout)."""

from __future__ import annotations

from typing import Any

from shards.units import human_bytes


def format_forecast(result: dict[str, Any]) -> str:
    """One line per epoch: requests and bytes to object storage (those read ahead, the byte indexes), reads of local
    files, the node cache, first batch and cost."""
    settings = result["settings"]
    lines = [f"{result['dataset']} [{result['split']}]: {result['samples']:,} samples in {result['shards']:,} shards "
             f"({human_bytes(result['shard_bytes'])}); {settings['world_size']} rank(s) x {settings['workers']} "
             f"worker(s), batch {settings['batch_size']}, byte spans {settings['byte_spans']}"]
    header = f"{'epoch':>5} {'requests':>10} {'bytes':>10} {'ahead':>8} {'index':>7} {'local reads':>11} " \
             f"{'hits':>6} {'misses':>6} {'bypass':>6} {'evict':>6} {'first batch':>11}"
    costs = [name for name in (result.get("cost") or {})]
    lines.append(header + "".join(f" {name[:18]:>18}" for name in costs))
    for epoch in result["epochs"]:
        cache = epoch.get("cache", {})
        first = epoch.get("first_batch_s")
        row = (f"{epoch['epoch']:>5} {epoch['source']['requests']:>10,} {human_bytes(epoch['source']['bytes']):>10} "
               f"{epoch['read_ahead']['requests']:>8,} {epoch['index']['requests']:>7,} "
               f"{epoch['local']['requests']:>11,} "
               f"{_count(cache, 'hits')} {_count(cache, 'misses')} {_count(cache, 'bypasses')} "
               f"{_count(cache, 'evictions')} {'-' if first is None else f'{first:.2f} s':>11}")
        lines.append(row + "".join(f" {epoch['cost'][name]:>18.4f}" for name in costs))
    if result.get("prices"):
        prices = result["prices"]
        lines.append(f"costs in {prices['currency']} at the prices of {prices['date']} (examples: check current "
                     f"prices); total {', '.join(f'{k} {v:.4f}' for k, v in result['cost'].items())}")
    return "\n".join(lines)


def _count(cache: dict[str, Any], name: str) -> str:
    return f"{cache[name]:>6,}" if name in cache else f"{'-':>6}"
