// The package's contract against a real `fenced serve` at $FENCED_TEST_URL (started by
// tests/test_clients.py, which runs `node --test` in `make test`).
import assert from "node:assert/strict";
import { createServer } from "node:net";
import { test } from "node:test";

import { FencedClient, FencedError, LeaseLostError, LockTimeoutError } from "../index.js";

const url = process.env.FENCED_TEST_URL;
const opts = { skip: url ? false : "FENCED_TEST_URL is not set (tests/test_clients.py sets it)" };
const unique = (what) => `${what}-${process.pid}-${Math.floor(performance.now())}`;

test("a lease hands out its token, renews, and releases once", opts, async () => {
  const client = new FencedClient(url);
  const name = unique("js/basic");
  // (ttl 1.5: a renewal may be a second late on a loaded machine and still land in time)
  const lease = await client.lock(name, { ttl: 1.5 });
  assert.equal(lease.state, "held");
  assert.equal(lease.token, `${name}:1`);
  assert.equal((await client.check(lease.token)).verdict, "current");
  // Two renewals (every ttl/3) confirmed: waited for with a bound, not slept.
  const deadline = performance.now() + 10_000;
  while (lease.renewals < 2) {
    assert.ok(performance.now() < deadline, "no renewals");
    await new Promise((ok) => setTimeout(ok, 20));
  }
  assert.equal(lease.state, "held");
  assert.equal(await lease.release(), true);
  assert.equal(await lease.release(), true); // idempotent: the first call's answer
  assert.equal(lease.state, "released");
  assert.throws(() => lease.token, LeaseLostError);
  assert.equal((await client.status(name)).held, false);
});

test("a renewal refused with 410 ends in lost: event, state, promise; never the token", opts, async () => {
  const client = new FencedClient(url);
  const name = unique("js/lost");
  const events = [];
  const lease = await client.lock(name, { ttl: 1, onLost: (reason) => events.push(reason) });
  // An operator frees it: the next renewal is answered 410 lease_lost.
  const r = await fetch(`${url}/v1/locks/${name}/-/force-release`, { method: "POST", body: "{}" });
  assert.equal(r.status, 200);
  const reason = await lease.lost;
  assert.match(reason, /^410 lease_lost/);
  assert.deepEqual(events, [reason]);
  assert.equal(lease.state, "lost");
  assert.throws(() => lease.token, (err) => err instanceof LeaseLostError && err.code === "lease_lost");
  assert.equal(await lease.release(), false); // harmless, and it does not throw
  // The next holder gets a higher token.
  const next = await client.lock(name, { ttl: 5 });
  assert.equal(next.value, 2);
  await next.release();
});

test("a held lock: a second lock() times out with LockTimeoutError", opts, async () => {
  const client = new FencedClient(url);
  const name = unique("js/busy");
  const lease = await client.lock(name, { ttl: 5 });
  await assert.rejects(client.lock(name, { ttl: 5, timeout: 0.2 }), LockTimeoutError);
  await lease.release();
});

test("bad input is one clear FencedError, before any request", opts, async () => {
  const client = new FencedClient(url);
  await assert.rejects(client.lock("no spaces", {}), (e) => e instanceof FencedError && e.code === "invalid_request");
  await assert.rejects(client.lock("ok", { ttl: 0 }), /ttl must be a number from 0.1 to 86400/);
  await assert.rejects(client.lock("ok", { requestId: "-x" }), /not a request id/);
  assert.throws(() => new FencedClient("localhost:7400"), FencedError);
});

test("an unreachable server: lock() retries, then one FencedError (status 0)", opts, async () => {
  // A port nothing listens on: held for the run by tests/server/test_server_clients.py
  // (FENCED_TEST_DEAD_PORT); else one that was free a moment ago, which another process
  // (another test worker's server) could take meanwhile.
  const port =
    process.env.FENCED_TEST_DEAD_PORT ??
    (await new Promise((ok) => {
      const probe = createServer().listen(0, "127.0.0.1", () => {
        const { port } = probe.address();
        probe.close(() => ok(port));
      });
    }));
  const client = new FencedClient(`http://127.0.0.1:${port}`);
  const started = performance.now();
  await assert.rejects(client.lock("js/away", { retryFor: 0.5 }), (e) => e instanceof FencedError && e.status === 0);
  assert.ok(performance.now() - started >= 400, "it did not retry");
});
