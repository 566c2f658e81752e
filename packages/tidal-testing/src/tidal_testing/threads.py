"""Host thread count for a test: the CI machine is shared, so heavy CPU tests run on few threads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(n)``; the previous count is restored on exit.

    Typical use, an autouse fixture in a test module or ``conftest.py``::

        @pytest.fixture(autouse=True)
        def _few_threads():
            with torch_threads(1):
                yield

    Args:
        n: intra-op threads for the body, a whole number >= 1.

    Raises:
        ValueError: when ``n`` is not a whole number >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"torch_threads(n): got {n!r}; accepted: a whole number >= 1 (e.g. 1 or 2)")
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
