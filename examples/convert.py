"""Convert a pretrained RoPE model to RoPE + FIRE, fine-tune it, save it, reload it and generate.

    python examples/convert.py --from smollm2                     # SmolLM2-135M-Instruct, cached by hf_posenc
    python examples/convert.py --from HuggingFaceTB/SmolLM2-135M  # any hub id of a RoPE causal LM
    python examples/convert.py --from path/to/checkpoint --steps 100 --encoding rope+fox
    accelerate launch examples/convert.py --from smollm2          # one GPU (or what `accelerate config` set up)

The workflow of moving a pretrained model to a new position encoding (docs/compositions.md):

1. Load the checkpoint (``--from``: a local directory, a Hugging Face hub id, or ``smollm2``, the checkpoint
   ``hf_posenc.testing.smollm2()`` builds into its cache) and its tokenizer, with transformers.
2. ``hf_posenc.patch_model(model, "rope+fire", init="identity")``: the model keeps its own rotary and gets FIRE's
   bias beside it, started inert (FIRE's last layer at zero), so the patched model gives the pretrained logits at
   step 0. The script measures that: the largest logit difference to the unpatched model.
3. Fine-tune with accelerate (AdamW, warm-up then cosine; ``--mixed-precision bf16`` on a GPU), on the English
   documentation that ships with Python (``pydoc_data.topics``; ``--data FILE`` for another text) tokenised with
   the checkpoint's tokenizer. The encoding's own parameters train in an optimizer group of their own
   (``hf_posenc.param_groups``) at ``--encoding-lr``: started inert, FIRE's bias barely moves at a fine-tuning
   learning rate.
4. Save with ``accelerator.unwrap_model(model).save_pretrained(out)`` (``accelerator.save_model`` writes no
   config.json, so the encoding would be lost) and the tokenizer beside it.
5. Reload through the Auto class, ``AutoModelForCausalLM.from_pretrained(out)`` (``import hf_posenc`` registers the
   patched model types), check that its logits equal the fine-tuned model's, and generate greedily from a prompt
   with both: the same text.

Outputs in ``--out`` (default ``out/convert``): the model and tokenizer, and ``summary.json`` (losses, the step-0
logit difference, how far the encoding's parameters moved, the reload check, the generated text, times).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posenc


def resolve(source: str) -> str:
    """``--from``: ``smollm2`` (built into hf_posenc's cache on first use), a local directory, or a hub id."""
    if source == "smollm2":
        from hf_posenc.testing import smollm2

        return str(smollm2())
    if Path(source).exists() and not (Path(source) / "config.json").is_file():
        raise SystemExit(f"--from {source}: a directory without config.json is not a checkpoint")
    return source  # a checkpoint directory, or a hub id: transformers resolves it


def load_text(path: str | None) -> str:
    """The fine-tuning text: ``path``, or the Python language reference's topics that ship with Python."""
    if path:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def batches(ids: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """Random windows of ``seq`` tokens, ``batch`` at a time, forever."""
    while True:
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=gen)
        yield torch.stack([ids[s : s + seq] for s in starts.tolist()])


@torch.no_grad()
def val_loss(model: torch.nn.Module, ids: torch.Tensor, seq: int, windows: int, device: torch.device) -> float:
    """Mean next-token loss over ``windows`` fixed windows of ``ids``."""
    model.eval()
    starts = torch.linspace(0, len(ids) - seq - 1, windows).long().tolist()
    x = torch.stack([ids[s : s + seq] for s in starts]).to(device)
    loss = model(input_ids=x, labels=x).loss.item()
    model.train()
    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", default="smollm2",
                   help="a checkpoint directory, a hub id, or smollm2 (default)")
    p.add_argument("--encoding", default="rope+fire", help="a composition that keeps the rotary (default rope+fire)")
    p.add_argument("--out", default="out/convert", help="output directory (default out/convert)")
    p.add_argument("--data", help="a text file to fine-tune on (default: Python's pydoc_data.topics)")
    p.add_argument("--steps", type=int, default=30, help="fine-tuning steps (default 30)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of the model's weights (default 1e-4)")
    p.add_argument("--encoding-lr", type=float, default=None,
                   help="learning rate of the encoding's own parameters (default: hf_posenc.param_groups' measured "
                   "default for the encoding, 1e-2 for fire, 3e-2 for fox)")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    p.add_argument("--prompt", default="In Python, a decorator is", help="the prompt to generate from")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if min(args.steps, args.batch, args.max_new_tokens) < 1 or args.seq < 2:
        p.error("--steps, --batch and --max-new-tokens must be >= 1, --seq >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    has_gpu = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=not has_gpu)
    say, t0 = accelerator.print, time.perf_counter()
    out = Path(args.out)

    # 1. The pretrained checkpoint and its tokenizer, as transformers loads them.
    path = resolve(args.source)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(accelerator.device)
    ids = torch.tensor(tokenizer(load_text(args.data), add_special_tokens=False)["input_ids"], dtype=torch.long)
    cut = int(0.9 * len(ids))
    train_ids, val_ids = ids[:cut], ids[cut:]
    if min(len(train_ids), len(val_ids)) <= args.seq:
        raise SystemExit(f"the text has {len(ids)} tokens: too few for --seq {args.seq}")
    say(f"{args.source}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters, {model.config.model_type}; {len(ids)} tokens of text")
    probe = val_ids[: args.seq].unsqueeze(0).to(accelerator.device)
    model.eval()
    with torch.no_grad():
        pretrained = model(input_ids=probe).logits
    loss_pretrained = val_loss(model, val_ids, args.seq, 8, accelerator.device)

    # 2. Keep the rotary, add the term, start it inert: the pretrained logits at step 0.
    hf_posenc.patch_model(model, args.encoding, init="identity")
    with torch.no_grad():
        step0 = (model(input_ids=probe).logits - pretrained).abs().max().item()
    say(f"patched: {model.config.position_encoding['name']} (init identity); largest logit change at step 0: "
        f"{step0:.3g} (logits up to {pretrained.abs().max().item():.3g})")
    start = {n: p.detach().clone() for n, p in hf_posenc.encoding_module(model).named_parameters()}

    # 3. Fine-tune with accelerate; the encoding's parameters in a group of their own.
    groups = hf_posenc.param_groups(model, lr=args.lr, encoding_lr=args.encoding_lr)
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    model.train()
    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    for step, x in zip(range(1, args.steps + 1), batches(train_ids, args.batch, args.seq, gen)):
        loss = model(input_ids=x.to(accelerator.device), labels=x.to(accelerator.device)).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 1 or step % 10 == 0 or step == args.steps:
            say(f"step {step:4d}/{args.steps}: loss {loss.item():.3f}")
    model = accelerator.unwrap_model(model)
    model.eval()
    loss_tuned = val_loss(model, val_ids, args.seq, 8, accelerator.device)
    moved = max(((p.detach() - start[n]).abs().max().item()
                 for n, p in hf_posenc.encoding_module(model).named_parameters()), default=None)

    # 4. Save the way that keeps the encoding (config.json with position_encoding, safetensors weights).
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    # 5. Reload through the Auto class and generate with both.
    reloaded = AutoModelForCausalLM.from_pretrained(out).to(accelerator.device).eval()
    with torch.no_grad():
        same_logits = torch.equal(reloaded(input_ids=probe).logits, model(input_ids=probe).logits)
    prompt = tokenizer(args.prompt, return_tensors="pt").to(accelerator.device)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                    if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    with torch.no_grad():
        tuned_ids = model.generate(**prompt, **settings)
        reloaded_ids = reloaded.generate(**prompt, **settings)
    text = tokenizer.decode(reloaded_ids[0][prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    summary = {
        "from": args.source, "encoding": reloaded.config.position_encoding, "steps": args.steps,
        "batch": args.batch, "seq": args.seq, "lr": args.lr,
        "encoding_lr": [g["lr"] for g in groups if g["name"] != "model"],
        "device": str(accelerator.device), "mixed_precision": args.mixed_precision,
        "step0_max_logit_change": step0, "val_loss": {"pretrained": loss_pretrained, "finetuned": loss_tuned},
        "train_losses": losses, "encoding_parameters_moved": moved,
        "reloaded_class": type(reloaded).__name__, "reload_logits_identical": same_logits,
        "generation_identical": torch.equal(tuned_ids, reloaded_ids), "prompt": args.prompt, "generated": text,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"val loss: pretrained {loss_pretrained:.3f}, after {args.steps} steps {loss_tuned:.3f}")
    if moved is not None:
        print(f"the encoding's parameters moved by at most {moved:.3g} from their inert start")
    print(f"saved to {out}; AutoModelForCausalLM.from_pretrained gives {type(reloaded).__name__} with "
          f"{reloaded.config.position_encoding['name']}: logits identical {same_logits}, generation identical "
          f"{summary['generation_identical']}")
    print(f"{args.prompt!r} -> {text!r}")
    print(f"{summary['seconds']} s")
    if not (same_logits and summary["generation_identical"]):
        raise SystemExit("the reloaded model differs from the fine-tuned one")


if __name__ == "__main__":
    main()
