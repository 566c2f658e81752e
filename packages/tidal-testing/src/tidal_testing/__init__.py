"""tidal-testing: the dev-only pytest plugin every tidal package's tests load.

- markers ``gpu`` (needs CUDA) and ``slow`` are registered, so ``--strict-markers`` holds;
- :func:`devices` gives ``cpu`` and a ``gpu``-marked ``cuda`` parameter for ``@pytest.mark.parametrize``;
- ``TIDAL_REQUIRE_GPU=1`` turns "no CUDA" into an error instead of a skip (the GPU suite sets it);
- numeric helpers: :func:`sqnr_db`, :func:`assert_sqnr`, :func:`assert_bitwise_equal`;
- :func:`torch_threads`: a context manager that runs its body on ``n`` torch threads, then restores them.
"""

from tidal_testing.__about__ import __version__
from tidal_testing.devices import cuda_available, devices, require_gpu
from tidal_testing.numerics import assert_bitwise_equal, assert_sqnr, max_abs_diff, sqnr_db
from tidal_testing.threads import torch_threads

__all__ = [
    "__version__",
    "assert_bitwise_equal",
    "assert_sqnr",
    "cuda_available",
    "devices",
    "max_abs_diff",
    "require_gpu",
    "sqnr_db",
    "torch_threads",
]
