"""A/B of two tidal-kv versions in one process: ``interleaved.py`` with a ``tidal-base`` engine over another tree.

```bash
# on this machine: the baseline's tidal-kv sources into an ignored folder, carried to the GPU machine
git archive <rev> packages/tidal-kv/src | tar -x -C .diag/base
python3 benchmarks/kv/ab.py --baseline .diag/base/packages/tidal-kv/src --context 4096 --steps 120
python3 benchmarks/kv/ab.py --baseline .diag/base/packages/tidal-kv/src --storage nf4  # both over NF4 pages
python3 benchmarks/kv/ab.py --baseline packages/tidal-kv/src --smoke   # tiny Llama on the CPU
```

At batch 1 a decode step is bound by the host, and the host's speed drifts between processes by more than a
host-path change moves the step (three runs in a row of one version read 0.893-0.900x DynamicCache). Here
the baseline's ``PagedKVCache`` (copied under another package name, ``tidal_kv_base``, with its imports
rewritten) serves ``tidal-base``, a TidalCache built like ``tidal``'s (``tidal-fp8``'s or ``tidal-nf4``'s with
``--storage``), and both step in the same rotated
rounds as DynamicCache: the ``paired_ratio`` columns of the two compare the versions on the same host.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (decode_worker) and benchmarks/ (engines: the scenario)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

BASE_NAME = "tidal_kv_base"
_IMPORT = re.compile(r"\b(from|import) tidal_kv\b")


def load_baseline(
    src: Path, into: Path, name: str = BASE_NAME, patch: Callable[[dict[str, str]], None] | None = None
) -> Any:
    """Copy the ``tidal_kv`` package under ``src`` to ``into/<name>`` (imports rewritten) and import it.

    Args:
        src: A tidal-kv ``src`` folder (it holds ``tidal_kv/``).
        into: A folder to put the copy in (added to ``sys.path``).
        name: The copy's package name.
        patch: Edits the copy's sources in place (module file name -> text) before they are written
            (``variants.py``'s engines).

    Returns:
        The imported package.
    """
    pkg = src / "tidal_kv"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"--baseline={src} is not a tidal-kv src folder: it has no tidal_kv/__init__.py")
    dst = into / name
    shutil.copytree(pkg, dst, ignore=shutil.ignore_patterns("__pycache__"))
    files = {f.name: f.read_text() for f in dst.glob("*.py")}
    if patch is not None:
        patch(files)
    for fname, text in files.items():
        (dst / fname).write_text(_IMPORT.sub(lambda m: f"{m.group(1)} {name}", text))
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    import importlib

    return importlib.import_module(name)


def with_packages(make_cache: Any, packages: dict[str, Any], like: str = "tidal") -> Any:
    """``decode_worker.make_cache`` that also builds each engine of ``packages`` (engine -> a tidal-kv copy):
    engine ``like``'s TidalCache (its page format too) over that copy's ``PagedKVCache``."""

    def make(engine: str, model: Any, max_tokens: int, page_tokens: int, slots: int) -> Any:
        if engine not in packages:
            return make_cache(engine, model, max_tokens, page_tokens, slots)
        cache = make_cache(like, model, max_tokens, page_tokens, slots)
        c = cache.paged.config
        paged = packages[engine].PagedKVCache(
            c.num_layers,
            c.max_tokens,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            resident_layers=c.resident_layers,
            page_tokens=c.page_tokens,
            vram_budget=c.vram_budget,
            vram_fraction=c.vram_fraction,
            storage=c.storage,
            prefetch_slots=c.prefetch_slots,
        )
        cache.paged = paged  # the adapter's layers read the paged cache through these references
        for layer in cache.layers:
            layer._paged = paged
        return cache

    return make


STORAGES = ("native", "fp8", "nf4")


def pop_storage(argv: list[str]) -> str:
    """Remove ``--storage FORMAT`` from ``argv``; the engine whose TidalCache keeps pages in that format
    (``tidal``, ``tidal-fp8`` or ``tidal-nf4``; ``tidal`` when the option is absent)."""
    storage = "native"
    if "--storage" in argv:
        i = argv.index("--storage")
        storage = argv[i + 1] if i + 1 < len(argv) else ""
        if storage not in STORAGES:
            raise SystemExit(f"--storage={storage!r} is not accepted: expected one of {', '.join(STORAGES)}")
        del argv[i : i + 2]
    return "tidal" if storage == "native" else f"tidal-{storage}"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    like = pop_storage(argv)
    if "--baseline" not in argv:
        raise SystemExit("ab.py needs --baseline SRC (a tidal-kv src folder; see the module docstring)")
    i = argv.index("--baseline")
    src = Path(argv[i + 1])
    del argv[i : i + 2]
    if "--engines" not in argv:
        argv += ["--engines", f"dynamic,{like},tidal-base,tidal-resident"]
    import decode_worker
    import interleaved

    with tempfile.TemporaryDirectory() as tmp:
        base = load_baseline(src, Path(tmp))
        decode_worker.make_cache = with_packages(decode_worker.make_cache, {"tidal-base": base}, like)
        print(f"tidal-base: PagedKVCache from {src}", flush=True)
        return interleaved.main(argv)


if __name__ == "__main__":
    main()
