package dev.fenced.client;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.function.DoubleSupplier;

/**
 * The clock leases are timed on. {@link System#nanoTime()} is CLOCK_MONOTONIC on Linux, which
 * stops while the machine is suspended: after a laptop's or a VM's suspend longer than the ttl,
 * a lease timed on it alone would still look valid and hand out its stale token. The JDK
 * exposes no CLOCK_BOOTTIME, but /proc/uptime is read from it (in centiseconds): the time the
 * boot clock has run ahead of the monotonic one is the time spent suspended, and it is added.
 * Elsewhere (macOS, Windows) no such clock is read: see README.md.
 */
final class Clock {
    private static final Path UPTIME = Path.of("/proc/uptime");

    /** Seconds since boot, counting suspended time, or NaN (none here). Replaced in the tests
     * (by reflection) to play a suspend. */
    static volatile DoubleSupplier boot = Files.isReadable(UPTIME) ? Clock::uptime : () -> Double.NaN;

    private static final Object LOCK = new Object();
    private static boolean started;
    private static long base; // boot - monotonic (ns) at the first reading
    private static long ahead; // how far the boot clock has run ahead since: suspended (ns)

    private Clock() {}

    private static double uptime() {
        try {
            String text = new String(Files.readAllBytes(UPTIME), StandardCharsets.US_ASCII);
            return Double.parseDouble(text.substring(0, text.indexOf(' ')));
        } catch (IOException | RuntimeException e) {
            return Double.NaN;
        }
    }

    /** Nanoseconds on a clock that never goes back and keeps counting through a suspend (where
     * one can be read). (Its 10 ms resolution only ever makes it run ahead: the safe side.) */
    static long now() {
        double b;
        try {
            b = boot.getAsDouble();
        } catch (RuntimeException e) {
            b = Double.NaN;
        }
        long mono = System.nanoTime();
        synchronized (LOCK) {
            if (Double.isFinite(b)) {
                long skew = (long) (b * 1e9) - mono;
                if (!started) {
                    started = true;
                    base = skew;
                } else if (skew - base > ahead) {
                    ahead = skew - base;
                }
            }
            return mono + ahead;
        }
    }

    /** Forget the first reading (a test that replaces {@link #boot}); what was added stays. */
    static void restart() {
        synchronized (LOCK) {
            started = false;
        }
    }
}
