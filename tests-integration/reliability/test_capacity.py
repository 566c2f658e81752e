"""Capacity: a run that would exceed host RAM or the page-lock limit is refused before training starts,
with the numbers, and leaves nothing behind (the model not wrapped, no arena bytes, no worker thread).

``wrap()`` has no host-RAM option of its own; what it offers is:

- the host buffers' arena cap (0.7 x physical RAM, and ``ulimit -l`` when page-locked): simulated here by
  lowering the physical-RAM figure the arena reads, and on the GPU machine by a real ``ulimit -l``;
- the planner (``PlanConfig(host_ram=...)`` / ``profile_hardware(host_ram=...)``), whose ``Plan`` is
  handed to ``wrap(plan=...)``: an infeasible placement is refused by ``plan()`` with ``InfeasiblePlan``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from _common import make_model

import tidal_arena.config as arena_config
from tidal_arena import PageLockLimitError, arena_stats
from tidal_plan import HardwareProfile, InfeasiblePlan, PlanConfig, census, plan
from tidal_stream import unwrap, wrap

pytestmark = pytest.mark.timeout(120)

_NUM = re.compile(r"\d+(\.\d+)?\s*(B|KiB|MiB|GiB|KB|MB|GB)")


def _host_threads() -> int:
    return sum(t.name == "tidal-host-adam" and t.is_alive() for t in threading.enumerate())


def test_wrap_refuses_host_state_above_the_ram_cap(monkeypatch):
    """Host optimizer state larger than the arena's cap (0.7 x a simulated 1 MiB of RAM): refused at wrap()."""
    model = make_model(dim=64, layers=4)  # 75 k parameters: 1.16 MiB of fp32 master, moments, gradient
    state_bytes = 4 * 4 * sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(arena_config, "physical_ram_bytes", lambda: 1 << 20)
    base, threads = arena_stats(), _host_threads()
    with pytest.raises(PageLockLimitError) as err:
        wrap(model, torch.optim.AdamW(model.parameters()), offload=True)
    msg = str(err.value)
    assert len(_NUM.findall(msg)) >= 2, f"the refusal gives no numbers: {msg}"
    assert "cap" in msg and "physical RAM" in msg, msg
    assert state_bytes > 1 << 20
    assert not hasattr(model, "_tidal_session"), "a refused wrap left the model wrapped"
    after = arena_stats()
    assert (after["reserved_bytes"], after["blocks"]) == (base["reserved_bytes"], base["blocks"]), (
        "arena memory left behind"
    )
    assert _host_threads() == threads, "a refused wrap left its host-optimizer thread running"


def test_plan_refuses_host_ram_with_numbers():
    """The planner refuses host state that cannot fit ``host_ram``, naming the bytes needed and available."""
    model = make_model(dim=64, layers=4)
    cen = census(model)
    profile = HardwareProfile.synthetic(
        host_ram_bytes=64 << 10, vram_budget_bytes=16 << 10, device_free_bytes=1 << 30
    )
    with pytest.raises(InfeasiblePlan) as err:
        plan(cen, profile, PlanConfig(offload=True, batch_tokens=32, headroom_bytes=0))
    e = err.value
    assert e.resource in ("host_ram", "vram")
    assert e.needed_bytes > e.available_bytes > 0
    assert len(_NUM.findall(str(e))) >= 2, str(e)


def test_plan_config_host_ram_override_refuses():
    """``PlanConfig(host_ram=...)`` below what the host optimizer needs: refused with the host_ram resource."""
    model = make_model(dim=64, layers=4)
    cen = census(model)
    profile = HardwareProfile.synthetic()
    with pytest.raises(InfeasiblePlan) as err:
        plan(cen, profile, PlanConfig(offload=True, host_ram="100KiB", batch_tokens=32))
    assert err.value.resource == "host_ram", str(err.value)
    assert err.value.available_bytes <= 100 << 10 < err.value.needed_bytes


def test_wrap_host_ram_option_is_validated():
    """``wrap(host_ram=...)`` sets the host RAM a plan made by wrap() uses (on the CPU no plan is made, so it
    is accepted and has nothing to act on); a value that is no size is refused naming the option."""
    model, _opt = wrap(make_model(layers=1), None, lr=1e-3, host_ram="1GiB")
    unwrap(model)
    with pytest.raises(ValueError, match="host_ram"):
        wrap(make_model(layers=1), None, lr=1e-3, host_ram="lots")


@pytest.mark.gpu
def test_wrap_refuses_above_ulimit_l_on_cuda(tmp_path):
    """A real page-lock limit (``ulimit -l`` of 1 MiB in a child process): wrap() on CUDA is refused with numbers.

    Only buffers that device copies touch are page-locked (for fp32 weights: the master and the gradient,
    8 B per parameter), so the model has 281 k parameters: 2.1 MiB pinned."""
    code = textwrap.dedent(
        f"""
        import resource, sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
        import torch
        from _common import make_model
        from tidal_arena import PageLockLimitError
        from tidal_stream import wrap
        m = make_model(dim=128, layers=4, device="cuda")
        try:
            wrap(m, torch.optim.AdamW(m.parameters()), offload=True)
        except PageLockLimitError as e:
            print("REFUSED", e)
            sys.exit(0)
        print("ACCEPTED")
        sys.exit(1)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0 and "REFUSED" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "ulimit -l" in r.stdout, r.stdout
