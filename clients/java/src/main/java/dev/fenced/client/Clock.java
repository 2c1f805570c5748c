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
    private static long base; // boot - monotonic (ns) at the first reading: its highest possible value
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
     * one can be read). The boot clock was read at some moment between {@code before} and
     * {@code after}: the first reading takes the highest difference it allows and later ones
     * the lowest, so a thread descheduled (or a GC) during a reading never looks like a suspend
     * (which would cut leases short); a suspend is counted short by that time at most
     * (milliseconds, within the safety margin). The first reading is tried a few times for a
     * tight one. */
    static long now() {
        for (int tries = 0;; tries++) {
            long before = System.nanoTime();
            double b;
            try {
                b = boot.getAsDouble();
            } catch (RuntimeException e) {
                b = Double.NaN;
            }
            long after = System.nanoTime();
            synchronized (LOCK) {
                if (!Double.isFinite(b)) return after + ahead;
                long bootNanos = (long) (b * 1e9);
                if (!started) {
                    if (after - before > 1_000_000L && tries < 4) continue;
                    started = true;
                    base = bootNanos - before;
                } else if (bootNanos - after - base > ahead) {
                    ahead = bootNanos - after - base;
                }
                return after + ahead;
            }
        }
    }

    /** Forget the first reading (a test that replaces {@link #boot}); what was added stays. */
    static void restart() {
        synchronized (LOCK) {
            started = false;
        }
    }
}
