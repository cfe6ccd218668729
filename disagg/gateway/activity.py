"""What the web page charts and shows: the latency and rate of the requests this gateway answered over the
last minutes, and the last images, each with its prompt, of the caller's API key (GET /recent)."""

from __future__ import annotations

import base64
import collections
import io
import itertools
import time

#: the window the page charts, in buckets of BUCKET_S
WINDOW_S, BUCKET_S = 300, 10
#: the last images shown, as thumbnails of at most THUMB_PX a side
LAST_IMAGES, THUMB_PX = 8, 160


def thumbnail(image: bytes) -> str:
    """A small PNG of an image's bytes, as a data: URL ("" when Pillow cannot read it)."""
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(image))
        im.thumbnail((THUMB_PX, THUMB_PX))
        out = io.BytesIO()
        im.convert("RGB").save(out, format="PNG")
    except Exception:  # noqa: BLE001 - a format Pillow cannot read is simply not shown
        return ""
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


class Activity:
    def __init__(self):
        #: (when, latency_s, outcome) of every request answered in the window (bounded); outcome: completed,
        #: invalid (the request's fault: an HTTP 400), cancelled or failed (disagg/gateway/metrics.py outcome_label)
        self.ended: collections.deque[tuple[float, float, str]] = collections.deque(maxlen=65_536)
        #: each tenant's last images (disagg/gateway/tenants.py: one per API key, a bounded number)
        self.images: dict[str, collections.deque[dict]] = {}
        self._shown = itertools.count()

    def record(self, outcome: str, latency_s: float) -> None:
        self.ended.append((time.time(), latency_s, outcome))

    def show(self, tenant: str, request_id: str, prompt: str, size: str, latency_s: float, image: bytes) -> None:
        """An image made for `tenant`'s request: it is among the last images that tenant (and admins) see."""
        kept = self.images.setdefault(tenant, collections.deque(maxlen=LAST_IMAGES))
        kept.appendleft((next(self._shown), {"id": request_id, "prompt": prompt, "size": size,
                                             "latency_s": round(latency_s, 3), "created": int(time.time()),
                                             "thumbnail": thumbnail(image)}))

    def last_images(self, caller) -> list[dict]:
        """The last images `caller` may see: its tenant's, or every tenant's for an admin; newest first."""
        shown = [item for tenant, kept in self.images.items() if caller.sees(tenant) for item in kept]
        return [doc for _, doc in sorted(shown, key=lambda item: -item[0])[:LAST_IMAGES]]

    def doc(self, caller, now: float | None = None) -> dict:
        """Per bucket of the window (oldest first): its start (seconds before now), requests per second, failed
        ones and invalid ones (refused as the request's fault: not failures of the deployment), and p50 / p95
        latency of those that succeeded (every caller's, as /metrics counts them); and the last images `caller`
        may see."""
        now = time.time() if now is None else now
        while self.ended and self.ended[0][0] < now - WINDOW_S:
            self.ended.popleft()
        buckets = []
        for k in range(WINDOW_S // BUCKET_S):
            lo = now - WINDOW_S + k * BUCKET_S
            got = [(lat, outcome) for t, lat, outcome in self.ended if lo <= t < lo + BUCKET_S]
            lat = sorted(x for x, outcome in got if outcome == "completed")
            buckets.append({"t": round(lo - now, 1), "rps": round(len(got) / BUCKET_S, 3),
                            "failed": sum(outcome == "failed" for _, outcome in got),
                            "invalid": sum(outcome == "invalid" for _, outcome in got),
                            "p50": lat[len(lat) // 2] if lat else None,
                            "p95": lat[min(len(lat) - 1, int(len(lat) * 0.95))] if lat else None})
        return {"bucket_s": BUCKET_S, "series": buckets, "images": self.last_images(caller)}
