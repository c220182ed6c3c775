"""Cost of a sliding window in the tile-wise engines on the CPU (issue 22): windowed against full attention.

    python benchmarks/bench_window_cpu.py                        # L = 2048, window 256
    python benchmarks/bench_window_cpu.py --length 4096 --window 512 --repeats 7
    python benchmarks/bench_window_cpu.py --sink 4                # the window with 4 attention sinks (B)

The engines skip the key tiles outside the window (``hf_posenc/kernels/attention/tiled.py``, the CoPE and
stick-breaking tile walks in ``hf_posenc/kernels/_reverse_tiles.py``), so a causal windowed forward costs about
O(L · (window + block)) instead of O(L²/2). Per engine (the attention engine with no term and with ALiBi, CoPE,
stick-breaking), one causal forward, and one forward + backward, of q, k, v (1, 8, L, 32) float32, with
``window=None`` (A) and ``window=W`` (B; with ``--sink S``, ``window=W, sink=S``: the sink keys' tiles are
visited too, those between them and the window still skipped), run A B A B ... (``--repeats`` rounds after one
warmup each); the ratio of the medians is reported, so the drift of a shared machine hits both alike. One torch
thread by default (why: docs/benchmarks.md). Prints a table and writes JSON (default
``benchmarks/results/window_cpu_<device>.json``, ``window_sink<S>_cpu_<device>.json`` with ``--sink``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, slug, versions  # noqa: E402

from hf_posenc.encodings.alibi import alibi_slopes  # noqa: E402
from hf_posenc.kernels.attention import KernelTerm, tiled_attention  # noqa: E402
from hf_posenc.kernels.cope import cope_tiled  # noqa: E402
from hf_posenc.kernels.sba import sba_tiled  # noqa: E402


def engines(h: int, d: int, sink: int | None = None):
    """name -> fn(q, k, v, window) -> (B, H, L, D) (with ``sink`` beside a window)."""
    scale = d**-0.5
    table = torch.randn(d, 64)
    s = lambda w: None if w is None else sink  # noqa: E731
    return {
        "attention (no term)": lambda q, k, v, w: tiled_attention(q, k, v, KernelTerm.none(), scale=scale,
                                                                  causal=True, window=w, sink=s(w)),
        "attention (alibi)": lambda q, k, v, w: tiled_attention(q, k, v, KernelTerm.alibi(alibi_slopes(h)),
                                                                scale=scale, causal=True, window=w, sink=s(w)),
        "cope": lambda q, k, v, w: cope_tiled(q, k, v, table, None, scale, 0, window=w, sink=s(w)),
        "sba": lambda q, k, v, w: sba_tiled(q, k, v, None, scale, 0, window=w, sink=s(w)),
    }


def timed(fn, q, k, v, window, backward: bool) -> float:
    if backward:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        t0 = time.perf_counter()
        fn(q, k, v, window).sum().backward()
        return time.perf_counter() - t0
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(q, k, v, window)
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--sink", type=int, default=None, help="attention sinks beside the window (default: none)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a loaded shared CPU, OpenMP scheduling of 2 threads hides "
                             "the work saved; see docs/benchmarks.md)")
    parser.add_argument("--engines", nargs="+", default=None, help="default: every engine")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, d, n = args.heads, args.head_dim, args.length
    q, k, v = (torch.randn(1, h, n, d) for _ in range(3))
    rows = []
    for name, fn in engines(h, d, args.sink).items():
        if args.engines and not any(e in name for e in args.engines):
            continue
        for backward in (False, True):
            full, windowed = [], []
            timed(fn, q, k, v, None, backward)
            timed(fn, q, k, v, args.window, backward)
            for _ in range(args.repeats):
                full.append(timed(fn, q, k, v, None, backward))
                windowed.append(timed(fn, q, k, v, args.window, backward))
            a, b = statistics.median(full), statistics.median(windowed)
            rows.append({"engine": name, "pass": "fwd+bwd" if backward else "fwd", "full_s": a, "window_s": b,
                         "ratio": b / a})
            print(f"{name:22s} {rows[-1]['pass']:8s} full {a * 1e3:9.1f} ms  window {args.window}"
                  f"{'' if args.sink is None else f' sink {args.sink}'}: "
                  f"{b * 1e3:9.1f} ms  ratio {b / a:.3f}", flush=True)
    device = device_name(torch.device("cpu"))
    result = {"device": device, "threads": args.threads, "length": n, "window": args.window, "sink": args.sink,
              "heads": h,
              "head_dim": d, "repeats": args.repeats, "versions": versions(), "rows": rows}
    name = "window_cpu" if args.sink is None else f"window_sink{args.sink}_cpu"
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"{name}_{slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"device: {device}, {args.threads} threads; wrote {out}")


if __name__ == "__main__":
    main()
