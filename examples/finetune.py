"""hf_posenc fine-tuning: switch a RoPE-trained Llama to another encoding and fine-tune until its loss recovers.

    python examples/finetune.py                          # CPU: ~1-2 minutes on 2 cores (pretrains the RoPE model first)
    python examples/finetune.py --base out/finetune/rope --encoding kerple --lora
    python examples/finetune.py --base HuggingFaceTB/SmolLM2-135M --encoding rope+fire --param init=identity
    python examples/finetune.py --mixed-precision bf16 --gradient-checkpointing
    accelerate launch examples/finetune.py               # one GPU (or whatever `accelerate config` set up)
    accelerate launch --multi_gpu --num_processes 4 examples/finetune.py      # several GPUs: DDP
    torchrun --nproc_per_node 2 examples/finetune.py     # 2 CPU processes (DDP over gloo), e.g. to try it out

The use case: a model trained with RoPE (any RoPE causal LM: ``--base`` takes a checkpoint directory or a hub id,
and the corpus is then read in the checkpoint's tokens when it has a tokenizer; without ``--base``, a tiny
byte-level Llama is trained here for ``--pretrain-steps`` steps and saved to ``<out>/rope``) is switched to another
encoding with ``hf_posenc.patch_model`` (default ``alibi``; ``--encoding fire``, ``kerple``, ... bring
parameters that start untrained), which costs it its loss; fine-tuning runs until the validation loss is back
within ``--tolerance`` of the RoPE model's (or ``--steps`` steps). ``--lora`` trains LoRA adapters plus the encoding's own parameters
(``modules_to_save=hf_posenc.trainable_modules(model)``) instead of every weight.

Everything runs through accelerate: ``--mixed-precision bf16``, ``--gradient-checkpointing``, DDP under
``accelerate launch``/``torchrun``. Outputs in ``--out``: ``loss_curve.csv`` (every step: train loss; every
``--eval-every`` steps: validation loss), ``summary.json``, the fine-tuned model in ``model/`` saved with
``accelerator.unwrap_model(model).save_pretrained`` (``accelerator.save_model`` writes no config.json, so the
encoding would be lost) and, with ``--lora``, the adapter in ``adapter/``. The script reloads both
(``hf_posenc.from_pretrained``; the base patched first, then ``PeftModel.from_pretrained``) and checks the logits.

The corpus is the Python standard library's own source, read as bytes (as in examples/quickstart.py).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_posenc


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the stdlib's top-level .py files: (train, val) int64 tensors, every 10th file held out."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    val_files, train_files = files[::10], [f for i, f in enumerate(files) if i % 10]

    def read(paths: list[str]) -> torch.Tensor:
        data = b"\n\n".join(Path(p).read_bytes() for p in paths)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    return read(train_files), read(val_files)


def random_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


def tiny_llama() -> LlamaForCausalLM:
    """A 0.9M-parameter byte-level Llama with its native RoPE (the quickstart's shape)."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def load_base(path: str) -> torch.nn.Module:
    """A checkpoint: a local directory or a hub id. A local checkpoint saved by a patched model loads through
    hf_posenc.from_pretrained (which also reads hf_posenc 0.1's format); anything else through transformers'
    Auto class, which, after ``import hf_posenc``, loads a patched checkpoint patched (from the hub too)."""
    if Path(path).is_dir() and getattr(AutoConfig.from_pretrained(path), "position_encoding", None) is not None:
        return hf_posenc.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)


def tokenized_corpus(path: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The corpus in the tokens of ``path``'s tokenizer, when the checkpoint has one (a pretrained model); None
    for a checkpoint without one (the byte-level models this script pretrains read bytes)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):  # no tokenizer files in the checkpoint
        return None
    train, val = load_corpus()

    def encode(data: torch.Tensor) -> torch.Tensor:
        text = bytes(data.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    return encode(train), encode(val)


def parse_params(items: list[str]) -> dict:
    """``--param key=value`` (value read as JSON when it parses, else as a string)."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param expects key=value, got {item!r}")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


@torch.no_grad()
def evaluate(accelerator: Accelerator, model, data: torch.Tensor, batch: int, seq: int, batches: int) -> float:
    """Mean next-byte loss over ``batches`` fixed windows of ``data``, split over the processes and averaged
    (every process gets the same value)."""
    model.eval()
    n = batch * batches
    starts = torch.linspace(0, len(data) - seq - 1, n).long()
    mine = starts[accelerator.process_index :: accelerator.num_processes].tolist()
    total = torch.zeros(2, device=accelerator.device)
    for i in range(0, len(mine), batch):
        x = torch.stack([data[s : s + seq] for s in mine[i : i + batch]]).to(accelerator.device)
        with accelerator.autocast():  # the same precision as training, prepared model or not
            loss = model(input_ids=x, labels=x).loss.float()
        total += torch.stack([loss * len(x), torch.tensor(float(len(x)), device=x.device)])
    total = accelerator.reduce(total, "sum")
    model.train()
    return (total[0] / total[1]).item()


def train(
    accelerator: Accelerator, model, args, phase: str, steps: int, lr: float, train_data, val_data, log: list,
    target: float | None = None,
) -> tuple[torch.nn.Module, int]:
    """AdamW with warmup + cosine decay; stops early once the validation loss is <= ``target``.
    Returns the prepared model and the number of steps taken."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model, opt, sched = accelerator.prepare(model, opt, sched)
    gen = torch.Generator().manual_seed(args.seed + 1000 * accelerator.process_index + (phase == "finetune"))
    bar = tqdm(range(1, steps + 1), desc=phase, unit="step", mininterval=1.0, disable=not accelerator.is_local_main_process)
    start, step = time.perf_counter(), 0
    model.train()
    for step in bar:
        x = random_batch(train_data, args.batch, args.seq, gen).to(accelerator.device)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        row = {"phase": phase, "step": step, "train_loss": round(loss.item(), 5), "val_loss": "",
               "lr": f"{sched.get_last_lr()[0]:.3g}", "seconds": round(time.perf_counter() - start, 2)}
        if step % args.eval_every == 0 or step == steps:
            row["val_loss"] = round(evaluate(accelerator, model, val_data, args.batch, args.seq, args.eval_batches), 5)
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{row['val_loss']:.3f}", refresh=False)
        else:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        log.append(row)
        if target is not None and row["val_loss"] != "" and row["val_loss"] <= target:
            break  # every process computed the same (reduced) validation loss: they all stop here
    bar.close()
    return model, step


def write_curve(path: Path, log: list) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["phase", "step", "train_loss", "val_loss", "lr", "seconds"])
        writer.writeheader()
        writer.writerows(log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a checkpoint directory or hub id to start from (default: pretrain a tiny "
                        "RoPE model)")
    parser.add_argument("--encoding", default="alibi", help="the encoding to switch to (default alibi)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="an encoding parameter (repeatable)")
    parser.add_argument("--out", default="out/finetune", help="output directory (default out/finetune)")
    parser.add_argument("--pretrain-steps", type=int, default=200, help="RoPE pretraining steps without --base (default 200)")
    parser.add_argument("--steps", type=int, default=150, help="at most this many fine-tuning steps (default 150)")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="stop once the val loss is within this many nats of the RoPE model's (default 0.03)")
    parser.add_argument("--lr", type=float, default=2e-3, help="pretraining learning rate (default 2e-3)")
    parser.add_argument("--finetune-lr", type=float, default=None, help="default: 2e-3, or 5e-3 with --lora")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters + the encoding's parameters only")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is there")
    parser.add_argument("--batch", type=int, default=8, help="sequences per process and step (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="context length in bytes (default 128)")
    parser.add_argument("--eval-every", type=int, default=10, help="validate every this many steps (default 10)")
    parser.add_argument("--eval-batches", type=int, default=4, help="validation batches (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    # One thread per process by default: a 0.9M-parameter model gains little from intra-op threads, and on
    # small shared VMs two OpenMP threads stall for seconds at a time (see examples/quickstart.py).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (default 1)")
    args = parser.parse_args()
    if min(args.steps, args.batch, args.threads, args.eval_every, args.eval_batches) < 1 or args.seq < 2:
        parser.error("--steps, --batch, --threads, --eval-every and --eval-batches must be >= 1, --seq >= 2")
    params = parse_params(args.param)

    # With no GPU, tell accelerate explicitly: only cpu=True makes it run several CPU processes (torchrun) as DDP.
    has_gpu = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=args.cpu or not has_gpu)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    main_proc = accelerator.is_main_process
    say = accelerator.print
    t0 = time.perf_counter()
    train_data, val_data = load_corpus()
    log: list = []
    ev = lambda m: evaluate(accelerator, m, val_data, args.batch, args.seq, args.eval_batches)

    # 1. The model trained with RoPE: loaded, or trained here and saved (config.json and all).
    if args.base:
        model, base_dir = load_base(args.base), args.base
        tokens = tokenized_corpus(args.base)
        if tokens is not None:
            train_data, val_data = tokens
        elif model.config.vocab_size < 256:
            raise SystemExit(f"--base {args.base}: no tokenizer, and a vocabulary of {model.config.vocab_size} "
                             "cannot read bytes")
        say(f"base: {args.base} ({type(model).__name__}; "
            f"{'its tokenizer' if tokens is not None else 'bytes'}: {len(train_data)} training tokens)")
    else:
        model, base_dir = tiny_llama(), str(out / "rope")
        model, _ = train(accelerator, model, args, "pretrain", args.pretrain_steps, args.lr, train_data, val_data, log)
        model = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        accelerator.wait_for_everyone()
        if main_proc:
            model.save_pretrained(base_dir)
        say(f"pretrained with RoPE for {args.pretrain_steps} steps, saved to {base_dir} (reuse: --base {base_dir})")
    accelerator.free_memory()
    model.to(accelerator.device)
    base_val = ev(model)

    # 2. Switch the encoding: the position signal the weights were trained with is gone.
    before = getattr(model.config, "position_encoding", None) or "native rope"
    hf_posenc.patch_model(model, args.encoding, **params)
    switched_val = ev(model)
    say(f"switched {before} -> {model.config.position_encoding}: val loss {base_val:.3f} -> {switched_val:.3f}")

    # 3. Fine-tune (all weights, or LoRA + the encoding's own parameters), until the loss recovers.
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            modules_to_save=hf_posenc.trainable_modules(model),  # [] for encodings without parameters
        )
        model = get_peft_model(model, lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        say(f"LoRA r={args.lora_rank}, modules_to_save={lora.modules_to_save}: {trainable} trainable parameters")
    lr = args.finetune_lr or (5e-3 if args.lora else 2e-3)
    model, steps = train(accelerator, model, args, "finetune", args.steps, lr, train_data, val_data, log,
                         target=base_val + args.tolerance)
    final_val = ev(model)
    recovered = final_val <= base_val + args.tolerance

    # 4. Save the way that keeps the encoding: unwrap, then save_pretrained (config.json + safetensors).
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    if main_proc:
        model.eval()
        probe = val_data[: 2 * args.seq].view(2, args.seq).to(accelerator.device)
        with torch.no_grad():
            want = model(input_ids=probe).logits
        checks = {}
        if args.lora:
            from peft import PeftModel

            model.save_pretrained(out / "adapter")  # LoRA + the encoding copy + hf_posenc_adapter.json
            base = load_base(base_dir)
            hf_posenc.patch_model(base, model.get_base_model().config.position_encoding)  # patch FIRST
            reloaded = PeftModel.from_pretrained(base, out / "adapter").to(accelerator.device).eval()
            with torch.no_grad():
                checks["adapter reload (patched base + PeftModel.from_pretrained)"] = torch.equal(
                    reloaded(input_ids=probe).logits, want)
            model = model.merge_and_unload()  # a plain patched model: LoRA folded in, the trained encoding kept
            with torch.no_grad():
                want = model(input_ids=probe).logits
        model.save_pretrained(out / "model")
        reloaded = hf_posenc.from_pretrained(out / "model").to(accelerator.device)
        with torch.no_grad():
            checks["model reload (hf_posenc.from_pretrained)"] = torch.equal(reloaded(input_ids=probe).logits, want)
        out.mkdir(parents=True, exist_ok=True)
        write_curve(out / "loss_curve.csv", log)
        summary = {
            "encoding": model.config.position_encoding, "lora": args.lora, "base": base_dir,
            "mixed_precision": args.mixed_precision, "gradient_checkpointing": args.gradient_checkpointing,
            "processes": accelerator.num_processes, "device": str(accelerator.device),
            "val_loss": {"rope": base_val, "switched": switched_val, "finetuned": final_val},
            "finetune_steps": steps, "recovered": recovered, "reload_checks": checks,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print()
        print("hf_posenc fine-tuning")
        print(f"  processes      : {accelerator.num_processes} on {accelerator.device}, mixed precision "
              f"{args.mixed_precision}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
        how = "all weights"
        if args.lora:
            how = "LoRA" + (" + the encoding's parameters" if lora.modules_to_save else "; the encoding has none")
        print(f"  encoding       : {before} -> {model.config.position_encoding} ({how})")
        print(f"  val loss       : rope {base_val:.3f} | switched {switched_val:.3f} | after {steps} fine-tuning "
              f"steps {final_val:.3f} ({'recovered' if recovered else 'not yet recovered'}, tolerance "
              f"{args.tolerance})")
        for what, ok in checks.items():
            print(f"  reload check   : {what}: logits identical: {ok}")
        print(f"  written        : {out / 'loss_curve.csv'}, {out / 'summary.json'}, {out / 'model'}"
              f"{', ' + str(out / 'adapter') if args.lora else ''}")
        print(f"  time           : {time.perf_counter() - t0:.1f} s")
        if not all(checks.values()):
            raise SystemExit("a reloaded model's logits differ from the fine-tuned model's")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
