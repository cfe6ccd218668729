"""Cost of the Router's logic per request (no sockets): `PYTHONPATH=. python benchmarks/router_bench.py`.

Drives one request at a time through Submit, Staged, Fetched, Staged, Fetched, Done with the
scripted harness of tests/test_router.py and prints microseconds per request.
"""

import time

from tests.test_router import Harness, staged
from transport.messages import Done, Fetched


def main(n: int = 5000) -> None:
    h = Harness()
    [enc] = h.add("encoder")
    [den] = h.add("denoiser")
    [dec] = h.add("decoder")
    t0 = time.perf_counter()
    for k in range(n):
        rid = f"r{k}"
        h.submit(rid, seed=1)
        h.role(enc, staged(enc, rid))
        h.role(den, Fetched(request_id=rid, attempt=1))
        h.role(den, staged(den, rid))
        h.role(dec, Fetched(request_id=rid, attempt=1))
        h.role(dec, Done(request_id=rid, attempt=1, num_images=1), [b"png"])
    print(f"{(time.perf_counter() - t0) / n * 1e6:.1f} µs per request in the router")


if __name__ == "__main__":
    main()
