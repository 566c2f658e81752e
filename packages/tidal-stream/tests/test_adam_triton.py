"""The Triton AdamW kernel (adam_triton) against its torch reference and torch's fused AdamW.

CPU: the reference's Philox against the published test vectors and its rounding statistics; the kernel
itself through the Triton interpreter (``TRITON_INTERPRET=1``, in a subprocess: the variable must be set
before Triton is imported). GPU: bitwise against ``torch._fused_adamw_`` (fp32 moments) and the reference
(bf16 moments), and OffloadAdamW's device update taking the Triton path.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from tidal_stream import OffloadAdamW
from tidal_stream.adam_triton import adamw_reference_, philox_reference, rounding_bits

gpu = pytest.mark.gpu
pytestmark = pytest.mark.usefixtures("one_thread")

_spec = importlib.util.spec_from_file_location(
    "tidal_stream_tinygpt_at", pathlib.Path(__file__).with_name("tinygpt.py")
)
tinygpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tinygpt)

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def test_philox_reference_matches_published_vectors():
    # Random123's known-answer tests for Philox4x32-10: (counter, key) -> output
    cases = [
        ((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, 0xFFFFFFFF_FFFFFFFF, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0x299F31D0 << 32) | 0xA4093822,
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for ctr, key, want in cases:
        got = philox_reference(key, *(torch.tensor([c]) for c in ctr))
        assert tuple(int(g) for g in got) == want


def test_reference_stochastic_rounding_is_unbiased():
    """Rounding with the kernel's random stream: only the two neighbours, mean within 5 sigma of x."""
    n, spacing = 1 << 16, 2.0**-7  # bf16 spacing in [1, 2)
    x = torch.full((n,), 1.5 + 0.3 * spacing)  # 0.3 of the way between two bf16 neighbours
    master, m, v, step = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(())
    v = v.bfloat16()
    # lr = 0 and beta1 = 0: the new first moment is the gradient itself, rounded to bf16
    adamw_reference_(
        master, x, m, v, step, lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0, tensor_id=3
    )
    vals = m.float()
    assert set(vals.unique().tolist()) == {1.5, 1.5 + spacing}
    sigma = spacing * (0.3 * 0.7 / n) ** 0.5
    assert abs(vals.double().mean().item() - x[0].item()) < 5 * sigma


def test_rounding_bits_depend_on_every_key_part():
    a = rounding_bits(7, 1, 2, 4096)
    for other in (rounding_bits(8, 1, 2, 4096), rounding_bits(7, 2, 2, 4096), rounding_bits(7, 1, 3, 4096)):
        assert (a != other).float().mean() > 0.99
    assert torch.equal(a[:1000], rounding_bits(7, 1, 2, 1000))  # a prefix: independent of the tensor size


def test_cpu_device_update_logs_torch_path():
    """Without the interpreter, bf16 moments on the CPU keep torch's path, and say so once."""
    model = tinygpt.make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OffloadAdamW(params, lr=1e-3, gpu_params=params, moment_dtype="bf16")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter routes the CPU to the Triton kernel")
    for step in range(2):
        tinygpt.loss_fn(model, step).backward()
        opt.step()
        opt.zero_grad()
    msgs = [e.message for e in opt.session.events if e.kind == "device-update"]
    assert len(msgs) == 1 and "torch fused AdamW" in msgs[0] and "cpu" in msgs[0]
    opt.close()


_INTERP = textwrap.dedent(
    """
    import torch
    from tidal_stream import adam_triton as A, OffloadAdamW
    from tidal_stream.errors import StreamError
    torch.manual_seed(0)
    SIZES, IDS = [300, 7, 129, 64], [5, 1, 2, 9]
    HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, seed=1234)

    def make(mdt, gdt, wdt):
        ms = [torch.randn(n) for n in SIZES]
        out = dict(masters=ms, grads=[(torch.randn(n) * 0.1).to(gdt) for n in SIZES],
                   exp_avgs=[(torch.randn(n) * 0.01).to(mdt) for n in SIZES],
                   exp_avg_sqs=[(torch.rand(n) * 1e-3).to(mdt) for n in SIZES],
                   steps=[torch.full((), 3.0) for _ in SIZES],
                   weights=[x.to(wdt) for x in ms] if wdt != torch.float32 else None)
        return out

    def clone(d):
        return {k: None if v is None else [t.clone() for t in v] for k, v in d.items()}

    def bits(t):
        return t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)

    def run(d, wd, coef):
        A.adamw_triton_(d["masters"], d["grads"], d["exp_avgs"], d["exp_avg_sqs"], d["steps"],
                        weights=d["weights"], tensor_ids=IDS, clip_coef=coef, weight_decay=wd, **HYPER)

    cases = [(torch.float32, torch.float32, torch.float32, 0.01, None),
             (torch.float32, torch.bfloat16, torch.bfloat16, 0.0, torch.tensor(0.7)),
             (torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.01, torch.tensor(0.7)),
             (torch.bfloat16, torch.float16, torch.float16, 0.01, None),
             (torch.bfloat16, torch.float32, torch.float32, 0.1, None)]
    for mdt, gdt, wdt, wd, coef in cases:
        A.BLOCK, A.CHUNK = 64, 128  # several programs per tensor and a masked tail
        got = make(mdt, gdt, wdt)
        ref, other = clone(got), clone(got)
        for _ in range(2):
            run(got, wd, coef)
        A.BLOCK, A.CHUNK = 32, 256  # another launch configuration: the same bits
        for _ in range(2):
            run(other, wd, coef)
        for _ in range(2):
            for i in range(len(SIZES)):
                w = ref["weights"][i] if ref["weights"] is not None else None
                A.adamw_reference_(ref["masters"][i], ref["grads"][i], ref["exp_avgs"][i], ref["exp_avg_sqs"][i],
                                   ref["steps"][i], weight=w, tensor_id=IDS[i], clip_coef=coef,
                                   weight_decay=wd, **HYPER)
        for k in ("masters", "exp_avgs", "exp_avg_sqs", "steps", "weights"):
            for i, (a, b, c) in enumerate(zip(got[k] or [], ref[k] or [], other[k] or [])):
                assert torch.equal(bits(a), bits(b)), (str(mdt), str(gdt), k, i, (a.float() - b.float()).abs().max())
                assert torch.equal(bits(a), bits(c)), ("launch config", str(mdt), k, i)
        assert not torch.equal(got["masters"][0], make(mdt, gdt, wdt)["masters"][0])

    # unbiased rounding by the kernel itself: one value between two bf16 neighbours, 16384 copies
    n, spacing = 1 << 14, 2.0 ** -7
    A.BLOCK, A.CHUNK = 1024, 4096
    x = torch.full((n,), 1.5 + 0.3 * spacing)
    m = torch.zeros(n, dtype=torch.bfloat16)
    A.adamw_triton_([torch.zeros(n)], [x], [m], [torch.zeros(n, dtype=torch.bfloat16)], [torch.zeros(())],
                    lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0, tensor_ids=[0])
    assert set(m.float().unique().tolist()) == {1.5, 1.5 + spacing}
    sigma = spacing * (0.21 / n) ** 0.5
    assert abs(m.double().mean().item() - x[0].item()) < 5 * sigma

    try:
        A.adamw_triton_(
            [torch.zeros(4)], [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(())],
            tensor_ids=[0], maximize=True, weight_decay=0.0, **HYPER)
        raise AssertionError("maximize=True accepted")
    except StreamError as e:
        assert "maximize" in str(e)

    # OffloadAdamW's device update on the CPU, routed to the kernel by the interpreter
    import importlib.util, pathlib, sys
    spec = importlib.util.spec_from_file_location("tg", pathlib.Path(sys.argv[1]))
    tg = importlib.util.module_from_spec(spec); spec.loader.exec_module(tg)
    A.BLOCK, A.CHUNK = 1024, 8192
    model, ref = tg.make_model(), tg.make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OffloadAdamW(params, lr=1e-3, gpu_params=params, moment_dtype="bf16", max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(4):
        tg.loss_fn(model, step).backward()
        opt.step(); opt.zero_grad()
        tg.loss_fn(ref, step).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step(); ref_opt.zero_grad()
    msgs = [e.message for e in opt.session.events if e.kind == "device-update"]
    assert len(msgs) == 1 and "Triton" in msgs[0], msgs
    d = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert 0 < d < 1e-3, d
    assert opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16
    opt.close()

    # a kernel that fails before running (as one that does not compile): torch's path takes over, recorded
    def broken(*a, **k):
        raise RuntimeError("no such intrinsic")
    A._launch = broken
    model = tg.make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OffloadAdamW(params, lr=1e-3, gpu_params=params, moment_dtype="bf16", max_grad_norm=1.0)
    for step in range(4):
        tg.loss_fn(model, step).backward()
        opt.step(); opt.zero_grad()
    msgs = [e.message for e in opt.session.events if e.kind == "device-update"]
    assert len(msgs) == 2 and "Triton" in msgs[0] and "failed: RuntimeError: no such intrinsic" in msgs[1], msgs
    assert all(float(opt.state[p]["step"]) == 4 for p in params)  # the failed launch's count was undone
    d = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert 0 < d < 1e-3, d
    opt.close()
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_kernel_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    tg = str(pathlib.Path(__file__).with_name("tinygpt.py"))
    out = subprocess.run(
        [sys.executable, "-c", _INTERP, tg], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


_HOPPER_PTX = textwrap.dedent(
    """
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tidal_stream import adam_triton as A

    sig = {"table_ptr": "*i64", "chunks_ptr": "*i64", "scal_ptr": "*fp32", "coef_ptr": "*fp32",
           "master_base": "*fp32", "grad_base": "*bf16", "m_base": "*bf16", "v_base": "*bf16", "w_base": "*bf16",
           "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "weight_decay": "fp32", "seed": "i32"}
    consts = dict(VEC_P=4, VEC_G=8, VEC_M=8, VEC_W=8, BF16_MOMENTS=True, WEIGHT=True, HAS_COEF=True,
                  HAS_WD=True, BLOCK=A.BLOCK, CHUNK=A.CHUNK)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    src = ASTSource(fn=A.adamw_kernel, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 4, "enable_fp_fusion": False}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    p = k.asm["ptx"]
    # IEEE division and square root as torch's fused kernel (nvcc defaults), never the approximate ones
    assert "div.rn.f32" in p and "sqrt.rn.f32" in p and "div.full" not in p and "sqrt.approx" not in p
    # the unmasked path keeps vector accesses: 16-byte fp32 master loads, 8-byte bf16 loads and stores
    assert len(re.findall(r"ld\\.global[.\\w]*\\.v4\\.b32", p)) >= 2, "master loads"
    assert len(re.findall(r"st\\.global[.\\w]*\\.v2\\.b32", p)) >= 6, "bf16 stores"
    assert k.metadata.shared == 0
    # the other specializations a launch can pick: fp32 moments without weight, clip or decay; fp16 grads
    # and weights; a seed of 1 (Triton makes an int argument equal to 1 a constant); unaligned offsets
    for dt, mdt, flags, vec, seed in [
        ("fp32", "fp32", (False, False, False), 4, "i64"),
        ("fp16", "bf16", (True, False, False), 8, "constexpr"),
        ("bf16", "bf16", (True, True, True), 1, "i32"),
    ]:
        sig2 = {**sig, "grad_base": f"*{dt}", "w_base": f"*{dt}", "m_base": f"*{mdt}", "v_base": f"*{mdt}"}
        c2 = {**consts, "BF16_MOMENTS": mdt == "bf16", "WEIGHT": flags[0], "HAS_COEF": flags[1]}
        c2.update(HAS_WD=flags[2], VEC_G=vec, VEC_M=min(vec, 8), VEC_W=vec)
        sig2["seed"] = seed
        if seed == "constexpr":
            c2["seed"] = 1
        src2 = ASTSource(fn=A.adamw_kernel, signature=sig2, constexprs=c2, attrs=attrs)
        p2 = triton.compile(src2, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        assert "div.rn.f32" in p2 and "sqrt.approx" not in p2, (dt, mdt, flags)
    print("ok")
    """
)


def _hopper_compiler() -> bool:
    spec = importlib.util.find_spec("triton")
    return spec is not None and os.path.exists(
        os.path.join(os.path.dirname(spec.origin), "backends/nvidia/bin/ptxas")
    )


@pytest.mark.skipif(not _hopper_compiler(), reason="triton with its bundled CUDA compiler not installed")
def test_kernel_compiles_for_hopper():
    """Compiled for sm_90 without a GPU: IEEE div/sqrt, vectorized memory accesses, no shared memory."""
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "0"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, "-c", _HOPPER_PTX], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- GPU
def _gpu_tensors(mdt: torch.dtype, sizes=(4096 * 257, 1536, 7, 65536 + 3)):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda n, s=1.0: torch.randn(n, device="cuda", generator=g) * s  # noqa: E731
    return dict(
        masters=[mk(n) for n in sizes],
        grads=[mk(n, 0.1) for n in sizes],
        exp_avgs=[mk(n, 0.01).to(mdt) for n in sizes],
        exp_avg_sqs=[mk(n, 0.03).square().to(mdt) for n in sizes],
        steps=[torch.full((), 4.0, device="cuda") for _ in sizes],
    )


@gpu
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("clip", [False, True])
def test_fp32_moments_bitwise_equal_to_torch_fused(wd, clip):
    from tidal_stream.adam_triton import adamw_triton_

    a = _gpu_tensors(torch.float32)
    b = {k: [t.clone() for t in v] for k, v in a.items()}
    coef = torch.tensor(0.37, device="cuda") if clip else None
    for _ in range(3):
        adamw_triton_(**a, tensor_ids=list(range(4)), clip_coef=coef, weight_decay=wd, **_nowd(HYPER))
        grads = [g * coef for g in b["grads"]] if clip else b["grads"]
        torch._foreach_add_(b["steps"], 1)
        torch._fused_adamw_(
            b["masters"], grads, b["exp_avgs"], b["exp_avg_sqs"], [], b["steps"], amsgrad=False,
            maximize=False, weight_decay=wd, **_nowd(HYPER),
        )  # fmt: skip
    for k in ("masters", "exp_avgs", "exp_avg_sqs"):
        for x, y in zip(a[k], b[k]):
            ulp = (x.view(torch.int32).long() - y.view(torch.int32).long()).abs().max().item()
            assert ulp == 0, f"{k}: max {ulp} ulp from torch._fused_adamw_"


def _nowd(h: dict) -> dict:
    return {k: v for k, v in h.items() if k != "weight_decay"}


@gpu
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float16])
def test_bf16_moments_bitwise_equal_to_reference_on_gpu(wdt):
    from tidal_stream.adam_triton import adamw_triton_

    a = _gpu_tensors(torch.bfloat16)
    a["grads"] = [g.to(wdt) for g in a["grads"]]
    a["weights"] = [m.to(wdt) for m in a["masters"]]
    b = {k: [t.clone() for t in v] for k, v in a.items()}
    coef = torch.tensor(0.37, device="cuda")
    adamw_triton_(**a, tensor_ids=[3, 1, 4, 1], seed=9, clip_coef=coef, **HYPER)
    for i, tid in enumerate([3, 1, 4, 1]):
        adamw_reference_(
            *(b[k][i] for k in ("masters", "grads", "exp_avgs", "exp_avg_sqs", "steps")),
            tensor_id=tid, seed=9, weight=b["weights"][i], clip_coef=coef, **HYPER,
        )  # fmt: skip
    for k in ("masters", "exp_avgs", "exp_avg_sqs", "weights"):
        for x, y in zip(a[k], b[k]):
            same = x.view(-1).view(torch.int16 if x.element_size() == 2 else torch.int32)
            assert torch.equal(same, y.view(-1).view(same.dtype)), k


@gpu
def test_offload_adamw_device_update_takes_triton_path():
    """fp32 model: bf16 moments stay within the CPU test's bound of torch AdamW; bf16 model: the weights are
    the masters rounded to nearest."""
    model, ref = tinygpt.make_model(device="cuda"), tinygpt.make_model(device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OffloadAdamW(params, lr=1e-3, gpu_params=params, moment_dtype="bf16", max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    for step in range(10):
        tinygpt.loss_fn(model, step, "cuda").backward()
        opt.step()
        opt.zero_grad()
        tinygpt.loss_fn(ref, step, "cuda").backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    msgs = [e.message for e in opt.session.events if e.kind == "device-update"]
    assert len(msgs) == 1 and "Triton" in msgs[0], msgs
    d = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert 0 < d < 1e-3, d
    opt.close()

    model = tinygpt.make_model(device="cuda", dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OffloadAdamW(params, lr=1e-3, gpu_params=params, moment_dtype="bf16")
    before = [p.detach().clone() for p in params]
    for step in range(3):
        tinygpt.loss_fn(model, step, "cuda").backward()
        opt.step()
        opt.zero_grad()
    for p in params:
        assert torch.equal(p.data, opt.state[p]["master"].bfloat16())
    assert sum(not torch.equal(p.data, b) for p, b in zip(params, before)) > len(params) // 2
    opt.close()
