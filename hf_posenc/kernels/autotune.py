"""Choose between exact engine paths by timing them on the machine at hand (CPU), once, then cache the choice.

Where the tile-wise engine has several exact paths for one case (a *site*: e.g. a Toeplitz term through torch's
fused CPU attention kernel split at the diagonal, or through batched-matmul tiles), which one is fastest depends
on the CPU: the fused kernel's backward, called per tile, was the fastest path on an AMD EPYC VM and the slowest
on an Intel Xeon with AVX-512/AMX (910 ms against 32 ms per layer for SDPA's own backward, DESIGN.md). So the
engine asks `choose`, which times every path on the first call for that case and keeps the fastest:

* per CPU model, torch version and thread count (the cache file's key), and per site, shape class (each size
  rounded up to a power of two) and dtype (the entry's key);
* in-process, and in ``<cache>/autotune-<cpu>-torch<version>.json`` where ``<cache>`` is ``$HF_POSENC_CACHE``,
  else ``$XDG_CACHE_HOME/hf_posenc``, else ``~/.cache/hf_posenc``;
* another path replaces the site's default only when it measures `SWITCH_MARGIN` (15 %) faster;
* the paths give the same numbers to rounding (each site's tests check it), so a choice changes only speed.

``HF_POSENC_TUNE=off`` takes each site's fixed default (no timing, no file). ``HF_POSENC_TUNE_FORCE=site=path``
(comma-separated for several sites) forces a path. Under ``torch.compile``, and on devices other than the CPU,
nothing is timed: the default (or a cached or forced choice) is used. Timing costs at most
`TUNE_BUDGET_S` per case and prints one line to stderr saying so. `clear_cache` forgets every choice.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..machine import cpu_id

__all__ = ["ENV_FORCE", "ENV_TUNE", "Site", "TUNE_BUDGET_S", "cache_path", "choose", "clear_cache", "register_site",
           "shape_class", "sites"]

logger = logging.getLogger(__name__)

ENV_TUNE = "HF_POSENC_TUNE"
ENV_FORCE = "HF_POSENC_TUNE_FORCE"
#: the most time the timing of one (site, case) may take, in seconds (each path runs at least twice).
TUNE_BUDGET_S = 2.0
#: how much faster (a fraction of the default's time) another path must measure to replace the default.
SWITCH_MARGIN = 0.15


@dataclass(frozen=True)
class Site:
    """One place with several exact paths: its ``name``, the ``paths`` and the ``default`` (``HF_POSENC_TUNE=off``)."""

    name: str
    paths: tuple[str, ...]
    default: str
    help: str


_SITES: dict[str, Site] = {}
_MEMORY: dict[str, dict[str, str]] = {}
_LOCK = threading.Lock()
_ANNOUNCED: set[str] = set()


def register_site(name: str, paths: tuple[str, ...], default: str, help: str) -> Site:
    """Declare a site (idempotent for the same declaration)."""
    if default not in paths:
        raise ValueError(f"default {default!r} of site {name!r} is not one of its paths {paths}")
    site = Site(name, tuple(paths), default, help)
    if name in _SITES and _SITES[name] != site:
        raise ValueError(f"autotune site {name!r} is already declared as {_SITES[name]}")
    _SITES[name] = site
    return site


def sites() -> dict[str, Site]:
    """Every declared site by name."""
    return dict(_SITES)


def shape_class(**sizes: int) -> str:
    """``shape_class(L=1500, H=8)`` -> ``"L2048-H8"``: each size rounded up to a power of two."""
    return "-".join(f"{k}{1 << max(0, int(v) - 1).bit_length()}" for k, v in sizes.items())


def _cache_dir() -> Path:
    if os.environ.get("HF_POSENC_CACHE"):
        return Path(os.environ["HF_POSENC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_posenc"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()[:80] or "cpu"


def cache_path() -> Path:
    """The cache file of this CPU model and torch version."""
    return _cache_dir() / f"autotune-{_slug(cpu_id())}-torch{_slug(torch.__version__)}.json"


def _forced(site: Site) -> str | None:
    text = os.environ.get(ENV_FORCE, "").strip()
    if not text:
        return None
    for item in text.split(","):
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV_FORCE} must be 'site=path[,site=path]', got {text!r}")
        name, path = name.strip(), path.strip()
        if name not in _SITES:
            raise ValueError(f"{ENV_FORCE}: unknown site {name!r}; sites: {', '.join(sorted(_SITES))}")
        if name == site.name:
            if path not in site.paths:
                raise ValueError(f"{ENV_FORCE}: site {name!r} has paths {', '.join(site.paths)}; got {path!r}")
            return path
    return None


def _tuning_on() -> bool:
    value = os.environ.get(ENV_TUNE, "on").strip().lower()
    if value not in ("on", "off", "1", "0", "true", "false"):
        raise ValueError(f"{ENV_TUNE} must be 'on' or 'off', got {value!r}")
    return value in ("on", "1", "true")


def _file_key() -> str:
    return cache_path().name


def _load() -> dict[str, str]:
    key = _file_key()
    if key not in _MEMORY:
        entries: dict[str, str] = {}
        try:
            data = json.loads(cache_path().read_text())
            if isinstance(data, dict) and isinstance(data.get("choices"), dict):
                entries = {str(k): str(v) for k, v in data["choices"].items()}
        except (OSError, ValueError):
            pass  # no file yet, or a damaged one: tune again
        _MEMORY[key] = entries
    return _MEMORY[key]


def _store(entry: str, path: str) -> None:
    choices = _load()
    choices[entry] = path
    file = cache_path()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"cpu": cpu_id(), "torch": torch.__version__, "choices": choices}, indent=1,
                                  sort_keys=True))
        os.replace(tmp, file)
    except OSError as e:  # a read-only home: the choice stays in this process
        logger.debug("hf_posenc autotune: cannot write %s (%s); the choice is kept in this process", file, e)


def clear_cache() -> None:
    """Forget every choice: in this process and the file of this CPU and torch version."""
    _MEMORY.clear()
    try:
        cache_path().unlink()
    except FileNotFoundError:
        pass


def choose(site: str, case: str, run: Callable[[str], object], *, device: torch.device | str = "cpu",
           dtype: torch.dtype | None = None) -> str:
    """The path of ``site`` to take for ``case`` (a `shape_class` string, or any stable text).

    ``run(path)`` runs the work once along ``path`` (on inputs of the case's shape; its result is discarded).
    It is called only when the choice is not known yet, tuning is on, the device is the CPU and nothing is being
    compiled.
    """
    spec = _SITES.get(site)
    if spec is None:
        raise ValueError(f"unknown autotune site {site!r}; sites: {', '.join(sorted(_SITES))}")
    forced = _forced(spec)
    if forced is not None:
        return forced
    if not _tuning_on():
        return spec.default
    entry = f"{site}|{case}|{dtype}|threads={torch.get_num_threads()}"
    with _LOCK:
        known = _load().get(entry)
    if known in spec.paths:
        return known
    if torch.device(device).type != "cpu" or torch.compiler.is_compiling():
        return spec.default
    if site not in _ANNOUNCED:
        _ANNOUNCED.add(site)
        print(f"hf_posenc: timing {len(spec.paths)} exact paths of {site} for {case} on this CPU (once; the choice "
              f"is cached in {cache_path()}; HF_POSENC_TUNE=off skips this)", file=sys.stderr)
    best = _measure(spec, run)
    logger.debug("hf_posenc autotune: %s -> %s", entry, best)
    with _LOCK:
        _store(entry, best)
    return best


def _measure(site: Site, run: Callable[[str], object]) -> str:
    """The fastest path by the median of interleaved rounds (A B A B ...), within `TUNE_BUDGET_S`."""
    times: dict[str, list[float]] = {p: [] for p in site.paths}
    start = time.perf_counter()
    rounds = 0
    for path in site.paths:  # warm-up: first calls allocate and fault pages in
        run(path)
    while rounds < 7:
        for path in site.paths:
            t0 = time.perf_counter()
            run(path)
            times[path].append(time.perf_counter() - t0)
        rounds += 1
        if rounds >= 2 and time.perf_counter() - start > TUNE_BUDGET_S:
            break
    med = {p: sorted(ts)[len(ts) // 2] for p, ts in times.items()}
    best = min(site.paths, key=lambda p: (med[p], p != site.default))
    # Another path replaces the default only when it is clearly faster: a few rounds on a shared machine move by
    # 10 % (FIRE's L = 2048 training step flipped to the slower path on such noise, measured).
    return best if med[best] < (1.0 - SWITCH_MARGIN) * med[site.default] else site.default

