"""Peak memory of the encodings' PyTorch references at long inputs, against the memory pre-check's estimate.

    python benchmarks/bench_reference_memory.py                                  # Llama L = 4096, ViT 32x32, forward
    python benchmarks/bench_reference_memory.py --families llama --encodings rope alibi cape
    python benchmarks/bench_reference_memory.py --backward --grid 64            # forward + backward (6-7 GiB peaks)

A small model (1 layer, hidden 64, 4 heads, batch 1; the references' O(L^2) intermediates, not the model, are what
grows), one forward (``--backward``: and its backward) per (family, encoding): Llama and GPT-2 at ``--length``
tokens, ViT at a ``--grid`` x ``--grid`` patch grid (L = grid^2 + 1). For each it reports the seconds, the peak
resident memory above the resident size before the call (Linux: ``/proc/self/clear_refs`` resets the high-water
mark, ``/proc/self/status`` reports it), and the estimate behind the memory pre-check
(``PositionEncoding.reference_bytes``, ``hf_posenc.memory``).

Two checks, which used to be asserts in ``tests/test_long_inputs.py`` (speed and memory are measured here, tests
check correctness): the peak is under the budget (``--budget``, 24 GiB), and the estimate is not below what was
measured (10 % and 0.5 GiB of slack for the rest of the model and the allocator; with ``--backward``, plus the
(B, H, L, L) weights torch's own CPU attention keeps for its backward), so that the pre-check refuses what would not
fit and lets through what does. A pair that fails either is marked in the table and the script exits 1.

Prints a markdown table and writes JSON (default ``benchmarks/results/reference_memory_<device>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, device_name, slug, versions  # noqa: E402

GiB = 2**30
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
VOCAB = 97


def _status(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _trim() -> None:
    """Give the allocator's free memory back to the system, so that the resident size before a measurement
    does not include memory that the measured call would merely reuse (glibc; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(fn):
    """(fn(), seconds, peak resident bytes above the resident size before the call, or None off Linux)."""
    _trim()
    before = _status("VmRSS")
    try:
        _CLEAR_REFS.write_text("5")  # reset the peak (VmHWM) to the current resident size
        resettable = True
    except OSError:
        resettable = False
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    extra = peak - before if (resettable and peak is not None and before is not None) else None
    return out, seconds, extra


def small_model(family: str, encoding: str, length: int, grid: int, train: bool):
    """The base model (no head) of ``family``: 1 layer, hidden 64, 4 heads, sized for ``length`` positions (learned's
    table, liere, fope) or a ``grid`` x ``grid`` patch grid; patched with ``encoding``; seeded."""
    import transformers

    import hf_posenc

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=4, max_position_embeddings=length,
                                          **common)
        cls = transformers.LlamaModel
    elif family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_inner=128, n_layer=1, n_head=4,
                                         n_positions=length)
        cls = transformers.GPT2Model
    else:
        config = transformers.ViTConfig(patch_size=4, image_size=4 * grid, **common)
        cls = transformers.ViTModel
    torch.manual_seed(0)
    model = hf_posenc.patch_model(cls(config), encoding)
    return model.train(train)


def inputs(family: str, length: int, grid: int) -> dict:
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        return {"pixel_values": torch.randn(1, 3, 4 * grid, 4 * grid, generator=g)}
    return {"input_ids": torch.randint(3, VOCAB, (1, length), generator=g), "use_cache": False}


def run_pair(family: str, encoding: str, length: int, grid: int, backward: bool, budget: int) -> dict:
    """One (family, encoding): its measurement and the two checks, as a row. A reference that the pre-check refuses
    (its estimate over the budget) is a row with ``refused`` set: that is the pre-check doing its work."""
    import hf_posenc
    from hf_posenc.memory import ReferenceMemoryError

    model = small_model(family, encoding, length, grid, backward)
    n = grid * grid + 1 if family == "vit" else length
    x = inputs(family, length, grid)
    enc = hf_posenc.encoding_module(model)
    est = enc.reference_bytes(1, enc.info.num_heads, n, n, backward)

    def step():
        with torch.set_grad_enabled(backward):
            out = model(**x).last_hidden_state
            if backward:
                out.float().pow(2).mean().backward()
        return out

    try:
        out, seconds, extra = measure(step)
    except ReferenceMemoryError as e:
        return {"family": family, "encoding": encoding, "length": n, "backward": backward, "seconds": None,
                "finite": None, "estimate_gib": round(est / GiB, 3), "peak_extra_gib": None, "refused": str(e),
                "problems": []}
    # torch's own CPU attention keeps the (B, H, L, L) weights of its math path for its backward (not a reference)
    sdpa_grad = 3 * 4 * (4 * n * n) if backward else 0
    row = {"family": family, "encoding": encoding, "length": n, "backward": backward, "seconds": round(seconds, 2),
           "finite": bool(torch.isfinite(out).all()), "estimate_gib": round(est / GiB, 3),
           "peak_extra_gib": None if extra is None else round(extra / GiB, 3)}
    problems = []
    if not row["finite"]:
        problems.append("non-finite output")
    if extra is not None:
        if extra >= budget:
            problems.append(f"over the {budget / GiB:.0f} GiB budget")
        if extra > 1.1 * est + 0.5 * GiB + sdpa_grad:
            problems.append("the pre-check's estimate is below the peak: raise reference_footprint")
    row["problems"] = problems
    return row


def main(argv: list[str] | None = None) -> int:
    import hf_posenc

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["llama", "vit"], choices=["llama", "gpt2", "vit"])
    parser.add_argument("--encodings", nargs="+", default=None, help="default: every registered encoding")
    parser.add_argument("--length", type=int, default=4096, help="text tokens (default 4096)")
    parser.add_argument("--grid", type=int, default=32, help="ViT patches per side (default 32: L = 1025)")
    parser.add_argument("--backward", action="store_true", help="forward and backward (default: forward, no_grad)")
    parser.add_argument("--budget", default="24GiB", help="HF_POSENC_MEMORY_BUDGET for the run (default 24GiB)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/reference_memory_<device>.json)")
    args = parser.parse_args(argv)

    os.environ["HF_POSENC_MEMORY_BUDGET"] = args.budget
    # the engines' fixed defaults: the autotuner's timing on a first call (hf_posenc.kernels.autotune) is not the
    # reference's time, and would be counted in it
    os.environ.setdefault("HF_POSENC_TUNE", "off")
    from hf_posenc.memory import parse_size

    budget = parse_size(args.budget)
    if budget is None:
        parser.error("--budget must be a size (e.g. 24GiB)")
    torch.set_num_threads(args.threads)
    encodings = args.encodings or hf_posenc.list_encodings()
    from hf_posenc.registry import get_encoding

    rows = []
    print("| pair | L | seconds | peak above start (GiB) | pre-check estimate (GiB) | problems |")
    print("| --- | --- | --- | --- | --- | --- |")
    for family in args.families:
        for encoding in encodings:
            if family not in get_encoding(encoding).families:
                continue
            row = run_pair(family, encoding, args.length, args.grid, args.backward, budget)
            rows.append(row)
            verdict = "; ".join(row["problems"]) or ("refused by the pre-check" if row.get("refused") else "ok")
            print(f"| {family}-{encoding} | {row['length']} | {row['seconds']} | {row['peak_extra_gib']} | "
                  f"{row['estimate_gib']} | {verdict} |", flush=True)
    device = device_name(torch.device("cpu"))
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"reference_memory_{slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "threads": args.threads, "budget_bytes": budget,
                               "versions": versions(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    bad = [f"{r['family']}-{r['encoding']}" for r in rows if r["problems"]]
    if bad:
        print(f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
