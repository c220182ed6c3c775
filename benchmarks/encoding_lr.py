"""How far an inert term moves in a short fine-tune, per learning rate of the encoding: the measurement behind
``hf_posenc.training.ENCODING_LR`` (docs/compositions.md).

    python benchmarks/encoding_lr.py                                  # SmolLM2-135M-Instruct, fire and fox
    python benchmarks/encoding_lr.py --terms fire --encoding-lrs 1e-4 1e-2 --steps 12

For each term and each encoding learning rate: the pretrained checkpoint (``--from``, default the cached
SmolLM2-135M-Instruct) is patched with ``rope+<term>`` and ``init="identity"`` (the unpatched logits at step 0)
and fine-tuned by the conversion study's recipe (``hf_posenc.study.train.fine_tune``: AdamW betas 0.9, 0.95
over ``hf_posenc.param_groups``, the model at ``--lr``, the encoding at the rate measured; warm-up over 10 %
of the steps then cosine; gradients clipped to norm 1), on the study's text (``pydoc_data.topics`` in the
checkpoint's tokens, the training split), the same batches for every run. Then, on the study's held-out tokens in
windows of the fine-tuning length:

* ``term_effect``: the largest |logit| difference between the fine-tuned model and the same model with its term
  set back to inert (``start_inert``), i.e. what the term learned, apart from what the rest of the model learned;
* ``perplexity`` of the fine-tuned model and ``perplexity_term_inert`` of that same model with the term inert:
  whether what the term learned helps or harms on held-out text.

``--encoding-lrs`` equal to ``--lr`` is the fine-tune without a separate rate (one rate for every parameter);
``default`` is ``hf_posenc.param_groups``' own default for the term (the documented recipe).
Writes JSON (default ``benchmarks/results/encoding_lr_<device>.json``) and prints a markdown table.
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

import hf_posenc  # noqa: E402
from hf_posenc.study.pretrained import PretrainedTextSource, load_pretrained, resolve_source, term_effect  # noqa: E402
from hf_posenc.study.train import StudyConfig, deterministic, fine_tune, make_optimizer  # noqa: E402


def run(term: str, encoding_lr: float | None, data: PretrainedTextSource, config: StudyConfig) -> dict:
    torch.manual_seed(config.seed)
    model = load_pretrained(resolve_source(config.source))
    hf_posenc.patch_model(model, f"rope+{term}", init="identity")
    run_config = StudyConfig(**{**config.__dict__, "encoding_lr": encoding_lr})
    rates = [g["lr"] for g in make_optimizer(model, run_config)[0].param_groups if g.get("name") != "model"]
    t0, cpu0 = time.perf_counter(), time.process_time()
    losses = fine_tune(model, data.train_batches(), run_config, config.steps, torch.device("cpu"))
    train_s, train_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "term": term, "encoding_lr": encoding_lr, "encoding_group_lrs": rates, "lr": config.lr,
        **term_effect(model, data.windows[config.train_len]),
        "train_losses": losses, "train_seconds": round(train_s, 1), "train_cpu_seconds": round(train_cpu, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", default="smollm2", help="checkpoint directory, hub id or 'smollm2'")
    p.add_argument("--terms", nargs="+", default=["fire", "fox"])
    p.add_argument("--encoding-lrs", nargs="+", default=["1e-4", "1e-3", "3e-3", "1e-2", "3e-2", "1e-1"],
                   help="encoding learning rates; 'default' for hf_posenc.param_groups' own defaults")
    p.add_argument("--lr", type=float, default=1e-4, help="the model's learning rate (default 1e-4, the study's)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--train-len", type=int, default=256)
    p.add_argument("--eval-tokens", type=int, default=1024, help="held-out tokens scored (windows of --train-len)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/encoding_lr_<device>.json)")
    args = p.parse_args()
    config = StudyConfig(source=args.source, lr=args.lr, steps=args.steps, batch=args.batch, train_len=args.train_len,
                         eval_tokens=args.eval_tokens, factors=[1], out=None).resolved()
    device = torch.device("cpu")
    default_out = ROOT / "benchmarks" / "results" / f"encoding_lr_{slug(device_name(device))}.json"
    out = Path(args.out) if args.out else default_out
    rows = []
    with deterministic(device, args.threads):
        data = PretrainedTextSource(config, [config.train_len])
        record = {"what": __doc__.split("\n\n")[0], "settings": vars(args), "device": device_name(device),
                  "threads": args.threads, "load_average_at_start": os.getloadavg(), **versions(), "runs": rows}
        for term in args.terms:
            for text in args.encoding_lrs:
                lr = None if text == "default" else float(text)
                r = run(term, lr, data, config)
                rows.append(r)
                print(f"rope+{term} encoding_lr {text} {r['encoding_group_lrs']}: term effect "
                      f"{r['term_effect_max']:.3f} (mean "
                      f"{r['term_effect_mean']:.4f}), perplexity {r['perplexity']:.3f} (term inert "
                      f"{r['perplexity_term_inert']:.3f}), {r['train_seconds']:.0f} s", file=sys.stderr, flush=True)
                record["load_average_at_end"] = os.getloadavg()
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(record, indent=2) + "\n")
    print("| term | encoding lr | term effect (max abs logit) | mean | perplexity | term set inert |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = "default " + "/".join(f"{x:g}" for x in r["encoding_group_lrs"]) if r["encoding_lr"] is None else (
            f"{r['encoding_lr']:g}")
        print(f"| rope+{r['term']} | {rate} | {r['term_effect_max']:.3f} | {r['term_effect_mean']:.4f} "
              f"| {r['perplexity']:.3f} | {r['perplexity_term_inert']:.3f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
