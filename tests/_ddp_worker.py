"""One DDP training step of a patched tiny Llama per learned encoding, run by tests/test_ecosystem.py.

    RANK=r WORLD_SIZE=2 python tests/_ddp_worker.py <file store> <out dir>

Each rank builds its model from a different seed (DDP broadcasts rank 0's weights when it wraps the
model), takes one SGD step on its own batch (gradients are averaged across ranks), and writes the
encoding's parameters after the step to ``<out dir>/rank<r>.safetensors``. The test imports ``build``,
``batch`` and ``LR`` to replay the same step in one process on both batches.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_posenc

#: (encoding, params): one learned table, one pair of learned kernel parameters, learned buckets per layer.
ENCODINGS = (("learned", {}), ("kerple", {}), ("t5", {"per_layer": True}))
LR = 0.5


def build(encoding: str, params: dict, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    hf_posenc.patch_model(model, encoding, **params)
    return model.train()


def batch(rank: int) -> torch.Tensor:
    """(2, 12) token ids, different on each rank."""
    return torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(100 + rank))


def main() -> None:
    import faulthandler

    import torch.distributed as dist

    # a rank that hangs prints its stacks and exits before the test's own timeout (240 s)
    faulthandler.dump_traceback_later(float(os.environ.get("HF_POSENC_DDP_STACKS_AFTER", "200")), exit=True)
    from safetensors.torch import save_file
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    store, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tensors = {}
        for name, params in ENCODINGS:
            model = build(name, params, seed=rank)
            ddp = DDP(model)  # broadcasts rank 0's parameters; every parameter is used (no unused-parameter search)
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            x = batch(rank)
            loss = ddp(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            opt.step()
            for key, value in hf_posenc.encoding_module(model).state_dict().items():
                tensors[f"{name}.{key}"] = value.detach().clone().contiguous()
            tensors[f"{name}.loss"] = loss.detach().reshape(1)
        save_file(tensors, os.path.join(out, f"rank{rank}.safetensors"))
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every collective has completed (the last one in the last backward) and the results are saved. Leave
    # without tearing the process group down or running the interpreter's shutdown: with torch 2.13 (CPU,
    # gloo) one rank sometimes waited forever there under pytest (not root-caused), which hung the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
