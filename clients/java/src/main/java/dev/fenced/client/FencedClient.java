package dev.fenced.client;

import java.net.URI;
import java.net.URISyntaxException;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.ThreadLocalRandom;
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
public final class FencedClient implements AutoCloseable {
    static final Pattern NAME =
            Pattern.compile("[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*(/[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*)*");
    static final Pattern REQUEST_ID = Pattern.compile("[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}");
    static final double MIN_TTL = 0.1;
    static final double MAX_TTL = 86_400;
    static final double MAX_TIMEOUT = 31_536_000;
    /** The longest API key: proxies refuse longer header lines (nginx's default buffer holds
     * 8 KiB for a whole line); the server's keys file and the other clients have the same. */
    static final int MAX_KEY = 4096;
    static final Duration DEFAULT_REQUEST_TIMEOUT = Duration.ofSeconds(10);
    /** The most of an answer that is read (fenced serve's answers are a few hundred bytes): a
     * runaway page (an error loop, a misrouted download) must not fill the heap. */
    static final int MAX_ANSWER = 1 << 20;
    /** An error code as fenced serve sends them ("timeout", "lease_lost"); else no code. */
    static final Pattern CODE = Pattern.compile("[a-z][a-z0-9_]{0,63}");
    /** Server text that repeats this many letters and digits of the key in a row, however
     * spaced, escaped or cased (a proxy's page echoing the header: "&amp;", squeezed blanks),
     * is withheld. */
    static final int KEY_RUN = 8;
    static final String WITHHELD = "(withheld: it repeats part of the API key)";

    private final String url;
    private final String key; // the secret: never in a message or toString
    private final String auth; // "Bearer <secret>"
    private final Set<String> keyRuns; // the key's runs of KEY_RUN letters and digits (or null)
    private final int keyRun;
    final long requestTimeout; // nanoseconds
    private final HttpClient http;
    final ScheduledExecutorService timers;
    private final Set<Lease> leases = ConcurrentHashMap.newKeySet(); // held: released by close()
    private volatile boolean closed;

    /** {@code url}: e.g. "http://127.0.0.1:7400"; the API key is $FENCED_API_KEY, if set and
     * not empty. */
    public FencedClient(String url) {
        this(url, envKey(), "$FENCED_API_KEY", DEFAULT_REQUEST_TIMEOUT);
    }

    /** {@code apiKey}: sent as a bearer token (null: none). */
    public FencedClient(String url, String apiKey) {
        this(url, apiKey, "apiKey", DEFAULT_REQUEST_TIMEOUT);
    }

    /**
     * {@code url}: no user name or password, query or fragment. {@code apiKey} (null: none):
     * visible ASCII, blanks inside only, at most 4096 characters, as an Authorization header
     * carries it. {@code requestTimeout}: how long one request may take, connecting included,
     * past a long poll's own wait (default 10 s). Anything else is a {@link FencedException}
     * ("invalid_request") that never shows the key.
     */
    public FencedClient(String url, String apiKey, Duration requestTimeout) {
        this(url, apiKey, "apiKey", requestTimeout);
    }

    private FencedClient(String url, String apiKey, String where, Duration requestTimeout) {
        this.url = baseUrl(url);
        double timeout = seconds("requestTimeout", requestTimeout, 0.001, 3600);
        this.requestTimeout = (long) (timeout * 1e9);
        if (apiKey != null) {
            String problem = keyProblem(apiKey);
            if (problem != null) throw invalid(where + " " + problem);
        }
        this.key = apiKey;
        this.auth = apiKey == null ? null : "Bearer " + apiKey;
        String bare = apiKey == null ? "" : skeleton(apiKey);
        if (bare.length() >= 4) { // (fewer: only the key as written is replaced)
            this.keyRun = Math.min(KEY_RUN, bare.length());
            this.keyRuns = new HashSet<>();
            for (int i = 0; i + keyRun <= bare.length(); i++) keyRuns.add(bare.substring(i, i + keyRun));
        } else {
            this.keyRun = 0;
            this.keyRuns = null;
        }
        // HTTP/1.1: no h2c upgrade dance with the server.
        this.http = HttpClient.newBuilder()
                .version(HttpClient.Version.HTTP_1_1)
                .connectTimeout(requestTimeout)
                .build();
        ScheduledThreadPoolExecutor timers = new ScheduledThreadPoolExecutor(1, r -> {
            Thread t = new Thread(r, "fenced-lease-timers");
            t.setDaemon(true); // a forgotten lease does not keep the JVM alive; it expires
            return t;
        });
        // The thread ends when no lease has a timer pending (a cancelled one is removed): a
        // client dropped without close() leaves no thread behind. (A worker with a delayed
        // task queued never times out: ThreadPoolExecutor keeps one while the queue holds any.)
        timers.setRemoveOnCancelPolicy(true);
        timers.setKeepAliveTime(1, TimeUnit.SECONDS);
        timers.allowCoreThreadTimeOut(true);
        this.timers = timers;
    }

    /** Releases the leases still held (as {@link Lease#release()}) and stops the renewal timer;
     * a lock() after it is refused ("closed"). Idempotent. */
    @Override
    public void close() {
        closed = true;
        for (Lease lease : leases.toArray(new Lease[0])) lease.release();
        timers.shutdownNow();
    }

    void forget(Lease lease) {
        leases.remove(lease);
    }

    // Letters and digits only, lower-cased: what survives escaping, squeezing and re-casing.
    private static String skeleton(String text) {
        StringBuilder b = new StringBuilder(text.length());
        for (int i = 0; i < text.length(); i++) {
            char c = Character.toLowerCase(text.charAt(i));
            if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) b.append(c);
        }
        return b.toString();
    }

    public String url() {
        return url;
    }

    /** How long one request may take, connecting included (past a long poll's own wait). */
    public Duration requestTimeout() {
        return Duration.ofNanos(requestTimeout);
    }

    private static FencedException invalid(String message) {
        return new FencedException(message, 0, "invalid_request");
    }

    private static String envKey() {
        String key = System.getenv("FENCED_API_KEY");
        return key == null || key.isEmpty() ? null : key; // (empty: as unset)
    }

    /** What is wrong with an API key (null: nothing), never the key nor any of its characters. */
    static String keyProblem(String key) {
        if (key.isEmpty()) return "is empty: give the key, or null for a server without keys";
        if (key.length() > MAX_KEY) {
            return "is " + key.length() + " characters long: an API key is at most " + MAX_KEY;
        }
        for (int i = 0; i < key.length(); i++) {
            char c = key.charAt(i);
            boolean blank = c == ' ' && (i == 0 || i == key.length() - 1);
            if (c >= 0x20 && c < 0x7f && !blank) continue;
            String kind = c == '\n' || c == '\r' ? "a line break"
                    : blank ? "a blank at its start or end"
                    : c < 0x20 || c == 0x7f ? "a control character"
                    : "a non-ASCII character";
            return "has " + kind + " (character " + (i + 1) + "): an API key is visible ASCII, blanks "
                    + "inside only (an Authorization header carries it as written)";
        }
        return null;
    }

    /** A URL as an error may show it: no user name or password, query or fragment; text that is
     * no URL at all only by its first character (it may be a secret pasted in the wrong place). */
    static String shown(String url) {
        if (url == null) return "null";
        try {
            URI u = new URI(url);
            if (u.getScheme() != null && u.getRawAuthority() != null) {
                String host = u.getHost() != null ? u.getHost() + (u.getPort() >= 0 ? ":" + u.getPort() : "") : "…";
                return u.getScheme() + "://" + host + (u.getRawPath() == null ? "" : u.getRawPath());
            }
        } catch (URISyntaxException e) {
            // (shown as below)
        }
        int scheme = url.indexOf("://");
        return scheme >= 0 ? url.substring(0, scheme) + "://…" : url.isEmpty() ? "" : url.charAt(0) + "…";
    }

    /** The server's base URL (no trailing slash), or one clear error. */
    static String baseUrl(String url) {
        URI u;
        try {
            u = url == null ? null : new URI(url);
        } catch (URISyntaxException e) {
            u = null;
        }
        if (u == null || u.getScheme() == null || !u.getScheme().matches("(?i)https?")) {
            throw invalid("not an http(s) URL of a fenced server: " + shown(url));
        }
        if (u.getHost() == null) { // (java.net reads no host in "my_host": '_' is no host name's)
            throw invalid("the URL " + shown(url) + " names no host that java.net can reach (a name with '_'?)");
        }
        if (u.getRawUserInfo() != null) {
            // (java.net.http drops it, unsent; and a URL naming a secret ends up in logs)
            throw invalid("the URL " + shown(url) + " has a user name or password in it: give the API key as "
                    + "apiKey or $FENCED_API_KEY");
        }
        if (u.getRawQuery() != null || u.getRawFragment() != null || url.contains("?") || url.contains("#")) {
            throw invalid("the URL " + shown(url) + " has a query or fragment: give the server's base URL");
        }
        String port = u.getPort() >= 0 ? ":" + u.getPort() : "";
        String path = u.getRawPath() == null ? "" : u.getRawPath();
        return u.getScheme().toLowerCase() + "://" + u.getHost() + port + path.replaceAll("/+$", "");
    }

    /** Text from elsewhere (an answer, a transport error) without the key, should it echo it:
     * the key as written is "***"; text that still repeats a run of its letters and digits
     * (escaped, spaced, cut) is withheld whole. Applied to the whole text, before any cutting
     * or squeezing. */
    String scrub(String text) {
        if (key == null || text == null) return text;
        String s = text.replace(key, "***");
        if (keyRuns != null) {
            String bare = skeleton(s);
            for (int i = 0; i + keyRun <= bare.length(); i++) {
                if (keyRuns.contains(bare.substring(i, i + keyRun))) return WITHHELD;
            }
        }
        return s;
    }

    /** The bound of one call of lock(): the long poll's own wait and requestTimeout, but no
     * more than the time lock() has left + 1 s (a last try gets a fair chance to be answered). */
    private long lockBound(double left, long until) {
        long own = (long) (Math.min(left, 60) * 1e9) + requestTimeout;
        return Math.min(own, Math.max(0, until - Clock.now()) + 1_000_000_000L);
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
        if (closed) throw new FencedException("this client is closed", 0, "closed");
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
        long start = Clock.now();
        long waitUntil = start + (long) (timeout * 1e9);
        long retryUntil = start + (long) ((timeout > 0 ? timeout : retryFor) * 1e9);
        long backoff = 100;
        long busy = 50; // the pause after a 409 that came at once (a front that cannot long-poll)
        int sends = 0; // (of this request id)
        for (;;) {
            double left = Math.max(0, (waitUntil - Clock.now()) / 1e9);
            Map<String, Object> body = new LinkedHashMap<>();
            body.put("ttl", ttl);
            body.put("timeout", left);
            body.put("request_id", requestId);
            if (o.owner != null) body.put("owner", o.owner);
            // The server answers a long poll within its max wait (60 s), requestTimeout is for
            // the rest (connecting, the source), and lock() ends by its time left + 1 s.
            long sent = Clock.now();
            sends += 1;
            Answer r = call("POST", path, Json.object(body), lockBound(left, retryUntil));
            long received = Clock.now();
            if (r.status == 200) {
                Object token = r.body.get("signed") != null ? r.body.get("signed") : r.body.get("token");
                if (!(r.body.get("expires_in") instanceof Number expires)
                        || !Double.isFinite(expires.doubleValue()) || expires.doubleValue() < 0
                        || !(token instanceof String)) {
                    String what = r.bad ? "is " + r.body.get("message") : "has no expires_in or token";
                    throw new FencedException("could not take " + name + ": the answer " + what, 200, "bad_answer");
                }
                // Counted from when the request was sent, never from the answer's arrival: the
                // grant was made after the send, and an answer can wait in a socket for any time
                // (a GC pause, a slow network) while the lease runs out at the source.
                // Never longer than the ttl asked for, whatever the answer says (a broken or
                // foreign gateway's "expires_in": 1000 would keep a dead lease "held").
                long validUntil = sent + (long) ((Math.min(expires.doubleValue(), ttl) - margin) * 1e9);
                Map<String, Object> grant = r.body;
                if (received - sent > (long) (ttl * 1e9 / 3)) {
                    // Waited in line, or paused: confirm the grant (a renewal, counted from its
                    // own send) before handing out its token; one not confirmed is not held.
                    Map<String, Object> renew = new LinkedHashMap<>();
                    renew.put("token", token);
                    renew.put("request_id", requestId);
                    renew.put("ttl", ttl);
                    long again = Clock.now();
                    Answer rr = call("POST", lockPath(name, "renew"), Json.object(renew),
                            Math.min((long) (ttl * 1e9), requestTimeout));
                    if (rr.status != 200 || !(rr.body.get("expires_in") instanceof Number renewed)
                            || !(renewed.doubleValue() >= 0)) {
                        Map<String, Object> rel = new LinkedHashMap<>();
                        rel.put("token", token);
                        rel.put("request_id", requestId);
                        call("POST", lockPath(name, "release"), Json.object(rel), 2_000_000_000L);
                        throw new LeaseLostException(
                                "took " + name + ", but could not confirm the grant: " + rr.describe(),
                                "lease_lost");
                    }
                    validUntil = again + (long) ((Math.min(renewed.doubleValue(), ttl) - margin) * 1e9);
                    grant = new LinkedHashMap<>(r.body);
                    grant.putAll(rr.body);
                }
                Lease lease = new Lease(this, name, requestId, grant, ttl, margin, validUntil, o.onLost);
                leases.add(lease);
                if (closed) lease.release(); // (closed meanwhile: not left behind)
                return lease;
            }
            if (r.status == 410 && sends > 1 && received - retryUntil < 0) {
                // A retry of ours answered "this request id's grant has ended": granted, and
                // run out before an answer got through. A new attempt, under a new id (a request
                // id names one attempt: the gateway refuses a late duplicate of an ended grant).
                requestId = "java-" + UUID.randomUUID().toString().replace("-", "");
                sends = 0;
                continue;
            }
            boolean waitMore = r.status == 409 && "timeout".equals(r.error());
            if (waitMore && received - waitUntil < 0) {
                // Asked again at once after a long poll; after one that came at once, after a
                // pause (doubling, jittered, within the time left): no spinning on a 409 front.
                if (received - sent >= 1_000_000_000L) {
                    busy = 50;
                } else {
                    sleepMillis(Math.min(jitter(busy), Math.max(0, (waitUntil - received) / 1_000_000)));
                    busy = Math.min(busy * 2, 1000);
                }
                continue;
            }
            boolean transient_ = r.status == 0 || r.status == 503;
            if (transient_ && received - retryUntil < 0) {
                sleepMillis(Math.min(jitter(backoff), Math.max(0, (retryUntil - received) / 1_000_000)));
                backoff = Math.min(backoff * 2, 2000);
                continue;
            }
            String msg = "could not take " + name + ": " + r.describe();
            String code = r.error() != null ? r.error() : r.status == 0 ? "unavailable" : "error";
            if (waitMore) throw new LockTimeoutException(msg, r.status, code);
            if (r.status == 410) throw new LeaseLostException(msg, code);
            throw new FencedException(msg, r.status, code);
        }
    }

    /** {@code POST /v1/check}: is this token the current grant of its lock? */
    public Map<String, Object> check(String token) {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("token", token);
        return ok("check", call("POST", "/v1/check", Json.object(body), requestTimeout));
    }

    /** {@code GET /v1/locks/{name}}: who holds it, and the highest token granted. */
    public Map<String, Object> status(String name) {
        return ok("status", call("GET", lockPath(name, null), null, requestTimeout));
    }

    private static Map<String, Object> ok(String what, Answer r) {
        if (r.status == 200 && r.bad) {
            throw new FencedException(what + " failed: the answer is " + r.body.get("message"), 200, "bad_answer");
        }
        if (r.status != 200) {
            String code = r.error() != null ? r.error() : r.status == 0 ? "unavailable" : "error";
            throw new FencedException(what + " failed: " + r.describe(), r.status, code);
        }
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

    /** Half to all of {@code ms}: clients that failed together do not retry in step. */
    static long jitter(long ms) {
        return (long) (ms * (0.5 + ThreadLocalRandom.current().nextDouble() / 2));
    }

    static void sleepMillis(long ms) {
        try {
            Thread.sleep(ms);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new FencedException("interrupted", 0, "interrupted");
        }
    }

    /** An answer: the status (0: none, the reason in message) and the JSON body; {@code bad}:
     * the answer is no JSON object (a proxy's page, another server), its text in message. */
    static final class Answer {
        final int status;
        final Map<String, Object> body;
        final boolean bad;

        Answer(int status, Map<String, Object> body, boolean bad) {
            this.status = status;
            this.body = body;
            this.bad = bad;
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

    /** One request, bounded by {@code timeoutNanos} from the start (connecting included);
     * never completes exceptionally. */
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
        CompletableFuture<HttpResponse<Capped.Body>> sent;
        try {
            sent = http.sendAsync(b.build(), info -> new Capped(info, MAX_ANSWER));
        } catch (RuntimeException e) {
            return CompletableFuture.completedFuture(failure(e));
        }
        // (on a copy: the timeout then cancels the exchange itself, its connect included,
        // which java.net.http aborts; completing the exchange's own future would not)
        return sent.copy().orTimeout(timeout.toNanos(), TimeUnit.NANOSECONDS).handle((resp, err) -> {
            if (err != null) {
                sent.cancel(true);
                return failure(err);
            }
            int status = resp.statusCode();
            if (status >= 300 && status < 400) {
                // Never followed (java.net.http's default, kept): the request id and the token
                // would go to another origin, and its answer be taken for this server's grant.
                String to = resp.headers().firstValue("location").map(l -> {
                    try {
                        return " to " + scrub(shown(URI.create(url + "/").resolve(l).toString()));
                    } catch (RuntimeException e) {
                        return " to " + scrub(shown(l));
                    }
                }).orElse("");
                return bad(status, "redirected" + to + ": not followed (give the server's own URL)");
            }
            Capped.Body answer = resp.body();
            if (answer.over()) return bad(status, "not JSON: an answer over " + MAX_ANSWER + " bytes (not read)");
            Map<String, Object> json = Json.parseObject(answer.text());
            if (json == null) {
                String text = scrub(answer.text()).replaceAll("\\s+", " ").trim();
                text = text.substring(0, Math.min(200, text.length()));
                return bad(status, "not JSON: " + (text.isEmpty() ? "(empty)" : text));
            }
            // Every text from the server scrubbed, and an error code that is none dropped: so
            // describe() and code() show nothing of the key.
            Object m = json.get("message");
            if (m instanceof String text) json.put("message", scrub(text));
            else json.remove("message");
            Object e = json.get("error");
            if (e != null && !(e instanceof String code && CODE.matcher(code).matches() && scrub(code).equals(code))) {
                json.remove("error");
            }
            return new Answer(status, json, false);
        });
    }

    private static Answer bad(int status, String message) {
        Map<String, Object> m = new LinkedHashMap<>();
        m.put("message", message);
        return new Answer(status, m, true);
    }

    Answer call(String method, String path, String body, long timeoutNanos) {
        return callAsync(method, path, body, timeoutNanos).join();
    }

    private Answer failure(Throwable err) {
        while (err instanceof CompletionException && err.getCause() != null) err = err.getCause();
        String why = err instanceof TimeoutException || err instanceof java.net.http.HttpTimeoutException
                ? "timed out"
                : err.getClass().getSimpleName() + (err.getMessage() != null ? ": " + err.getMessage() : "");
        Map<String, Object> m = new LinkedHashMap<>();
        m.put("message", scrub(why));
        return new Answer(0, m, false);
    }
}
