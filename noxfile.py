"""tidal's only noxfile. Sessions come from one package table; `nox -l` lists them.

Default sessions (what CI runs through `make test`): lint and tests_all, CPU-only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "tests_all"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False

# package -> its tidal dependencies (the DAG of docs/architecture.md); extra test requirements
PACKAGES: dict[str, dict[str, list[str]]] = {
    "tidal-arena": {"tidal": [], "extra": []},
    "tidal-quant": {"tidal": [], "extra": []},
    "tidal-plan": {"tidal": [], "extra": []},
    "tidal-stream": {"tidal": ["tidal-arena", "tidal-plan"], "extra": []},
    "tidal-kv": {"tidal": ["tidal-arena", "tidal-quant"], "extra": []},
    "tidal-hf": {
        "tidal": ["tidal-arena", "tidal-quant", "tidal-plan", "tidal-stream", "tidal-kv"],
        "extra": ["peft>=0.13", "accelerate>=1.0"],
    },
    "tidal": {
        "tidal": ["tidal-arena", "tidal-quant", "tidal-plan", "tidal-stream", "tidal-kv", "tidal-hf"],
        "extra": ["peft>=0.13", "accelerate>=1.0"],
    },
}
TORCH_VERSIONS = ["2.13", "2.14"]
TRANSFORMERS_VERSIONS = ["4.57", "5"]
TEST_REQUIREMENTS = ["pytest>=8", "pytest-timeout", "pytest-benchmark", "hypothesis>=6", "numpy"]
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "TIDAL_REQUIRE_GPU": "0"}


def _torch_spec(version: str) -> str:
    # 2.13.0 is the CPU build on disk here; 2.14.1 the CUDA build (tests still run CPU-only)
    return {"2.13": "torch==2.13.0", "2.14": "torch==2.14.1"}[version]


def _local(*names: str) -> list[str]:
    return [str(ROOT / "packages" / n) for n in names]


def _install(session: nox.Session, names: list[str], extra: list[str], torch: str = "2.13") -> None:
    """Install torch first (so no package pulls another build), then local packages and test tools."""
    session.install(_torch_spec(torch))
    session.install(*TEST_REQUIREMENTS, *extra)
    session.install(*_local("tidal-testing", *names))


def _pytest(session: nox.Session, *paths: str) -> None:
    """Run pytest CPU-only; exit code 5 (nothing collected) counts as a failure of the session."""
    session.run("pytest", "-m", "not gpu", *paths, *session.posargs, env=CPU_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + format check, module sizes (warn > 600 lines), and the package import DAG."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/check_module_size.py", "--warn", "600")
    session.run("python", "tools/check_imports.py")


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str, torch: str) -> None:
    """One package (and only its tidal dependencies) against one torch version, CPU-only."""
    spec = PACKAGES[package]
    _install(session, [*spec["tidal"], package], spec["extra"], torch)
    _pytest(session, f"packages/{package}/tests")


@nox.session
@nox.parametrize("transformers", TRANSFORMERS_VERSIONS)
def tests_hf(session: nox.Session, transformers: str) -> None:
    """tidal-hf across transformers 4.57 and 5.x, CPU-only."""
    spec = PACKAGES["tidal-hf"]
    pin = "transformers==4.57.*" if transformers == "4.57" else "transformers>=5,<6"
    _install(session, [*spec["tidal"], "tidal-hf"], [*spec["extra"], pin])
    _pytest(session, "packages/tidal-hf/tests")


@nox.session
def tests_all(session: nox.Session) -> None:
    """Every package installed together: all package tests, tests-integration/ and the harness tests."""
    # bitsandbytes: the NF4 byte-identity test runs on its CPU backend; triton: the kernels run in its
    # interpreter (TRITON_INTERPRET=1) against the pure-torch reference, so CPU CI checks them too
    _install(
        session,
        list(PACKAGES),
        [*PACKAGES["tidal"]["extra"], "safetensors", "matplotlib", "tqdm", "bitsandbytes==0.50.2", "triton"],
    )
    _pytest(session, "packages", "tests-integration", "benchmarks/tests")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU suite in the current interpreter (no new virtualenv): pytest -m gpu over everything."""
    session.run("bash", "tools/gpu-tests.sh", external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Micro benchmarks (pytest-benchmark) anywhere; compare.py / quality.py only where a GPU is present."""
    _install(
        session,
        list(PACKAGES),
        [*PACKAGES["tidal"]["extra"], "pytest-benchmark", "safetensors", "matplotlib"],
    )
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    session.run(
        "pytest",
        "benchmarks",
        "--benchmark-only",
        f"--benchmark-json={out / 'micro-local.json'}",
        *session.posargs,
    )
    if shutil.which("nvidia-smi") is None:
        session.log(
            "no GPU here: skipped benchmarks/compare.py and benchmarks/quality.py (run them on a GPU machine)"
        )
        return
    session.run("python", "benchmarks/compare.py", "--scenario", "lora14b", "--vram-gb", "24")
    session.run("python", "benchmarks/quality.py")


@nox.session
def demo(session: nox.Session) -> None:
    """Install the meta-package (with the hf extra) and run the main job: `tidal demo`."""
    session.install(_torch_spec("2.13") if not os.environ.get("TIDAL_TORCH") else os.environ["TIDAL_TORCH"])
    session.install(
        *_local("tidal-arena", "tidal-quant", "tidal-plan", "tidal-stream", "tidal-kv", "tidal-hf", "tidal")
    )
    session.run("tidal", "demo", *session.posargs)
