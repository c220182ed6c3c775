"""FSDP2 and accelerate's FSDP plugin over 2 CPU processes (gloo), run by tests/test_fsdp.py.

    RANK=r WORLD_SIZE=2 python tests/_fsdp_worker.py <file store> <out dir>

One process group for every encoding in :data:`ENCODINGS` (the launch is the expensive part). Per encoding:

1. FSDP2: the patched tiny Llama (same seed on both ranks), ``fully_shard`` on every decoder layer and at
   the root (which holds the encoding's parameters), :data:`STEPS` SGD steps, each rank on its own batch.
   The full state dict is gathered (``get_model_state_dict(full_state_dict=True)``) on both ranks and the
   encoding's entries written to ``<out>/<enc>/fsdp2_rank<r>.safetensors``; rank 0 loads it into an
   unsharded model, ``save_pretrained`` to ``<out>/<enc>/model`` and writes that model's logits on
   :func:`probe` to ``<out>/<enc>/logits.safetensors``.
2. accelerate: the same model through ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``
   (accelerate enables its FSDP path only on accelerators; on CPU the state is set to FSDP by hand, see
   :func:`fsdp_accelerator`). :data:`STEPS` steps, ``save_state`` (a sharded checkpoint: one file per
   rank), one more step; then a new accelerator, model and optimizer ``load_state`` from the checkpoint and
   take the same step. Both ranks write the full state dict of both runs after the extra step.

The test imports ``build``, ``batch``, ``probe``, ``ENCODINGS``, ``STEPS`` and ``LR`` to replay the run in
one process on both batches.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_posenc

#: Encodings with parameters: a score bias (kerple), data-dependent gates in the cache (fox), a custom
#: attention with learned position tables (cope), learned buckets (t5, one table per layer).
ENCODINGS = (("kerple", {}), ("fox", {}), ("cope", {}), ("t5", {"per_layer": True}))
STEPS = 3
LR = 0.5


def build(encoding: str, params: dict, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    hf_posenc.patch_model(model, encoding, **params)
    return model.train()


def batch(rank: int, step: int) -> torch.Tensor:
    """(2, 12) token ids, different on each rank and step."""
    return torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1000 * step + 100 + rank))


def probe() -> torch.Tensor:
    """(2, 9) token ids for comparing logits."""
    return torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(7))


def shard(model: LlamaForCausalLM) -> LlamaForCausalLM:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # the root: embeddings, norm, head and the encoding (base.posenc)
    return model


def step(model, opt, rank: int, i: int) -> None:
    x = batch(rank, i)
    loss = model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def fsdp_accelerator(plugin_kwargs: dict):
    """An ``Accelerator`` on its FSDP2 path over gloo, and a function that puts it back on it. accelerate
    switches to FSDP only for accelerator devices (``AcceleratorState``: MULTI_GPU, MULTI_XPU, ...), so on
    CPU its state is set to FSDP here; everything after that (``prepare`` -> ``fsdp2_prepare_model``,
    ``save_state``/``load_state``) is accelerate's own code."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    # The process group exists already; accelerate still reads these (a single-node, loopback launch).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_kwargs)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)

    def force() -> None:  # accelerate re-derives the state in places; set it before each of its calls
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin

    force()
    return acc, force


def accelerate_fsdp2_missing() -> str | None:
    """Why accelerate's FSDP2 plugin cannot run here (e.g. accelerate 1.3 has no ``fsdp_version``), or None."""
    import inspect

    import accelerate
    from accelerate import FullyShardedDataParallelPlugin

    if "fsdp_version" not in inspect.signature(FullyShardedDataParallelPlugin).parameters:
        return (f"accelerate {accelerate.__version__} has no FSDP2 plugin "
                "(FullyShardedDataParallelPlugin(fsdp_version=2))")
    return None


def main() -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    import time

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    store, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    print(f"rank {rank}: process group after {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        for name, params in ENCODINGS:
            d = os.path.join(out, name)
            os.makedirs(d, exist_ok=True)
            # 1. FSDP2 by hand
            model = shard(build(name, params))
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            for i in range(STEPS):
                step(model, opt, rank, i)
            sd = full_state(model)
            enc_keys = [k for k in sd if ".posenc." in k]
            save_file({k: sd[k] for k in enc_keys}, os.path.join(d, f"fsdp2_rank{rank}.safetensors"))
            if rank == 0:
                plain = build(name, params)
                plain.load_state_dict(sd)
                plain.eval().save_pretrained(os.path.join(d, "model"))
                with torch.no_grad():
                    logits = plain(input_ids=probe()).logits
                save_file({"logits": logits.contiguous()}, os.path.join(d, "logits.safetensors"))
            dist.barrier()
            # 2. accelerate's FSDP plugin: a sharded save_state, then resume from it
            missing = accelerate_fsdp2_missing()
            if missing:
                with open(os.path.join(d, "accelerate_skipped.txt"), "w") as f:
                    f.write(missing)
                continue
            results = {}
            for run in ("continued", "resumed"):
                acc, force = fsdp_accelerator({"state_dict_type": "SHARDED_STATE_DICT",
                                        "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"],
                                        "auto_wrap_policy": "transformer_based_wrap"})
                model = build(name, params)
                opt = torch.optim.SGD(model.parameters(), lr=LR)
                model, opt = acc.prepare(model, opt)
                assert type(model).__name__.startswith("FSDP"), type(model)
                ckpt = os.path.join(d, "accelerate_state")
                if run == "continued":
                    for i in range(STEPS):
                        step(model, opt, rank, i)
                    force()
                    acc.save_state(ckpt)
                else:
                    force()
                    acc.load_state(ckpt)
                step(model, opt, rank, STEPS)
                results[run] = full_state(model)
                acc.wait_for_everyone()
            save_file({f"{run}.{k}": v for run, sd in results.items() for k, v in sd.items()},
                      os.path.join(d, f"accelerate_rank{rank}.safetensors"))
            if rank == 0:
                names = sorted(os.listdir(ckpt))
                with open(os.path.join(d, "accelerate_files.txt"), "w") as f:
                    f.write("\n".join(f"{n}: {sorted(os.listdir(os.path.join(ckpt, n)))}"
                                      if os.path.isdir(os.path.join(ckpt, n)) else n for n in names))
            dist.barrier()
            print(f"rank {rank}: {name} done after {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        dist.destroy_process_group()
        print(f"rank {rank}: destroyed after {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
