// The clock leases are timed on. performance.now() (libuv's uv_hrtime) is CLOCK_MONOTONIC on
// Linux, which stops while the machine is suspended: after a laptop's or a VM's suspend longer
// than the ttl, a lease timed on it alone would still look valid and hand out its stale token.
// Node exposes no CLOCK_BOOTTIME, but os.uptime() reads it (/proc/uptime on Linux, in
// centiseconds): the time the boot clock has run ahead of the monotonic one is the time spent
// suspended, and it is added. Elsewhere (macOS, Windows) no such clock is read: see README.md.
import { uptime } from "node:os";

const linux = globalThis.process?.platform === "linux";

/** Where the boot-time clock is read: seconds since boot, counting suspended time, or null
 * (none here). Replaced in the tests to play a suspend. */
export const bootClock = {
  read: linux ? () => uptime() : () => null,
};

let base = null; // boot - monotonic (ms) at the first reading
let ahead = 0; // how far the boot clock has run ahead of the monotonic one since: suspended (ms)

/** Milliseconds on a clock that never goes back and keeps counting through a suspend (where
 * one can be read). (Its 10 ms resolution only ever makes it run ahead: the safe side.) */
export function now() {
  const mono = performance.now();
  let boot = null;
  try {
    boot = bootClock.read();
  } catch {
    boot = null;
  }
  if (typeof boot === "number" && Number.isFinite(boot)) {
    const skew = boot * 1000 - mono;
    if (base === null) base = skew;
    else if (skew - base > ahead) ahead = skew - base;
  }
  return mono + ahead;
}

/** Forget the first reading (a test that replaces bootClock.read); what was added stays. */
export function restartBootClock() {
  base = null;
}
