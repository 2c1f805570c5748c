"""Prometheus metrics of one server, in a registry of its own (two apps in one process, as in
tests, never share counters). No label carries a lock name: names are unbounded."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_WAITS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


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
        self.grants = Counter("fenced_grants", "Locks granted", registry=r)
        self.acquire_timeouts = Counter(
            "fenced_acquire_timeouts", "Acquires whose timeout passed before a grant", registry=r
        )
        self.releases = Counter(
            "fenced_releases",
            "Releases, by whether the grant was still held",
            ["result"],
            registry=r,
        )
        self.renewals = Counter(
            "fenced_renewals",
            "Renewals: ok, lost (the grant had expired), error",
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
        self.refused = Counter(
            "fenced_refused_requests",
            "Requests refused: unauthenticated, forbidden, invalid, too_large, too_slow, "
            "too_many_watches, too_many_waiting",
            ["reason"],
            registry=r,
        )
        self.wait = Histogram(
            "fenced_acquire_wait_seconds",
            "Time from an acquire's arrival to its grant",
            buckets=_WAITS,
            registry=r,
        )
        self.latency = Histogram(
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
