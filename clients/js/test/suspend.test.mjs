// A lease timed across a suspend of the machine (a laptop's lid, a VM paused by its host): its
// own process saw no time pass on the monotonic clock. Played by moving the boot-time clock
// (what clock.js reads on Linux: /proc/uptime) while the monotonic one stands: its own file, so
// that no other test sees the hour go by.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { test } from "node:test";

import { bootClock, restartBootClock } from "../clock.js";
import { FencedClient, LeaseLostError } from "../index.js";

test("a lease whose machine was suspended past its ttl hands out no token on waking", async () => {
  let suspended = 0; // seconds the boot clock ran while the monotonic one stood
  bootClock.read = () => performance.now() / 1000 + suspended; // (any platform)
  restartBootClock();
  const server = createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      const grant = req.url.endsWith("/-/release") ? { released: true } : { lock: "s", token: "s:1", value: 1, ttl: 30, expires_in: 30 };
      res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify(grant));
    });
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  try {
    const lease = await new FencedClient(`http://127.0.0.1:${server.address().port}`).lock("s", { ttl: 30 });
    assert.equal(lease.token, "s:1"); // the holder before the suspend: its token
    suspended = 3600; // an hour, in which the source let the lease go
    // (was: "held", its token handed out for the rest of the 30 s on the monotonic clock)
    assert.throws(() => lease.token, LeaseLostError);
    assert.equal(lease.state, "lost");
    assert.equal(lease.remaining, 0);
  } finally {
    server.closeAllConnections();
    server.close();
  }
});
