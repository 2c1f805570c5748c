"""Prometheus metrics of one server, in a registry of its own (two apps in one process, as in
tests, never share counters). No label carries a lock name: names are unbounded."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_WAITS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


class _Unlocked:
    """A metric's value without prometheus_client's lock (``values.MutexValue`` takes one on
    every change: a third of an observation's cost). For the metrics a busy server changes
    on every request, which change only on its event loop's thread."""

    __slots__ = ("_exemplar", "_value")

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


class _LoopCounter(Counter):
    """A Counter changed only on the event loop's thread (``_Unlocked``)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _Unlocked()


class _LoopHistogram(Histogram):
    """A Histogram changed only on the event loop's thread (``_Unlocked``); an observation
    finds its bucket by bisection (the same bucket: the first bound not below it)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum: Any = _Unlocked()
        self._buckets: Any = [_Unlocked() for _ in self._buckets]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or amount != amount:  # (an exemplar, or NaN: which no bucket counts)
            super().observe(amount, exemplar)
            return
        if self._labelnames and not self._labelvalues:  # (a parent: as prometheus_client)
            raise ValueError("histogram metric is missing label values")
        self._sum._value += amount
        self._buckets[bisect_left(self._upper_bounds, amount)]._value += 1


class _SourceCommits:
    """The source's own count of write commits, where it keeps one (the embedded SQLite
    source: one fsync each), read at scrape time. Grants ÷ commits is how well concurrent
    grants share commits (group commit)."""

    def __init__(self, read: Callable[[], int | None]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        n = self.read()
        if n is not None:
            yield CounterMetricFamily(
                "fenced_source_commits",
                "Write transactions the token source committed (SQLite: one fsync each)",
                value=n,
            )


class Metrics:
    def __init__(self, source_commits: Callable[[], int | None] | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        if source_commits is not None:
            r.register(_SourceCommits(source_commits))
        # (the metrics every grant and every request changes: without a lock)
        self.grants = _LoopCounter("fenced_grants", "Locks granted", registry=r)
        self.acquire_timeouts = _LoopCounter(
            "fenced_acquire_timeouts", "Acquires whose timeout passed before a grant", registry=r
        )
        self.late_duplicates = Counter(
            "fenced_acquire_late_duplicates",
            "Acquires answered 410 lease_lost: their request id's grant, made, renewed or "
            "released through this gateway, had ended (a retry or copy delivered after the "
            "release or expiry: client timeouts shorter than the network's delays)",
            registry=r,
        )
        self.releases = _LoopCounter(
            "fenced_releases",
            "Releases, by whether the grant was still held",
            ["result"],
            registry=r,
        )
        self.renewals = _LoopCounter(
            "fenced_renewals",
            "Renewals: ok, lost (the grant had expired), error",
            ["result"],
            registry=r,
        )
        self.release_retries = Counter(
            "fenced_release_retries",
            "Releases asked again (retry: the answer to the first was lost): remembered "
            "(answered true from this gateway's memory of the grants it released), released "
            "(the first never released it), not_held (answered false: ended or taken over "
            "before, or released beyond this gateway's memory)",
            ["result"],
            registry=r,
        )
        self.expiries = Counter(
            "fenced_expiries",
            "Grants this gateway made or resumed that ended without a release: expired (their "
            "holder stopped renewing) or ended by the source; each counted once",
            registry=r,
        )
        self.forced = Counter("fenced_forced_releases", "Operators' force releases", registry=r)
        self.checks = Counter(
            "fenced_checks",
            "Token checks: current, stale, not_current (ended, no later grant known), "
            "never_granted, invalid (malformed or bad signature)",
            ["result"],
            registry=r,
        )
        self.retired_key = Counter(
            "fenced_verify_key_tokens",
            "Renewals and releases whose token a --verify-key key signed (one this gateway "
            "verifies but does not sign with), by key id: while it grows on any gateway, grants "
            "made under that key are live",
            ["kid"],
            registry=r,
        )
        self.refused = Counter(
            "fenced_refused_requests",
            "Requests refused: unauthenticated, forbidden, invalid, too_large, too_slow, "
            "too_many_watches, too_many_waiting",
            ["reason"],
            registry=r,
        )
        self.wait = _LoopHistogram(
            "fenced_acquire_wait_seconds",
            "Time from an acquire's arrival to its grant",
            buckets=_WAITS,
            registry=r,
        )
        self.latency = _LoopHistogram(
            "fenced_request_seconds",
            "HTTP request latency by route",
            ["route", "method"],
            buckets=_LATENCY,
            registry=r,
        )
        self.waiting = Gauge("fenced_acquires_waiting", "Acquires waiting now", registry=r)
        self.watches = Gauge(
            "fenced_watches_open",
            "Watches open now: /-/watch streams and blocking status queries",
            registry=r,
        )
        self.tracked = Gauge(
            "fenced_leases_tracked",
            "Grants this gateway knows (made or resumed here)",
            registry=r,
        )

        self.releases_remembered = Gauge(
            "fenced_releases_remembered",
            "Grants released here this gateway holds in memory now (a retry of their release "
            "is answered true within one ttl from it; bounded, the oldest dropped first)",
            registry=r,
        )
        self.ids_remembered = Gauge(
            "fenced_request_ids_remembered",
            "Request ids this gateway holds in memory now (an acquire naming one whose grant "
            "ended is answered as a late duplicate; bounded, the oldest dropped first)",
            registry=r,
        )
        for result in ("remembered", "released", "not_held"):
            self.release_retries.labels(result)  # (shown at 0 from the start)

    def render(self) -> bytes:
        return generate_latest(self.registry)
