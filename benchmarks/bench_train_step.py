"""End to end: tokens/s of a training step of a 12-layer, 768-wide Llama, unpatched (SDPA) vs patched.

    python benchmarks/bench_train_step.py                        # CUDA: bf16 autocast, B=8, L=2048
    python benchmarks/bench_train_step.py --encodings alibi fox --length 4096 --batch 4
    python benchmarks/bench_train_step.py --smoke                # CPU: a 2-layer toy model, kernels interpreted

What is timed: one optimizer step (forward, loss, backward, AdamW step, zero_grad) of ``LlamaForCausalLM``
(hidden 768, 12 layers, 12 heads of 64, MLP 2048, vocab 32000; random weights, random tokens), float32
weights under ``torch.autocast(bfloat16)`` on CUDA. One model per encoding (``unpatched``: transformers' own
RoPE + SDPA; the others: ``hf_posenc.patch_model(model, name)``, whose attention runs the backend the
dispatcher picks on CUDA, see ``hf_posenc/kernels/defaults.py``). The encodings are timed in rounds, A B C ...
A B C ..., ``--steps`` steps per measurement; the reported time is the median over the rounds, so a slow
period of the machine hits every encoding alike. tokens/s = B·L / step time; the ratio is against the
unpatched model of the same run (design target: >= 0.95, ../shared/DESIGN.md). Peak memory is the
allocator's peak during the encoding's steps above what was allocated before them (every model and
its optimizer stay on the GPU: about 2 GB each at the default size). Writes JSON and a markdown table (default
``benchmarks/results/train_step_<device>.json`` / ``.md``); ``--smoke`` writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ENCODINGS = ("unpatched", "alibi", "kerple", "fox", "cope", "sba")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encodings", nargs="+", default=list(ENCODINGS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="autocast dtype on CUDA (float32: no autocast)")
    p.add_argument("--rounds", type=int, default=3, help="measurements per encoding, interleaved")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per encoding first (compiles kernels)")
    p.add_argument("--smoke", action="store_true", help="CPU: a 2-layer toy model, kernels interpreted, no output")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_step_<device>.json)")
    return p.parse_args(argv)


def make_step(model, ids, amp, device):
    """One training step of ``model`` on ``ids`` (forward, loss, backward, AdamW, zero_grad) and its optimizer."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, opt


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if args.smoke:
        if not cuda:  # before anything imports triton (transformers does): interpreted kernels on the CPU
            os.environ.setdefault("TRITON_INTERPRET", "1")
            os.environ.setdefault("HF_POSENC_BACKEND", "triton")
        args.batch, args.length, args.layers, args.hidden, args.heads = 1, 24, 2, 32, 2
        args.intermediate, args.vocab, args.rounds, args.steps, args.warmup = 64, 101, 1, 1, 0
    elif not cuda:
        print("bench_train_step.py times CUDA training steps and needs a CUDA GPU; on the CPU run it with --smoke "
              "(a tiny interpreted correctness run) or see benchmarks/bench_forward.py.", file=sys.stderr)
        return 2
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_posenc
    from _common import device_name, slug, versions

    device = torch.device("cuda" if cuda else "cpu")
    amp = getattr(torch, args.dtype) if cuda and args.dtype != "float32" else None
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=max(args.length, 64),
        attn_implementation="sdpa",
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), generator=g).to(device)
    runs = {}
    for name in args.encodings:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        if name != "unpatched":
            hf_posenc.patch_model(model, name)
        model.to(device).train()
        step, opt = make_step(model, ids, amp, device)
        backend = hf_posenc.describe(model).get("backend") if name != "unpatched" else None
        runs[name] = {"step": step, "opt": opt, "times": [], "peak_mb": None, "backend": backend}
        for _ in range(max(1, args.warmup)):  # compiles the kernels, creates the optimizer's state
            step()
    if cuda:
        torch.cuda.synchronize()

    for _ in range(args.rounds):
        for name, run in runs.items():
            if cuda:
                torch.cuda.synchronize()
                base_mb = torch.cuda.memory_allocated() / 2**20
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = run["step"]()
            if cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**20 - base_mb  # activations and gradients
                run["peak_mb"] = max(run["peak_mb"] or 0.0, peak)
            run["times"].append((time.perf_counter() - t0) / args.steps)
            run["loss"] = float(loss.detach())

    rows = []
    tokens = args.batch * args.length
    base = statistics.median(runs["unpatched"]["times"]) if "unpatched" in runs else None
    for name, run in runs.items():
        t = statistics.median(run["times"])
        rows.append({"encoding": name, "backend": run["backend"], "step_ms": t * 1e3, "tokens_per_s": tokens / t,
                     "ratio_vs_unpatched": (base / t) if base else None, "peak_mb": run["peak_mb"],
                     "loss": run["loss"], "times_ms": [x * 1e3 for x in run["times"]]})
    table = markdown(rows)
    print(table)
    if args.smoke:
        bad = [r["encoding"] for r in rows if not (r["loss"] == r["loss"] and abs(r["loss"]) < 1e4)]
        if bad:
            print(f"non-finite loss for {bad}", file=sys.stderr)
            return 1
        return 0
    result = {"benchmark": "bench_train_step", "device": device_name(device), "versions": versions(),
              "args": vars(args), "tokens_per_step": tokens, "results": rows}
    default = ROOT / "benchmarks" / "results" / f"train_step_{slug(device_name(device))}.json"
    out = Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"# bench_train_step on {result['device']}\n\n{table}\n")
    print(f"wrote {out}")
    return 0


def markdown(rows: list[dict]) -> str:
    lines = ["| encoding | backend | step ms | tokens/s | vs unpatched | peak MB |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio_vs_unpatched"] is None else f"{r['ratio_vs_unpatched']:.3f}"
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        lines.append(f"| {r['encoding']} | {r['backend'] or '-'} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{ratio} | {peak} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
