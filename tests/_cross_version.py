"""A checkpoint saved under one end of the supported dependency range loads under the other.

    python tests/_cross_version.py save DIR   # patched tiny models: save_pretrained + their logits
    python tests/_cross_version.py load DIR   # hf_posenc.from_pretrained each, same logits?

``make test-oldest`` runs ``save`` with the newest versions and ``load`` with the oldest, and the other way
round. The models cover the three families and the kinds of encoding parameters: a learned table, a score
bias per layer, data-dependent gates (fox: state channels in the KV cache), CoPE's tables, TAPE, ViT's
2D RoPE. Their encoding parameters are perturbed before saving, so that initial values cannot pass for
loaded ones. Logits must agree to 1e-5 (the two ends may run different attention code); prints one line
per model and exits 1 on any difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import main_output, make_model, model_inputs  # noqa: E402

import hf_posenc  # noqa: E402

MODELS = (
    ("llama", "learned", {}),
    ("llama", "fox", {}),
    ("llama", "cope", {}),
    ("llama", "t5", {"per_layer": True}),
    ("gpt2", "kerple", {}),
    ("gpt2", "tape", {}),
    ("vit", "rope2d", {"variant": "mixed"}),
)


def _versions() -> dict[str, str]:
    import accelerate
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "peft": peft.__version__}


def save(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for family, name, params in MODELS:
        model = make_model(family, encoding=name, **params)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in hf_posenc.encoding_module(model).parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            logits = main_output(model(**model_inputs(family)))
        d = root / f"{family}-{name}"
        model.save_pretrained(d)
        torch.save(logits, d / "logits.pt")
        print(f"saved {d.name}")
    (root / "versions.json").write_text(json.dumps(_versions()))


def load(root: Path) -> int:
    saved = json.loads((root / "versions.json").read_text())
    now = _versions()
    print(f"checkpoints saved under {saved}, loaded under {now}")
    failures = 0
    for family, name, _ in MODELS:
        d = root / f"{family}-{name}"
        try:
            model = hf_posenc.from_pretrained(d).eval()
            with torch.no_grad():
                logits = main_output(model(**model_inputs(family)))
            want = torch.load(d / "logits.pt")
            diff = (logits - want).abs().max().item()
            ok = diff <= 1e-5
            print(f"{'ok  ' if ok else 'FAIL'} {d.name}: max |logit difference| {diff:.2e}")
        except Exception as e:  # noqa: BLE001 - reported and counted
            ok = False
            print(f"FAIL {d.name}: {type(e).__name__}: {e}")
        failures += not ok
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("save", "load"):
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.disable_progress_bar()
    root = Path(argv[1])
    if argv[0] == "save":
        save(root)
        return 0
    return load(root)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
