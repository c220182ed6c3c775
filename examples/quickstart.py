"""hf_posenc quickstart: train a tiny byte-level Llama with ALiBi instead of RoPE, then save and reload it.

    python examples/quickstart.py            # ~300 steps, a couple of minutes on 2 CPU cores
    python examples/quickstart.py --steps 50 --out /tmp/qs

The corpus is the Python standard library's own source (top-level ``*.py`` files, sorted by name; every
10th file is held out for validation), read as bytes, so the example needs no download.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import hf_posenc


def load_corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Bytes of the stdlib's top-level .py files: (train, val) uint8 -> int64 tensors, split by file."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    val_files, train_files = files[::10], [f for i, f in enumerate(files) if i % 10]

    def read(paths: list[str]) -> torch.Tensor:
        data = b"\n\n".join(Path(p).read_bytes() for p in paths)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    return read(train_files), read(val_files), len(files)


def random_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, seq) windows at random offsets."""
    starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, data: torch.Tensor, batch: int, seq: int, batches: int) -> float:
    """Mean next-byte loss (nats) over ``batches`` fixed, evenly spaced windows of the data."""
    model.eval()
    starts = torch.linspace(0, len(data) - seq - 1, batch * batches).long().tolist()
    losses = []
    for i in range(batches):
        x = torch.stack([data[s : s + seq] for s in starts[i * batch : (i + 1) * batch]])
        losses.append(model(input_ids=x, labels=x).loss.item())
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--out", default="out/quickstart", help="where to save the model (default out/quickstart)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128, help="training context length in bytes")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    # One thread by default: a 0.9M-parameter model gains little from intra-op threads, and on small shared
    # VMs (the 2-core machine this was written on) two OpenMP threads stall for seconds at a time.
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1 or args.seq < 2 or args.threads < 1:
        parser.error("--steps, --batch and --threads must be >= 1, --seq >= 2")

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()

    train, val, n_files = load_corpus()
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    hf_posenc.patch_model(model, "alibi")  # in place: RoPE removed, ALiBi bias added in every attention layer

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    initial_val = evaluate(model, val, args.batch, args.seq, batches=8)
    bar = tqdm(range(args.steps), desc="train", unit="step", mininterval=1.0)
    for _ in bar:
        x = random_batch(train, args.batch, args.seq, gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    train_loss = loss.item()
    val_loss = evaluate(model, val, args.batch, args.seq, batches=8)
    # ALiBi extrapolates: evaluate at twice the training length too.
    val_loss_2x = evaluate(model, val, args.batch // 2 or 1, 2 * args.seq, batches=8)

    # Greedy generation with the KV cache, checked against generation without it.
    model.eval()
    prompt = torch.tensor([list(b"def ")])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=60, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=60, do_sample=False, use_cache=False)
    if not torch.equal(cached, uncached):
        raise SystemExit("generation with the KV cache differs from generation without it")
    text = bytes(cached[0].tolist()).decode("utf-8", errors="replace")

    # Save, reload with hf_posenc (the plain transformers loader would drop the encoding), compare logits.
    model.save_pretrained(args.out)
    reloaded = hf_posenc.from_pretrained(args.out)
    x = val[: 2 * args.seq].view(2, args.seq)
    with torch.no_grad():
        same = torch.equal(model(input_ids=x).logits, reloaded(input_ids=x).logits)
    if not same:
        raise SystemExit("the reloaded model's logits differ from the trained model's")

    info = hf_posenc.describe(reloaded)
    n_params = sum(p.numel() for p in model.parameters())
    print()
    print("hf_posenc quickstart")
    print(f"  model          : LlamaForCausalLM, {n_params / 1e6:.2f}M parameters, {config.num_hidden_layers} layers, "
          f"hidden {config.hidden_size}, byte vocab 256")
    print(f"  corpus         : {n_files} stdlib files, {len(train) / 1e6:.2f} MB train / {len(val) / 1e6:.2f} MB val")
    print(f"  encoding       : {model.config.position_encoding}")
    print(f"  training       : {args.steps} steps x {args.batch} x {args.seq} bytes, AdamW lr {args.lr}, "
          f"{args.threads} CPU thread(s)")
    print(f"  loss           : val {initial_val:.3f} before -> train {train_loss:.3f}, val {val_loss:.3f} after")
    print(f"  val perplexity : {math.exp(val_loss):.2f} per byte ({val_loss / math.log(2):.2f} bits/byte); "
          f"at {2 * args.seq} bytes (2x train length): {math.exp(val_loss_2x):.2f}")
    print(f"  generated      : {text!r}  (greedy, KV cache == no cache)")
    print(f"  describe()     : { {k: v for k, v in info.items() if k != 'layers'} }")
    print(f"                   layers {info['layers']}")
    print(f"  saved to       : {os.path.abspath(args.out)}")
    print(f"  reloaded       : hf_posenc.from_pretrained -> logits identical: {same}")
    print(f"  time           : {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
