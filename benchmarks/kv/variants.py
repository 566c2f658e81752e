"""What each part of an offloaded layer's decode step costs: ``interleaved.py`` with TidalCache variants.

```bash
python3 benchmarks/kv/variants.py --context 4096 --steps 60      # the GPU machine, ~1 min
python3 benchmarks/kv/variants.py --context 32768 --storage nf4  # the variants over NF4 host pages
python3 benchmarks/kv/variants.py --smoke                        # tiny Llama on the CPU
```

At batch 1 a decode step is bound by the host, and TidalCache's offloaded layers cost it more than their
calls do one at a time (``host_costs.py``). Each variant is a copy of tidal-kv (``ab.load_baseline``) with one
part of the offloaded path taken out, stepped in the same rotated rounds as DynamicCache, ``tidal`` and
``tidal-resident`` (every layer resident: the cache's own path without offloading):

With ``--storage fp8`` or ``nf4`` the variants and the measured engine (``tidal-fp8`` / ``tidal-nf4`` in place of
``tidal``) keep their full pages in that format.

- ``tidal-nocopy``: no page copy and no dequantization is issued (the slot holds stale K/V: timing only);
- ``tidal-noev``: no CUDA event is recorded or waited on (copies unordered: timing only);
- ``tidal-bare``: both, leaving the offloaded path's Python and its token and tail-page copies;
- ``tidal-onestream``: the page copies on the compute stream, with no events (correct: stream order);
- ``tidal-eager``: gathers never replayed as CUDA graphs (see [Note: gather graphs] in ``tidal_kv.slots``);
- ``tidal-3slots``: three gather slots (not in the default list: an A/B of ``--slots`` in the same rounds);
- ``tidal-compute`` / ``tidal-side``: ``gather_stream`` fixed to "compute" / "side" whatever the engine passes
  (not in the default list: an A/B of the stream ``"auto"`` picks, in the same rounds).

The ``paired_ratio`` columns then split tidal's gap to DynamicCache between the offloaded layers' host
path (``bare`` against ``resident``), their events and their copies.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (ab, decode_worker) and benchmarks/ (engines: the scenario)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

SRC = HERE.parents[1] / "packages" / "tidal-kv" / "src"
DEFAULT_ENGINES = (
    "dynamic,tidal,tidal-resident,tidal-nocopy,tidal-noev,tidal-bare,tidal-onestream,tidal-eager"
)


def _replace(files: dict[str, str], module: str, old: str, new: str) -> None:
    """Replace ``old`` (which must occur) by ``new`` in ``module``'s source."""
    if old not in files.get(module, ""):
        raise SystemExit(f"variants.py: {module} no longer contains {old!r}; update the variant")
    files[module] = files[module].replace(old, new)


def no_copies(files: dict[str, str]) -> None:
    """Issue no page copy or dequantization in gathers (the partial page's copy stays)."""
    _replace(files, "slots.py", "copies = tuple(c for run in self.runs for c in run.copies)", "copies = ()")
    _replace(
        files,
        "slots.py",
        "decodes = tuple(_on_stream(run.decode) for run in self.runs if run.decode is not None)",
        "decodes = ()",
    )


def no_events(files: dict[str, str]) -> None:
    """Record and wait on no CUDA event (``streams.record`` returns None, ``streams.wait`` returns at once)."""
    _replace(
        files,
        "streams.py",
        "    if stream is None:\n        return None\n    ev =",
        "    return None\n    ev =",
    )
    _replace(files, "streams.py", "    if stream is None or event is None:\n        return\n", "    return\n")


def eager(files: dict[str, str]) -> None:
    """Never capture a gather as a CUDA graph: issue its copies and dequantization one call each."""
    _replace(files, "slots.py", "self.capture = capture", "self.capture = False")


def three_slots(files: dict[str, str]) -> None:
    """Three device gather slots whatever ``--slots`` says (two layers' gathers in flight ahead of use)."""
    _replace(files, "paged.py", "n_slots = min(c.prefetch_slots,", "n_slots = min(3,")


def _fixed_stream(stream: str) -> Any:
    def fixed(files: dict[str, str]) -> None:
        _replace(
            files,
            "paged.py",
            "self._policy = GatherStreamPolicy(gather_stream)",
            f'self._policy = GatherStreamPolicy("{stream}")',
        )

    fixed.__doc__ = f'``gather_stream="{stream}"`` whatever the cache is given.'
    return fixed


def bare(files: dict[str, str]) -> None:
    """:func:`no_copies` and :func:`no_events`."""
    no_copies(files)
    no_events(files)


def one_stream(files: dict[str, str]) -> None:
    """Page copies on the compute stream (ordered by it, so no events)."""
    for side in ("_h2d", "_d2h"):
        _replace(
            files,
            "paged.py",
            f"self.{side} = torch.cuda.Stream(self._device)",
            f"self.{side} = torch.cuda.current_stream(self._device)",
        )
    no_events(files)


VARIANTS = {
    "tidal-nocopy": no_copies,
    "tidal-noev": no_events,
    "tidal-bare": bare,
    "tidal-onestream": one_stream,
    "tidal-eager": eager,
    "tidal-3slots": three_slots,
    "tidal-compute": _fixed_stream("compute"),
    "tidal-side": _fixed_stream("side"),
}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    import ab

    like = ab.pop_storage(argv)
    if "--engines" not in argv:
        argv += ["--engines", DEFAULT_ENGINES.replace("dynamic,tidal,", f"dynamic,{like},")]
    import decode_worker
    import interleaved

    names = argv[argv.index("--engines") + 1].split(",")
    with tempfile.TemporaryDirectory() as tmp:
        packages = {
            e: ab.load_baseline(SRC, Path(tmp), "tidal_kv_" + e.split("-", 1)[1], VARIANTS[e])
            for e in names
            if e in VARIANTS
        }
        decode_worker.make_cache = ab.with_packages(decode_worker.make_cache, packages, like)
        return interleaved.main(argv)


if __name__ == "__main__":
    main()
