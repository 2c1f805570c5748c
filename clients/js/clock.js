// The clock leases are timed on. performance.now() (libuv's uv_hrtime) is CLOCK_MONOTONIC on
// Linux, which stops while the machine is suspended: after a laptop's or a VM's suspend longer
// than the ttl, a lease timed on it alone would still look valid and hand out its stale token.
// Node exposes no CLOCK_BOOTTIME, but /proc/uptime is read from it (in centiseconds; not
// os.uptime(), which libuv may round to whole seconds): the time the boot clock has run ahead
// of the monotonic one is the time spent suspended, and it is added. Elsewhere (macOS,
// Windows) no such clock is read: see README.md.
import { readFileSync } from "node:fs";

const UPTIME = "/proc/uptime";

function uptime() {
  try {
    return Number.parseFloat(readFileSync(UPTIME, "latin1"));
  } catch {
    return null; // (no /proc: not Linux, or a sandbox)
  }
}

/** Where the boot-time clock is read: seconds since boot, counting suspended time, or null
 * (none here). Replaced in the tests to play a suspend. */
export const bootClock = {
  read: globalThis.process?.platform === "linux" ? uptime : () => null,
};

let base = null; // boot - monotonic (ms) at the first reading: its highest possible value
let ahead = 0; // how far the boot clock has run ahead of the monotonic one since: suspended (ms)

// One reading of the boot clock (ms), and the monotonic readings just before and after it.
function sample() {
  const before = performance.now();
  let boot = null;
  try {
    boot = bootClock.read();
  } catch {
    boot = null;
  }
  const after = performance.now();
  return typeof boot === "number" && Number.isFinite(boot) ? { boot: boot * 1000, before, after } : { after };
}

/** Milliseconds on a clock that never goes back and keeps counting through a suspend (where
 * one can be read). The boot clock was read at some moment between `before` and `after`: the
 * first reading takes the highest difference it allows and later ones the lowest, so a thread
 * descheduled (or a GC) during a reading never looks like a suspend (which would cut leases
 * short); a suspend is counted short by that time at most (milliseconds, within the safety
 * margin). The first reading is tried a few times for a tight one. */
export function now() {
  let s = sample();
  if (base === null && s.boot !== undefined) {
    for (let i = 0; i < 4 && s.after - s.before > 1; i++) s = sample();
    base = s.boot - s.before;
  } else if (s.boot !== undefined && s.boot - s.after - base > ahead) {
    ahead = s.boot - s.after - base;
  }
  return s.after + ahead;
}

/** Forget the first reading (a test that replaces bootClock.read); what was added stays. */
export function restartBootClock() {
  base = null;
}
