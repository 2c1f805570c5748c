package dev.fenced.client;

import java.time.Duration;
import java.util.function.Consumer;

/** How to take a lock: {@code new LockOptions().ttl(Duration.ofSeconds(10)).timeout(...)}. */
public final class LockOptions {
    Duration ttl = Duration.ofSeconds(10);
    Duration timeout = Duration.ZERO;
    String requestId;
    String owner;
    Duration safetyMargin;
    Duration retryFor = Duration.ofSeconds(10);
    Consumer<String> onLost;

    /** Lease length, 0.1 s to 86,400 s (default 10 s); renewed every ttl/3 in the background. */
    public LockOptions ttl(Duration ttl) {
        this.ttl = ttl;
        return this;
    }

    /** How long to wait in line (FIFO); zero (default): try once. */
    public LockOptions timeout(Duration timeout) {
        this.timeout = timeout;
        return this;
    }

    /** Your id for this grant (1-64 of A-Z a-z 0-9 _ . : -); random if unset. A retry with the
     * same id returns the same grant. It is the grant's capability: keep it private. */
    public LockOptions requestId(String requestId) {
        this.requestId = requestId;
        return this;
    }

    /** Who you are, for operators (status, dashboard). */
    public LockOptions owner(String owner) {
        this.owner = owner;
        return this;
    }

    /** How long before the confirmed end the token stops being handed out
     * (default min(1 s, ttl/10)). */
    public LockOptions safetyMargin(Duration margin) {
        this.safetyMargin = margin;
        return this;
    }

    /** How long to keep retrying connection errors and 503s when the timeout is shorter
     * (default 10 s). */
    public LockOptions retryFor(Duration retryFor) {
        this.retryFor = retryFor;
        return this;
    }

    /** Called once, with the reason, when the lease is lost (on a background thread). */
    public LockOptions onLost(Consumer<String> onLost) {
        this.onLost = onLost;
        return this;
    }
}
