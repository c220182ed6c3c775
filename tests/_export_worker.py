"""Loads exported checkpoints in a fresh process that never imports hf_posenc (tests/test_export.py).

    python tests/_export_worker.py JOBS.json

JOBS.json is a list of ``{"dir", "auto", "inputs", "out", "new_tokens"}``: the checkpoint written by
``hf_posenc.export_native``, the transformers Auto class that loads it (``AutoModelForCausalLM``, ...), a
``torch.save`` file of input tensors, and where to ``torch.save`` the results. For each job the model is loaded with
a plain ``from_pretrained(dir)`` and, when ``new_tokens`` is set, generates greedily from the inputs' ``prompt``
first (dynamic RoPE scaling keeps the longest length it has seen, so the longer forward comes last); then one
forward on the inputs' ``forward`` tensors. Saved: ``{"output", "generated", "class", "dtype"}``.

Any import of hf_posenc raises ImportError here (a finder in front of ``sys.meta_path``), and the script checks at
the end that no hf_posenc module was loaded.
"""

from __future__ import annotations

import importlib.abc
import json
import sys


class _RefuseHfPosenc(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: D401 (finder protocol)
        if name == "hf_posenc" or name.startswith("hf_posenc."):
            raise ImportError(f"{name}: an exported checkpoint must load without hf_posenc")
        return None


sys.meta_path.insert(0, _RefuseHfPosenc())

import torch  # noqa: E402
import transformers  # noqa: E402


def main(jobs_file: str) -> int:
    torch.set_num_threads(1)
    jobs = json.loads(open(jobs_file).read())
    for job in jobs:
        model = getattr(transformers, job["auto"]).from_pretrained(job["dir"]).eval()
        inputs = torch.load(job["inputs"], weights_only=True)
        result = {"class": type(model).__name__, "dtype": str(model.dtype), "generated": None}
        with torch.no_grad():
            if job.get("new_tokens"):
                n = job["new_tokens"]
                result["generated"] = model.generate(inputs["prompt"], max_new_tokens=n, min_new_tokens=n,
                                                     do_sample=False)
            out = model(**inputs["forward"])
        result["output"] = out.logits
        torch.save(result, job["out"])
    loaded = sorted(m for m in sys.modules if m == "hf_posenc" or m.startswith("hf_posenc."))
    if loaded:
        raise SystemExit(f"hf_posenc was imported: {loaded}")
    print(f"loaded {len(jobs)} exported checkpoint(s) without hf_posenc")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
