package dev.fenced.client;

import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.regex.Pattern;

/**
 * A client of {@code fenced serve} (JDK 17's java.net.http, no dependencies).
 *
 * <pre>{@code
 * FencedClient locks = new FencedClient("http://127.0.0.1:7400");
 * try (Lease lease = locks.lock("invoices", new LockOptions().ttl(Duration.ofSeconds(10)))) {
 *     write(data, lease.token());   // throws LeaseLostException once the lease is not confirmed
 * }
 * }</pre>
 */
public final class FencedClient {
    static final Pattern NAME =
            Pattern.compile("[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*(/[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*)*");
    static final Pattern REQUEST_ID = Pattern.compile("[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}");
    static final double MIN_TTL = 0.1;
    static final double MAX_TTL = 86_400;
    static final double MAX_TIMEOUT = 31_536_000;

    private final String url;
    private final String auth; // "Bearer <secret>": never in a message or toString
    private final HttpClient http;
    final ScheduledExecutorService timers;

    /** {@code url}: e.g. "http://127.0.0.1:7400"; the API key is $FENCED_API_KEY, if set. */
    public FencedClient(String url) {
        this(url, System.getenv("FENCED_API_KEY"));
    }

    /** {@code apiKey}: sent as a bearer token (null: none). */
    public FencedClient(String url, String apiKey) {
        if (url == null || !url.matches("https?://[^/]+.*")) {
            throw new FencedException("not an http(s) URL of a fenced server: " + url, 0, "invalid_request");
        }
        this.url = url.replaceAll("/+$", "");
        this.auth = apiKey == null || apiKey.isEmpty() ? null : "Bearer " + apiKey;
        // HTTP/1.1: no h2c upgrade dance with the server.
        this.http = HttpClient.newBuilder()
                .version(HttpClient.Version.HTTP_1_1)
                .connectTimeout(Duration.ofSeconds(10))
                .build();
        this.timers = Executors.newSingleThreadScheduledExecutor(r -> {
            Thread t = new Thread(r, "fenced-lease-timers");
            t.setDaemon(true); // a forgotten lease does not keep the JVM alive; it expires
            return t;
        });
    }

    public String url() {
        return url;
    }

    @Override
    public String toString() {
        return "FencedClient(" + url + ")";
    }

    /** Take the lock with the default options (ttl 10 s, try once). */
    public Lease lock(String name) {
        return lock(name, new LockOptions());
    }

    /**
     * Take the lock {@code name}, waiting up to the options' timeout in line, and keep it renewed
     * in the background until {@link Lease#release()}. A connection error or a 503 is retried
     * with the same request id (idempotent: never a second grant) until the timeout has passed
     * — or, for a single try (timeout 0), for retryFor (default 10 s).
     *
     * @throws LockTimeoutException not granted within the timeout
     * @throws FencedException any other refusal, or the server could not be reached
     */
    public Lease lock(String name, LockOptions o) {
        String path = lockPath(name, "acquire");
        double ttl = seconds("ttl", o.ttl, MIN_TTL, MAX_TTL);
        double timeout = seconds("timeout", o.timeout, 0, MAX_TIMEOUT);
        double retryFor = seconds("retryFor", o.retryFor, 0, MAX_TIMEOUT);
        String requestId = o.requestId != null ? o.requestId : "java-" + UUID.randomUUID().toString().replace("-", "");
        if (!REQUEST_ID.matcher(requestId).matches()) {
            throw new FencedException(
                    "not a request id (1-64 of A-Z a-z 0-9 _ . : -): " + requestId, 0, "invalid_request");
        }
        double margin = o.safetyMargin != null
                ? seconds("safetyMargin", o.safetyMargin, 0, ttl / 2)
                : Math.min(1.0, ttl / 10);
        long start = System.nanoTime();
        long waitUntil = start + (long) (timeout * 1e9);
        long retryUntil = start + (long) ((timeout > 0 ? timeout : retryFor) * 1e9);
        long backoff = 100;
        for (;;) {
            double left = Math.max(0, (waitUntil - System.nanoTime()) / 1e9);
            Map<String, Object> body = new LinkedHashMap<>();
            body.put("ttl", ttl);
            body.put("timeout", left);
            body.put("request_id", requestId);
            if (o.owner != null) body.put("owner", o.owner);
            // The server answers a long poll within its max wait (60 s): a little more is allowed.
            long sent = System.nanoTime();
            Answer r = call("POST", path, Json.object(body), (long) ((Math.min(left, 60) + 15) * 1e9));
            long received = System.nanoTime();
            if (r.status == 200) {
                if (!(r.body.get("expires_in") instanceof Number expires)
                        || !Double.isFinite(expires.doubleValue()) || expires.doubleValue() < 0) {
                    throw new FencedException("could not take " + name + ": the answer has no expires_in", 200, "bad_answer");
                }
                // Counted from when the request was sent, never from the answer's arrival: the
                // grant was made after the send, and an answer can wait in a socket for any time
                // (a GC pause, a slow network) while the lease runs out at the source.
                long validUntil = sent + (long) ((expires.doubleValue() - margin) * 1e9);
                Map<String, Object> grant = r.body;
                if (received - sent > (long) (ttl * 1e9 / 3)) {
                    // Waited in line, or paused: confirm the grant (a renewal, counted from its
                    // own send) before handing out its token; one not confirmed is not held.
                    Object token = r.body.get("signed") != null ? r.body.get("signed") : r.body.get("token");
                    Map<String, Object> renew = new LinkedHashMap<>();
                    renew.put("token", token);
                    renew.put("request_id", requestId);
                    renew.put("ttl", ttl);
                    long again = System.nanoTime();
                    Answer rr = call("POST", lockPath(name, "renew"), Json.object(renew), (long) (ttl * 1e9));
                    if (rr.status != 200 || !(rr.body.get("expires_in") instanceof Number renewed)) {
                        Map<String, Object> rel = new LinkedHashMap<>();
                        rel.put("token", token);
                        rel.put("request_id", requestId);
                        call("POST", lockPath(name, "release"), Json.object(rel), 2_000_000_000L);
                        throw new LeaseLostException(
                                "took " + name + ", but could not confirm the grant: " + rr.describe(),
                                "lease_lost");
                    }
                    validUntil = again + (long) ((renewed.doubleValue() - margin) * 1e9);
                    grant = new LinkedHashMap<>(r.body);
                    grant.putAll(rr.body);
                }
                return new Lease(this, name, requestId, grant, ttl, margin, validUntil, o.onLost);
            }
            boolean waitMore = r.status == 409 && "timeout".equals(r.error());
            if (waitMore && received - waitUntil < 0) continue;
            boolean transient_ = r.status == 0 || r.status == 503;
            if (transient_ && received - retryUntil < 0) {
                sleepMillis(Math.min(backoff, Math.max(0, (retryUntil - received) / 1_000_000)));
                backoff = Math.min(backoff * 2, 2000);
                continue;
            }
            String msg = "could not take " + name + ": " + r.describe();
            String code = r.error() != null ? r.error() : r.status == 0 ? "unavailable" : "error";
            if (waitMore) throw new LockTimeoutException(msg, r.status, code);
            throw new FencedException(msg, r.status, code);
        }
    }

    /** {@code POST /v1/check}: is this token the current grant of its lock? */
    public Map<String, Object> check(String token) {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("token", token);
        return ok("check", call("POST", "/v1/check", Json.object(body), 30_000_000_000L));
    }

    /** {@code GET /v1/locks/{name}}: who holds it, and the highest token granted. */
    public Map<String, Object> status(String name) {
        return ok("status", call("GET", lockPath(name, null), null, 30_000_000_000L));
    }

    private static Map<String, Object> ok(String what, Answer r) {
        if (r.status != 200) throw new FencedException(what + " failed: " + r.describe(), r.status, r.error());
        return r.body;
    }

    String lockPath(String name, String action) {
        if (name == null || !NAME.matcher(name).matches()) {
            throw new FencedException("not a lock name: " + name, 0, "invalid_request");
        }
        return "/v1/locks/" + name + (action == null ? "" : "/-/" + action);
    }

    private static double seconds(String what, Duration d, double min, double max) {
        double s = d == null ? Double.NaN : d.toNanos() / 1e9;
        if (!(s >= min && s <= max)) {
            throw new FencedException(what + " must be from " + min + " to " + max + " s, not " + d, 0, "invalid_request");
        }
        return s;
    }

    static void sleepMillis(long ms) {
        try {
            Thread.sleep(ms);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new FencedException("interrupted", 0, "interrupted");
        }
    }

    /** An answer: the status (0: none, the reason in message) and the JSON body. */
    static final class Answer {
        final int status;
        final Map<String, Object> body;

        Answer(int status, Map<String, Object> body) {
            this.status = status;
            this.body = body;
        }

        String error() {
            return body.get("error") instanceof String s ? s : null;
        }

        String describe() {
            String message = body.get("message") instanceof String s ? s : "";
            if (status == 0) return "no answer: " + message;
            return (status + " " + (error() != null ? error() : "error") + ": " + message).trim();
        }
    }

    /** One request, bounded by {@code timeoutNanos}; never completes exceptionally. */
    CompletableFuture<Answer> callAsync(String method, String path, String body, long timeoutNanos) {
        Duration timeout = Duration.ofNanos(Math.max(1_000_000, timeoutNanos));
        HttpRequest.Builder b;
        try {
            b = HttpRequest.newBuilder(URI.create(url + path))
                    .timeout(timeout)
                    .header("content-type", "application/json")
                    .header("accept", "application/json")
                    .method(method, body == null
                            ? HttpRequest.BodyPublishers.noBody()
                            : HttpRequest.BodyPublishers.ofString(body));
            if (auth != null) b.header("authorization", auth);
        } catch (RuntimeException e) {
            return CompletableFuture.completedFuture(failure(e));
        }
        CompletableFuture<HttpResponse<String>> sent;
        try {
            sent = http.sendAsync(b.build(), HttpResponse.BodyHandlers.ofString());
        } catch (RuntimeException e) {
            return CompletableFuture.completedFuture(failure(e));
        }
        return sent.orTimeout(timeout.toNanos(), TimeUnit.NANOSECONDS).handle((resp, err) -> {
            if (err != null) return failure(err);
            Map<String, Object> json = Json.parseObject(resp.body());
            if (json == null) {
                json = new LinkedHashMap<>();
                String text = resp.body().replaceAll("\\s+", " ");
                json.put("message", text.substring(0, Math.min(200, text.length())));
            }
            return new Answer(resp.statusCode(), json);
        });
    }

    Answer call(String method, String path, String body, long timeoutNanos) {
        return callAsync(method, path, body, timeoutNanos).join();
    }

    private static Answer failure(Throwable err) {
        while (err instanceof CompletionException && err.getCause() != null) err = err.getCause();
        String why = err instanceof TimeoutException || err instanceof java.net.http.HttpTimeoutException
                ? "timed out"
                : err.getClass().getSimpleName() + (err.getMessage() != null ? ": " + err.getMessage() : "");
        Map<String, Object> m = new LinkedHashMap<>();
        m.put("message", why);
        return new Answer(0, m);
    }
}
