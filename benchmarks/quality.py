"""Perplexity cost of each storage format on real text: a small LM trained on the Python standard library.

    python benchmarks/quality.py --minutes 5          # GPU: ~136M-parameter Llama-style byte LM
    python benchmarks/quality.py --smoke              # CPU, < 1 minute: a tiny model, a few files

No model can be downloaded, so the reference model is trained here: byte-level tokens (vocabulary 256)
from the standard library's ``.py`` files, a fixed ~5 % of the files held out. The trained model is
saved as safetensors and reloaded (through ``tidal_hf.load_model`` when it exists, else transformers),
then for each format the block linears are stored as that format with ``tidal_quant.quantize_model_``
(the head and embeddings stay bf16) and the held-out perplexity per byte is measured before and after a
short LoRA fine-tune (r=16, all projections). Rows go to ``benchmarks/results/quality.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402

FORMATS = ("bf16", "int8", "nf4", "fp8", "nvfp4", "fp8-bwd8", "nf4-fp8")
#: Formats that are another format with options: fp8-bwd8 also computes the input gradient (the path the
#: LoRA adapters' gradients take through each frozen base) on FP8 tensor cores; nf4-fp8 stores NF4 and
#: recasts it to e4m3 per call to run forward and input gradient there (``fp8_compute``).
VARIANTS = {"fp8-bwd8": ("fp8", {"fp8_backward": True}), "nf4-fp8": ("nf4", {"fp8_compute": True})}
HELD_OUT_MOD = 20  # a file is held out when crc32(relative path) % 20 == 0 (about 5 %)

#: The GPU reference model: Llama-style, ~136M parameters with a byte vocabulary.
MODEL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=1024,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
)
SMOKE_MODEL = dict(
    MODEL,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def stdlib_files(limit: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files (sorted; ``limit`` keeps the first ones)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return files[:limit] if limit else files


def is_held_out(rel: str) -> bool:
    """Whether a file (path relative to the stdlib root) belongs to the held-out split."""
    return zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0


def load_corpus(files: list[Path], max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tensors (uint8 → int64 tokens); files joined with a newline.

    Raises:
        ValueError: when either split is empty (too few files).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = bytearray(), bytearray()
    for p in files:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        (held if is_held_out(str(p.relative_to(root))) else train).extend(data + b"\n")
        if max_bytes and len(train) + len(held) >= max_bytes:
            break
    if not train or not held:
        raise ValueError(f"corpus: {len(train)} train and {len(held)} held-out bytes; use more files")
    return _tokens(train), _tokens(held)


def _tokens(buf: bytearray) -> torch.Tensor:
    """Bytes → int64 token ids (the bytearray is writable, so torch can wrap it without a copy)."""
    return torch.frombuffer(buf, dtype=torch.uint8).long()


def windows(data: torch.Tensor, n: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random windows of ``seq`` tokens: ``[n, seq]``."""
    starts = torch.randint(0, data.numel() - seq, (n,), generator=gen)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


@torch.no_grad()
def perplexity(
    model: torch.nn.Module, data: torch.Tensor, seq: int, max_windows: int, device: torch.device
) -> float:
    """Per-byte perplexity over consecutive held-out windows (at most ``max_windows``)."""
    model.eval()
    n = min(max_windows, data.numel() // seq)
    total, count = 0.0, 0
    for i in range(0, n, 8):
        x = torch.stack([data[j * seq : (j + 1) * seq] for j in range(i, min(n, i + 8))]).to(device)  # [b, T]
        with _autocast(device):
            logits = model(input_ids=x).logits.float()  # [b, T, 256]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += x[:, 1:].numel()
    return math.exp(total / count)


def _autocast(device: torch.device) -> Any:
    import contextlib

    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def train(
    model: torch.nn.Module,
    data: torch.Tensor,
    *,
    lr: float,
    seconds: float,
    max_steps: int,
    batch: int,
    seq: int,
    device: torch.device,
    seed: int,
    weight_decay: float = 0.0,
) -> dict[str, Any]:
    """AdamW with linear warm-up and cosine decay over a time budget (or ``max_steps``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0, step, loss = time.perf_counter(), 0, float("nan")
    while step < max_steps and time.perf_counter() - t0 < seconds:
        frac = (time.perf_counter() - t0) / seconds if math.isfinite(seconds) else step / max_steps
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        x = windows(data, batch, seq, gen).to(device)  # [B, T]
        with _autocast(device):
            loss_t = model(input_ids=x, labels=x).loss
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0 or step == 1:
            loss = loss_t.item()
            print(json.dumps({"event": "train", "step": step, "loss": loss}), flush=True)
    return {"steps": step, "seconds": time.perf_counter() - t0, "last_loss": loss_t.item() if step else loss}


def build(shape: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """A fresh Llama-style model of ``shape`` (fp32 master weights; bf16 autocast on the GPU)."""
    import transformers

    cfg = transformers.LlamaConfig(**shape)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains (on "meta" only to count parameters)
        return transformers.AutoModelForCausalLM.from_config(cfg)


def reload(path: Path, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The saved model, through tidal_hf.load_model when it exists (else transformers), and how."""
    import transformers

    how = "transformers.from_pretrained"
    try:
        from tidal_hf import load_model

        return load_model(str(path), quantize=None, dtype=torch.bfloat16).to(device), "tidal_hf.load_model"
    except ImportError:
        pass
    except Exception as exc:  # tidal_hf's loader failing is recorded, and the measurement goes on
        how += f" (tidal_hf.load_model failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return m.to(device), how


def evaluate_format(
    fmt: str,
    path: Path,
    train_data: torch.Tensor,
    held: torch.Tensor,
    a: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """One row: reload, LoRA (B = 0), quantize the base linears, perplexity, LoRA fine-tune, perplexity."""
    from engines.common import add_lora
    from engines.tidal_engine import quantize_base_

    row: dict[str, Any] = {"event": "result", "format": fmt}
    model, how = reload(path, device)
    row["loaded_with"] = how
    model = add_lora(model, seed=a.seed)
    if fmt != "bf16":
        from tidal_quant import bytes_per_weight

        stored, cfg = VARIANTS.get(fmt, (fmt, {}))
        for block in model.get_base_model().model.layers:
            quantize_base_(block, stored, **cfg)
        row["bytes_per_weight"] = bytes_per_weight(stored)
    else:
        row["bytes_per_weight"] = 2.0
    row["ppl_before"] = perplexity(model, held, a.seq, a.eval_windows, device)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters train in fp32
    info = train(
        model,
        train_data,
        lr=a.lora_lr,
        seconds=float("inf"),
        max_steps=a.lora_steps,
        batch=a.batch,
        seq=a.seq,
        device=device,
        seed=a.seed + 1,
    )
    row["ppl_after"] = perplexity(model, held, a.seq, a.eval_windows, device)
    row["lora_final_loss"] = info["last_loss"]
    return row


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Train (or reuse ``--model-dir``), then one row per format."""
    device = torch.device(a.device)
    shape = SMOKE_MODEL if a.smoke else MODEL
    files = stdlib_files(limit=a.files)
    train_data, held = load_corpus(files, max_bytes=a.max_bytes)
    out_dir = Path(a.model_dir) if a.model_dir else Path(tempfile.mkdtemp(prefix="quality-ref-"))
    meta: dict[str, Any] = {"train_bytes": train_data.numel(), "held_out_bytes": held.numel()}
    if not (out_dir / "model.safetensors").exists():
        model = build(shape, device)
        info = train(
            model,
            train_data,
            weight_decay=0.1,  # pre-training; the LoRA fine-tune uses none
            lr=a.lr,
            seconds=a.minutes * 60,
            max_steps=a.max_steps,
            batch=a.batch,
            seq=a.seq,
            device=device,
            seed=a.seed,
        )
        model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
        meta.update(train_steps=info["steps"], train_minutes=round(info["seconds"] / 60, 2))
        del model
    n_params = sum(v.numel() for v in build(shape, torch.device("meta")).parameters())
    meta.update(model=f"Llama-style {n_params / 1e6:.1f}M params, byte vocabulary", lora_steps=a.lora_steps)
    rows = []
    for fmt in a.formats.split(","):
        t0 = time.perf_counter()
        try:
            row = evaluate_format(fmt, out_dir, train_data, held, a, device)
        except Exception as exc:  # a format this build or hardware lacks is a row, not a crash
            row = {
                "event": "result",
                "format": fmt,
                "ppl_before": None,
                "ppl_after": None,
                "note": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160],
            }
        row.update(meta, seconds=time.perf_counter() - t0, device=str(device))
        rows.append(row)
        print(
            json.dumps(
                {
                    "event": "format",
                    "format": fmt,
                    "ppl_before": row.get("ppl_before"),
                    "ppl_after": row.get("ppl_after"),
                    "note": row.get("note", ""),
                }
            ),
            flush=True,
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of quality.py."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="training time of the reference model")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--lora-steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--lora-lr", type=float, default=2e-4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=512)
    ap.add_argument("--files", type=int, default=None, help="use only the first N stdlib files")
    ap.add_argument("--max-bytes", type=int, default=None)
    ap.add_argument("--model-dir", default=None, help="reuse (or keep) the trained reference model here")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "quality.jsonl")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU in well under a minute")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python benchmarks/quality.py``."""
    a = build_parser().parse_args(argv)
    if a.smoke:
        a.device = "cpu"
        a.minutes, a.max_steps, a.lora_steps = (
            min(a.minutes, 0.25),
            min(a.max_steps, 30),
            min(a.lora_steps, 5),
        )
        a.batch, a.seq, a.eval_windows = 4, 64, 16
        a.files, a.max_bytes = a.files or 400, a.max_bytes or 2_000_000
        torch.set_num_threads(1)
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    for f in a.formats.split(","):
        if f not in FORMATS:
            raise SystemExit(f"--formats: got {f!r}; accepted: {', '.join(FORMATS)} (comma-separated)")
    rows = run(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w") as fh:
        for r in rows:
            fh.write(json.dumps(r, default=str) + "\n")
    import report

    print(report.quality_table(rows))
    print(f"\nrows: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
