"""Peak memory of one long forward (16k and 32k tokens) for the long-context recipes, against the unpatched model.

    python benchmarks/bench_long_memory.py                          # L = 16384 and 32768, every recipe
    python benchmarks/bench_long_memory.py --lengths 16384 --recipes unpatched "rope:remap=dca"

The model of issue 53's report: a 2-layer Llama, hidden 64, 4 heads (2 key/value heads), pretrained context
P = 8192 (``max_position_embeddings``), float32, batch 1, eval mode, no gradients, ``attn_implementation="sdpa"``
unpatched. Each (recipe, length) runs in a fresh process: the growth of its resident set's high-water mark
(``VmHWM`` after the forward, less the resident set just before it; Linux) and the forward's wall time. The
target (issue 53): every long recipe within 1.5x the unpatched model's peak plus a constant (``--slack-mib``,
default 64 MiB: the allocator's and the engine's fixed buffers). A recipe that builds an L x L tensor grows by
L² bytes or more (1 GiB at 32k for a bool mask). Prints a table and writes JSON
(``benchmarks/results/long_memory_<device>.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, device_name, slug, versions  # noqa: E402

#: the recipes: "unpatched", or an encoding with its parameters in the study's form (name:key=value,...).
RECIPES = (
    "unpatched",
    "rope",
    "rope:window=8192",
    "rope:window=8192,sink=4",
    "rope:window=8192,sink=4,sink_positions=cache",
    "rope:remap=rerope",
    "rope:remap=leaky_rerope",
    "rope:remap=self_extend",
    "rope:remap=dca",
    "rope:length_scale=logn",
    "rope:window=8192,sink=4,length_scale=logn",
)


def parse_recipe(recipe: str) -> tuple[str | None, dict]:
    """("rope", {"window": 8192, ...}) from "rope:window=8192,...", (None, {}) for "unpatched"."""
    if recipe == "unpatched":
        return None, {}
    name, _, rest = recipe.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        params[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, params


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(recipe: str, length: int, threads: int) -> dict:
    """One forward of ``recipe`` at ``length`` tokens in this process: peak growth (MiB) and seconds."""
    import ctypes
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_posenc

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    name, params = parse_recipe(recipe)
    if name is not None:
        hf_posenc.patch_model(model, name, **params)
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.model(ids[:, :256])  # warm up the kernels' one-time buffers at a short length
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        model.model(ids)  # the base model: the LM head's (L, vocab) logits are not the recipe's
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    return {"recipe": recipe, "length": length, "peak_growth_mib": round((peak - before) / 1024, 1),
            "seconds": round(seconds, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[16384, 32768])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slack-mib", type=float, default=64.0, help="the constant of the 1.5x target")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", nargs=2, metavar=("RECIPE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.threads)))
        return 0
    rows = []
    for length in args.lengths:
        for recipe in args.recipes:
            proc = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--one", recipe,
                                   str(length)], capture_output=True, text=True)
            if proc.returncode != 0:
                row = {"recipe": recipe, "length": length, "error": proc.stderr.strip().splitlines()[-1]}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| recipe | L | peak growth (MiB) | vs unpatched | within 1.5x + slack | forward (s) |")
    print("|---|---:|---:|---:|---|---:|")
    ok = True
    for row in rows:
        base = next((r for r in rows if r["recipe"] == "unpatched" and r["length"] == row["length"]), None)
        if "error" in row or base is None or "error" in base:
            print(f"| `{row['recipe']}` | {row['length']} | error: {row.get('error', 'no baseline')} | | | |")
            ok = False
            continue
        ratio = row["peak_growth_mib"] / max(base["peak_growth_mib"], 1e-9)
        row["ratio"] = round(ratio, 2)
        row["within"] = row["peak_growth_mib"] <= 1.5 * base["peak_growth_mib"] + args.slack_mib
        ok &= row["within"]
        print(f"| `{row['recipe']}` | {row['length']} | {row['peak_growth_mib']} | {ratio:.2f}x | "
              f"{'yes' if row['within'] else 'NO'} | {row['seconds']} |")
    import torch

    dev = device_name(torch.device("cpu"))
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"long_memory_{slug(dev)}.json"
    out.write_text(json.dumps({
        "benchmark": "long_memory", "device_name": dev, "versions": versions(), "threads": args.threads,
        "model": "Llama, 2 layers, hidden 64, 4 heads, 2 kv heads, P = 8192, float32, batch 1, no grad",
        "statistic": "VmHWM after one forward of the base model less VmRSS before it (fresh process per row)",
        "slack_mib": args.slack_mib, "rows": rows,
    }, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
