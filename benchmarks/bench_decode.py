"""Greedy decoding speed of a small Llama, patched and unpatched: eager + DynamicCache vs static cache + compile.

    python benchmarks/bench_decode.py                                   # CPU, inductor (mode "default")
    python benchmarks/bench_decode.py --device cuda                     # CUDA, mode "reduce-overhead" (CUDA graphs)
    python benchmarks/bench_decode.py --encodings alibi fox --new-tokens 32 --rounds 5

Two ways to decode, each with transformers' own ``generate`` (greedy, batch 1, eval, fp32, every EOS ignored):

* ``eager``: a DynamicCache, no compile (generate's default);
* ``static+compile``: ``cache_implementation`` static (one StaticCache, reset before each call) with the forward
  compiled by generate itself as one graph (``CompileConfig(fullgraph=True, mode=...)``; on CPU
  ``_compile_all_devices = True``, as on CUDA where generate does this by default).

Per-token decode time = (time of the last new token − time of the first) / (N − 1), both taken by a logits
processor that generate calls once per new token (after that token's forward): the prefill is not in it. Every
model gets identical weights (deep copies of one unpatched model, ``attn_implementation="sdpa"``). Each round runs
the unpatched model before and after every encoding (A B A C A ...; the encodings' order reversed every other
round), so each encoding's ratio in a round is to the unpatched runs on either side of it, seconds apart; the
table reports the ratio of the medians over the rounds and the median of those per-round ratios ("paired"),
the figure that a machine whose speed drifts within a round disturbs least. Prints a markdown table and writes
JSON (default ``benchmarks/results/decode_<device-name>.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, device_name, slug, versions  # noqa: E402

import hf_posenc  # noqa: E402

BASELINE = "unpatched"
DEFAULT_ENCODINGS = ("alibi", "kerple", "fox", "cope", "rope2d")
MODES = ("eager", "static+compile")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(LogitsProcessor):
    """Records when each new token's scores reach the processors (once per token, after its forward)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


class Decoder:
    """One model and one way of decoding; ``run(n)`` generates n tokens greedily and returns the seconds per token
    after the first (the prefill excluded)."""

    def __init__(self, model, mode: str, prompt: torch.Tensor, max_new: int, compile_mode: str, device) -> None:
        self.model, self.mode, self.prompt, self.device = model, mode, prompt, device
        self.cache = None
        self.kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        if mode == "static+compile":
            self.cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + max_new)
            config = CompileConfig(fullgraph=True, mode=compile_mode)
            if device.type != "cuda":
                config._compile_all_devices = True  # generate compiles on accelerators only unless told
            self.kw["compile_config"] = config

    def run(self, n: int) -> float:
        clock = StepClock(self.device)
        kw = dict(self.kw, max_new_tokens=n, min_new_tokens=n, logits_processor=LogitsProcessorList([clock]))
        if self.cache is not None:
            self.cache.reset()
            kw["past_key_values"] = self.cache
        with torch.no_grad():
            out = self.model.generate(self.prompt, attention_mask=torch.ones_like(self.prompt), **kw)
        if out.shape[1] != self.prompt.shape[1] + n or len(clock.times) != n:
            raise RuntimeError(f"generate returned {out.shape[1] - self.prompt.shape[1]} tokens "
                               f"({len(clock.times)} steps timed), asked for {n}")
        return (clock.times[-1] - clock.times[0]) / (n - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--encodings", nargs="+", default=list(DEFAULT_ENCODINGS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--compile-mode", default=None,
                        help='torch.compile mode (default: "reduce-overhead" on CUDA, as generate does; '
                             '"default" elsewhere)')
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_<device>.json)")
    parser.add_argument("--shape", choices=("small", "smollm2"), default="small",
                        help="smollm2: SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 kv heads, intermediate "
                        "1536, vocab 49152), a random model, prompt 256, 32 new tokens (overrides the size options)")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    compile_mode = args.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default")
    torch.manual_seed(0)
    intermediate = 4 * args.hidden
    if args.shape == "smollm2":
        args.layers, args.hidden, args.heads, args.kv_heads, args.vocab = 30, 576, 9, 3, 49152
        args.prompt, args.new_tokens, intermediate = 256, 32, 1536
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096, attn_implementation="sdpa", tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(config).eval()
    models = {BASELINE: base.to(device)}
    for name in args.encodings:
        m = copy.deepcopy(base)
        hf_posenc.patch_model(m, name)
        models[name] = m.to(device).eval()
    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)

    decoders = {(name, mode): Decoder(m, mode, prompt, args.new_tokens, compile_mode, device)
                for name, m in models.items() for mode in args.modes}
    compile_s = {}
    for key, dec in decoders.items():  # warmup: compiles the decode step (static+compile) once per model
        start = time.perf_counter()
        dec.run(args.new_tokens)
        compile_s[key] = time.perf_counter() - start
        print(f"warmup {key[0]:>10} {key[1]:<15} {compile_s[key]:6.1f} s", flush=True)

    names = [name for name in models if name != BASELINE]
    per_token = {key: [] for key in decoders}  # every run's seconds per token
    paired = {key: [] for key in decoders if key[0] != BASELINE}  # each run's ratio to the unpatched on either side
    for r in range(args.rounds):
        for mode in args.modes:
            before = decoders[(BASELINE, mode)].run(args.new_tokens)
            per_token[(BASELINE, mode)].append(before)
            for name in names if r % 2 == 0 else names[::-1]:  # A B A C A ...
                t = decoders[(name, mode)].run(args.new_tokens)
                after = decoders[(BASELINE, mode)].run(args.new_tokens)
                per_token[(name, mode)].append(t)
                per_token[(BASELINE, mode)].append(after)
                paired[(name, mode)].append(t / ((before + after) / 2))
                before = after
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    rows = []
    for (name, mode), times in per_token.items():
        med = statistics.median(times)
        base_med = statistics.median(per_token[(BASELINE, mode)])
        rows.append({
            "encoding": name, "mode": mode, "ms_per_token": 1e3 * med, "tokens_per_s": 1.0 / med,
            "ratio_to_unpatched": med / base_med,
            "paired_ratio": statistics.median(paired[(name, mode)]) if name != BASELINE else 1.0,
            "warmup_s": compile_s[(name, mode)],
            "ms_per_token_all_runs": [1e3 * t for t in times],
        })

    dev = device_name(device)
    print(f"\nGreedy decoding, Llama {args.layers}x{args.hidden} ({args.heads} heads, {args.kv_heads} kv), prompt "
          f"{args.prompt}, {args.new_tokens} new tokens, batch 1, fp32, {dev}"
          + (f", {args.threads} threads" if device.type == "cpu" else "") + f"; compile mode {compile_mode!r}")
    print(f"{args.rounds} rounds, the unpatched model run before and after each encoding; ratio = median time per "
          "token / unpatched's in the same mode; paired = the median of each run's ratio to the unpatched runs on "
          "either side\n")
    header = "| encoding | " + " | ".join(f"{m} ms/token (tokens/s) | ratio | paired" for m in args.modes) + " |"
    print(header)
    print("|" + "---|" * (1 + 3 * len(args.modes)))
    for name in models:
        cells = []
        for mode in args.modes:
            row = next(r for r in rows if r["encoding"] == name and r["mode"] == mode)
            cells.append(f"{row['ms_per_token']:.2f} ({row['tokens_per_s']:.0f}) | {row['ratio_to_unpatched']:.2f}x | "
                         f"{row['paired_ratio']:.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")

    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"decode_{slug(dev)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "decode", "device": dev, "threads": args.threads if device.type == "cpu" else None,
        "compile_mode": compile_mode, "config": {k: v for k, v in vars(args).items() if k != "out"},
        "versions": versions(), "results": rows,
    }, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
