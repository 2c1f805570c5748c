package dev.fenced.client;

import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.function.Consumer;

/**
 * A granted lock, renewed in the background.
 *
 * <p>{@link #token()} hands out the fencing token only while the lease is confirmed valid by
 * this JVM's clock ({@link System#nanoTime()}, plus on Linux the time the machine was suspended,
 * read from /proc/uptime: the last confirmed renewal, counted from when it was sent, plus the
 * ttl (never more, whatever the server says), minus a safety margin). After that it throws
 * {@link LeaseLostException}, never the stale token. A renewal failure (no answer, a 5xx, a
 * 410, a timeout) that leaves the lease unconfirmed past its time ends in {@link State#LOST}:
 * the {@code onLost} callbacks run and {@link #lost()} completes; nothing is thrown on the
 * renewal thread. A pause (GC, SIGSTOP) past the lease is seen as lost at once on waking.
 */
public final class Lease implements AutoCloseable {
    public enum State { HELD, LOST, RELEASED }

    /** What a release found: released; it had already ended; the server could not be reached
     * (the lease ends at its ttl). */
    public enum Released { RELEASED, ALREADY_ENDED, UNKNOWN }

    private final FencedClient client;
    private final String name;
    private final String requestId;
    private final double ttl;
    private final long value;
    private final String token;
    private final long marginNanos;
    private final String body; // a renewal's and a release's
    private final List<Consumer<String>> listeners = new ArrayList<>();
    private final CompletableFuture<String> lost = new CompletableFuture<>();
    private long validUntil; // Clock.now()
    private volatile State state = State.HELD;
    private String lostReason;
    private String lastFailure;
    private int renewals;
    private int renewalFailures;
    private ScheduledFuture<?> timer;
    private ScheduledFuture<?> watchdog;
    private CompletableFuture<Released> released; // the first release()'s answer, for every call

    Lease(FencedClient client, String name, String requestId, Map<String, Object> grant, double ttl,
            double margin, long validUntil, Consumer<String> onLost) {
        this.client = client;
        this.name = name;
        this.requestId = requestId;
        // The ttl granted, if the server says (it may grant less than asked), never more than asked.
        this.ttl = grant.get("ttl") instanceof Number n && n.doubleValue() >= FencedClient.MIN_TTL
                && n.doubleValue() < ttl ? n.doubleValue() : ttl;
        this.value = grant.get("value") instanceof Number n ? n.longValue() : 0;
        this.token = grant.get("signed") instanceof String s ? s : (String) grant.get("token");
        this.marginNanos = (long) (margin * 1e9);
        this.validUntil = validUntil;
        Map<String, Object> b = new LinkedHashMap<>();
        b.put("token", token);
        b.put("request_id", requestId);
        b.put("ttl", this.ttl); // lets a gateway that did not make the grant resume it
        this.body = Json.object(b);
        if (onLost != null) listeners.add(onLost);
        synchronized (this) {
            armWatchdog();
            schedule((long) (this.ttl * 1e9 / 3));
        }
    }

    public String name() {
        return name;
    }

    public String requestId() {
        return requestId;
    }

    /** The token's number (strictly greater than every earlier grant's). */
    public long value() {
        return value;
    }

    public Duration ttl() {
        return Duration.ofNanos((long) (ttl * 1e9));
    }

    /** Renewals confirmed so far. */
    public synchronized int renewals() {
        return renewals;
    }

    /** Renewal attempts that failed (each retried while the lease's time lasts). */
    public synchronized int renewalFailures() {
        return renewalFailures;
    }

    /** Why it was lost (null while held or after a release). */
    public synchronized String lostReason() {
        return lostReason;
    }

    /** Completes with the reason once lost; never exceptionally (never, if released). */
    public CompletableFuture<String> lost() {
        return lost.thenApply(r -> r);
    }

    /** Also call {@code listener} (once, with the reason) when the lease is lost; at once if it
     * already is. */
    public void onLost(Consumer<String> listener) {
        String reason;
        synchronized (this) {
            if (state() != State.LOST) {
                listeners.add(listener);
                return;
            }
            reason = lostReason;
        }
        notify(listener, reason);
    }

    /** HELD while confirmed valid by this JVM's clock (monotonic, counting through a suspend). */
    public State state() {
        List<Consumer<String>> toCall = null;
        String reason;
        synchronized (this) {
            if (state == State.HELD && Clock.now() - validUntil >= 0) {
                toCall = loseLocked(expiredReason());
            }
            reason = lostReason;
        }
        if (toCall != null) notifyAll(toCall, reason);
        return state;
    }

    /** How long the lease is surely still valid (zero once lost or released). */
    public Duration remaining() {
        if (state() != State.HELD) return Duration.ZERO;
        synchronized (this) {
            return Duration.ofNanos(Math.max(0, validUntil - Clock.now()));
        }
    }

    /** The fencing token to send with every write.
     * @throws LeaseLostException unless the lease is confirmed valid now (a pause can still fall
     *     between this and the write: the resource's guard, comparing tokens, refuses it) */
    public String token() {
        State s = state();
        if (s != State.HELD) {
            String why;
            synchronized (this) {
                why = lostReason != null ? lostReason : "released";
            }
            throw new LeaseLostException("the lease on " + name + " is " + s.name().toLowerCase() + ": " + why,
                    s == State.RELEASED ? "released" : "lease_lost");
        }
        return token;
    }

    /** Give the lock back. Idempotent: every call, from any thread, gets the first one's answer
     * (a call while the first is under way waits for it); never throws. */
    public Released release() {
        State now = state(); // (a lease past its time is lost, not released)
        CompletableFuture<Released> first;
        CompletableFuture<Released> mine = null;
        long until = 0;
        synchronized (this) {
            first = released;
            if (first == null) {
                released = mine = new CompletableFuture<>();
                if (now == State.HELD && state == State.HELD) state = State.RELEASED;
                stop();
                // Retried only while the lease's confirmed time lasts: after it the source ends
                // the lease by itself, and a lost lease gets one attempt.
                long tenSeconds = Clock.now() + 10_000_000_000L;
                until = validUntil - tenSeconds < 0 ? validUntil : tenSeconds;
            }
        }
        if (mine == null) return first.join();
        Released result = Released.UNKNOWN;
        try {
            result = releasing(until);
        } finally {
            client.forget(this);
            mine.complete(result);
        }
        return result;
    }

    private Released releasing(long until) {
        String path = client.lockPath(name, "release");
        for (;;) {
            long wait = Math.min(Math.max(until - Clock.now(), 2_000_000_000L), client.requestTimeout);
            FencedClient.Answer r = client.call("POST", path, body, wait);
            if (r.status == 200) {
                return Boolean.TRUE.equals(r.body.get("released")) ? Released.RELEASED : Released.ALREADY_ENDED;
            }
            if (r.status == 410) return Released.ALREADY_ENDED;
            // Sent again only if it surely did not arrive (refused connection) or was refused
            // unprocessed (503); a release by request id is idempotent in any case.
            String msg = String.valueOf(r.body.get("message"));
            boolean again = r.status == 503 || (r.status == 0 && msg.contains("ConnectException"));
            if (!again || until - Clock.now() < 200_000_000L) return Released.UNKNOWN;
            try {
                FencedClient.sleepMillis(200);
            } catch (FencedException interrupted) {
                return Released.UNKNOWN; // (never throws: the lease ends at its ttl)
            }
        }
    }

    /** {@link #release()}: for try-with-resources. */
    @Override
    public void close() {
        release();
    }

    @Override
    public String toString() {
        return "Lease(" + name + ":" + value + ", " + state() + ")"; // (no request id: a capability)
    }

    // -- the renewals ---------------------------------------------------------------------

    private String expiredReason() {
        return "not confirmed within its ttl" + (lastFailure != null ? " (last renewal: " + lastFailure + ")" : "");
    }

    private void stop() {
        if (timer != null) timer.cancel(false);
        if (watchdog != null) watchdog.cancel(false);
    }

    /** Marks it lost (under the lock); returns the listeners to call outside it. */
    private List<Consumer<String>> loseLocked(String reason) {
        if (state != State.HELD) return null;
        state = State.LOST;
        client.forget(this);
        lostReason = reason;
        stop();
        List<Consumer<String>> toCall = new ArrayList<>(listeners);
        listeners.clear();
        return toCall;
    }

    private void lose(String reason) {
        List<Consumer<String>> toCall;
        synchronized (this) {
            toCall = loseLocked(reason);
        }
        if (toCall != null) notifyAll(toCall, reason);
    }

    // The callbacks first: whoever waits on lost() finds them run.
    private void notifyAll(List<Consumer<String>> toCall, String reason) {
        for (Consumer<String> l : toCall) notify(l, reason);
        lost.complete(reason);
    }

    private static void notify(Consumer<String> listener, String reason) {
        try {
            listener.accept(reason);
        } catch (Throwable ignored) {
            // A listener that throws must not stop the others (the state is already LOST).
        }
    }

    // Fires at the end of the confirmed time unless a renewal moved it on.
    private void armWatchdog() {
        if (watchdog != null) watchdog.cancel(false);
        long left = Math.max(0, validUntil - Clock.now());
        try {
            watchdog = client.timers.schedule(this::state, left + 1_000_000, TimeUnit.NANOSECONDS);
        } catch (RejectedExecutionException closed) {
            watchdog = null; // (the client is closed: state() still reads the clock)
        }
    }

    private void schedule(long nanos) {
        if (timer != null) timer.cancel(false);
        try {
            timer = client.timers.schedule(() -> {
                try {
                    renew();
                } catch (Throwable e) {
                    lose("renewal failed: " + e);
                }
            }, nanos, TimeUnit.NANOSECONDS);
        } catch (RejectedExecutionException closed) {
            timer = null; // (the client is closed: not renewed, lost at its time)
        }
    }

    private void renew() {
        long sent;
        long until;
        synchronized (this) {
            if (state() != State.HELD) return;
            sent = Clock.now();
            until = validUntil;
        }
        String path = client.lockPath(name, "renew");
        // An answer after the lease's confirmed end could not confirm it anyway. Each attempt gets
        // half the time left (at least 200 ms, if there is that much; at most requestTimeout):
        // one hung on a dead connection (a gateway that hangs, a NAT's idle drop) is cut off
        // with time to ask again, on a fresh connection, while the lease lasts.
        long left = until - sent;
        long bound = Math.min(client.requestTimeout, Math.max(left / 2, Math.min(left, 200_000_000L)));
        client.callAsync("POST", path, body, bound).whenComplete((r, err) -> {
            try {
                renewed(sent, r);
            } catch (Throwable e) {
                lose("renewal failed: " + e);
            }
        });
    }

    private void renewed(long sent, FencedClient.Answer r) {
        String finalReason = null;
        synchronized (this) {
            if (state != State.HELD) return;
            if (r.status == 200 && r.body.get("expires_in") instanceof Number expires && expires.doubleValue() >= 0) {
                // Counted from when it was sent (the safe side), and never longer than the ttl.
                long next = sent + (long) (Math.min(expires.doubleValue(), ttl) * 1e9) - marginNanos;
                if (next - validUntil > 0) validUntil = next;
                renewals++;
                lastFailure = null;
                armWatchdog();
                schedule((long) (ttl * 1e9 / 3));
                return;
            }
            renewalFailures++;
            // A request cut off at the lease's end says nothing new: keep the failure before it.
            boolean cutOff = r.status == 0 && "timed out".equals(r.body.get("message"))
                    && Clock.now() - validUntil >= 0;
            if (!(cutOff && lastFailure != null)) lastFailure = r.describe();
            // No answer, a timeout, 5xx, 408, 429: the lease may still be good; ask again while
            // its confirmed time lasts. Anything else (410 lease_lost, 403, 400) is final.
            boolean transient_ = r.status == 0 || r.status >= 500 || r.status == 408 || r.status == 429;
            long left = validUntil - Clock.now();
            if (!transient_) finalReason = lastFailure;
            else if (left <= 0) finalReason = expiredReason();
            else schedule(Math.min(Math.min(Math.max(50_000_000L, (long) (ttl * 1e9 / 20)), 1_000_000_000L), left));
        }
        if (finalReason != null) lose(finalReason);
    }
}
