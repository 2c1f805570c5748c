// The package's contract against a real `fenced serve` at $FENCED_TEST_URL (started by
// tests/test_clients.py, which runs `node --test` in `make test`).
import assert from "node:assert/strict";
import { createServer as createHttpServer } from "node:http";
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

// -- what a client must refuse or survive: bad keys and URLs, odd answers, hung servers ----------

const BAD_KEYS = {
  "non-ASCII": "fk_sécret_0123456789abcdef",
  "not Latin-1": "fk_ключ_密钥_0123456789abcdef",
  "header injection": "fk_secret_0123\r\nX-Evil: injected",
  "a newline": "fk_secret_0123\nmore_secret_456",
  "a control character": "fk_secret_0123\tmore_secret_456",
  "blanks around it": " fk_secret_0123456789abcdef ",
  empty: "",
  "too long": `fk_${"x".repeat(4094)}`,
};

test("a bad API key is one clear FencedError before any request; the key never shown", async () => {
  for (const [what, key] of Object.entries(BAD_KEYS)) {
    for (const where of ["apiKey", "$FENCED_API_KEY"]) {
      if (where === "$FENCED_API_KEY" && key === "") continue; // (empty: no key, as unset)
      const saved = process.env.FENCED_API_KEY;
      let client;
      try {
        if (where === "apiKey") {
          client = new FencedClient("http://127.0.0.1:9", { apiKey: key });
        } else {
          process.env.FENCED_API_KEY = key;
          client = new FencedClient("http://127.0.0.1:9");
        }
      } catch (e) {
        assert.ok(e instanceof FencedError && e.code === "invalid_request", `${what}: ${e}`);
        assert.ok(e.message.startsWith(`${where} `), `${what}: ${e.message}`);
        assert.ok(!e.message.includes("\n") && !e.message.includes("\r"), `${what}: two lines`);
        for (const part of key.split(/[\r\n\t ]+/).filter((x) => x.length > 3)) {
          assert.ok(!e.message.includes(part), `${what}: the key shown: ${e.message}`);
        }
        continue;
      } finally {
        if (saved === undefined) delete process.env.FENCED_API_KEY;
        else process.env.FENCED_API_KEY = saved;
      }
      assert.fail(`${what} (${where}): accepted (${client.url})`);
    }
  }
  assert.throws(() => new FencedClient("http://127.0.0.1:9", { apiKey: 17 }), /apiKey must be a string/);
  // What the rule lets through: 4096 visible characters, blanks inside; an empty variable is unset.
  new FencedClient("http://127.0.0.1:9", { apiKey: `fk_${"x".repeat(4093)}` });
  new FencedClient("http://127.0.0.1:9", { apiKey: "fk two words !#$%&()*+,-./:;<=>?@[]^_`{|}~" });
  new FencedClient("http://127.0.0.1:9", { apiKey: null });
});

test("a URL with credentials, a query or no URL at all: one clear error that never shows them", () => {
  for (const [url, hidden] of [
    ["http://tenant:hunter2-pass@127.0.0.1:7400", "hunter2"],
    ["http://fk_secret_in_user@127.0.0.1:7400/", "fk_secret"],
    ["https://127.0.0.1:7400/?key=fk_secret_query", "fk_secret"],
    ["http://127.0.0.1:7400/#fk_secret_fragment", "fk_secret"],
    ["fk_secret_pasted_here", "k_secret"],
    ["ftp://127.0.0.1/", "\u0000"],
  ]) {
    assert.throws(
      () => new FencedClient(url),
      (e) => e instanceof FencedError && e.code === "invalid_request" && !e.message.includes(hidden),
      url,
    );
  }
  assert.equal(new FencedClient("http://127.0.0.1:7400/base/").url, "http://127.0.0.1:7400/base");
});

const keyed = process.env.FENCED_TEST_KEYED_URL;
const keyedOpts = { skip: keyed ? false : "FENCED_TEST_KEYED_URL is not set" };

test("a keyed server: the rightful key takes and releases, a wrong one is 401 (not shown)", keyedOpts, async () => {
  const client = new FencedClient(keyed, { apiKey: process.env.FENCED_TEST_KEY });
  const lease = await client.lock(unique("js/keyed"), { ttl: 5 });
  assert.equal(lease.value, 1);
  assert.equal(await lease.release(), true);
  const wrong = "fk_wrong_but_well_formed_0123";
  await assert.rejects(
    new FencedClient(keyed, { apiKey: wrong }).lock("js/keyed-wrong", {}),
    (e) => e instanceof FencedError && e.status === 401 && !e.message.includes(wrong),
  );
});

// A real HTTP server (node:http) that answers every request with `reply(req, res)`.
async function serving(reply) {
  const server = createHttpServer(reply);
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  return { url: `http://127.0.0.1:${server.address().port}`, close: () => server.closeAllConnections() || server.close() };
}

test("an answer that is no JSON object: one clear FencedError, never taken for a result", async () => {
  const key = "fk_echoed_secret_0123456789";
  for (const [status, body] of [
    [200, "<html><body>Welcome to nginx!</body></html>"],
    [200, "[1, 2]"],
    [200, "null"],
    [200, ""],
    [502, "<html><head><title>502 Bad Gateway</title></head></html>"],
  ]) {
    const s = await serving((req, res) => res.writeHead(status, { "content-type": "text/html" }).end(body));
    try {
      const client = new FencedClient(s.url, { apiKey: key });
      for (const call of [() => client.status("x"), () => client.check("x:1"), () => client.lock("x", { retryFor: 0 })]) {
        await assert.rejects(call(), (e) => {
          assert.ok(e instanceof FencedError && !(e instanceof LeaseLostError), String(e));
          assert.equal(e.status, status);
          if (status === 200) assert.equal(e.code, "bad_answer", e.message);
          assert.match(e.message, /not JSON/);
          assert.ok(!e.message.includes("\n"), e.message);
          return true;
        }, `${status} ${body}`);
      }
    } finally {
      s.close();
    }
  }
  // A proxy that echoes the request's headers in its error page: the key is not repeated.
  const echo = await serving((req, res) => res.writeHead(400).end(`bad request: ${req.headers.authorization}`));
  try {
    await assert.rejects(new FencedClient(echo.url, { apiKey: key }).status("x"), (e) => {
      assert.ok(!e.message.includes(key) && e.message.includes("Bearer ***"), e.message);
      return true;
    });
  } finally {
    echo.close();
  }
});

// How long `call` takes to reject (ms), with the error.
async function rejection(call) {
  const started = performance.now();
  try {
    await call();
  } catch (e) {
    return [performance.now() - started, e];
  }
  assert.fail("it did not fail");
}

test("a hung server: requestTimeout bounds each call, connecting included; lock() its timeout", async () => {
  // Accepts and never answers; sends a head and never the body; never accepts (a listen queue
  // that is full: held by tests/server/test_server_clients.py as FENCED_TEST_UNACCEPTED_PORT).
  const silent = createServer((sock) => sock.on("error", () => {}));
  const halfway = createServer((sock) => {
    sock.on("error", () => {});
    sock.once("data", () => sock.write("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 90\r\n\r\n{\"held\""));
  });
  const sockets = [];
  for (const s of [silent, halfway]) {
    s.on("connection", (sock) => sockets.push(sock));
    await new Promise((ok) => s.listen(0, "127.0.0.1", ok));
  }
  const urls = [silent, halfway].map((s) => `http://127.0.0.1:${s.address().port}`);
  if (process.env.FENCED_TEST_UNACCEPTED_PORT) urls.push(`http://127.0.0.1:${process.env.FENCED_TEST_UNACCEPTED_PORT}`);
  async function each(url) {
    const quick = new FencedClient(url, { requestTimeout: 0.5 });
    for (const call of [() => quick.status("x"), () => quick.check("x:1"), () => quick.lock("x", { retryFor: 0 })]) {
      const [took, e] = await rejection(call);
      assert.ok(e instanceof FencedError && e.status === 0 && /timed out/.test(e.message), `${url}: ${e}`);
      assert.ok(took >= 450 && took < 4000, `${url}: ${took} ms for a 0.5 s requestTimeout`);
    }
    // lock()'s own timeout bounds it (+ 1 s for a last try), whatever requestTimeout says
    const [took, e] = await rejection(() => new FencedClient(url).lock("x", { timeout: 0.5 }));
    assert.ok(e instanceof FencedError && e.status === 0, `${url}: ${e}`);
    assert.ok(took >= 450 && took < 4500, `${url}: ${took} ms for a 0.5 s timeout`);
  }
  try {
    await Promise.all(urls.map(each)); // (the servers side by side: 3 s, not 9)
  } finally {
    for (const sock of sockets) sock.destroy();
    silent.close();
    halfway.close();
  }
  assert.throws(() => new FencedClient("http://127.0.0.1:9", { requestTimeout: 0 }), /requestTimeout must be/);
});

test("a renewal hung on its connection is asked again within requestTimeout: the lease is kept", async () => {
  // A gateway that grants (ttl 3 s), never answers the first renewal, and answers the next.
  let renewals = 0;
  const held = [];
  const s = await serving((req, res) => {
    req.resume();
    req.on("end", () => {
      if (req.url.endsWith("/-/acquire")) {
        res.writeHead(200, { "content-type": "application/json" });
        res.end(JSON.stringify({ lock: "r", token: "r:1", value: 1, ttl: 3, request_id: "q", expires_in: 3 }));
      } else if (req.url.endsWith("/-/renew")) {
        renewals += 1;
        if (renewals === 1) held.push(res); // (hangs: the answer never comes)
        else res.writeHead(200, { "content-type": "application/json" }).end('{"ttl": 3, "expires_in": 3}');
      } else {
        res.writeHead(200, { "content-type": "application/json" }).end('{"released": true}');
      }
    });
  });
  try {
    const lease = await new FencedClient(s.url, { requestTimeout: 0.3 }).lock("r", { ttl: 3 });
    const deadline = performance.now() + 10_000;
    while (lease.renewals < 1 && lease.state === "held") {
      assert.ok(performance.now() < deadline, "no renewal");
      await new Promise((ok) => setTimeout(ok, 20));
    }
    // (was: the hung renewal waited out the lease's whole confirmed time, and it was lost)
    assert.equal(lease.state, "held", lease.lostReason);
    assert.equal(lease.renewals, 1);
    assert.ok(renewals >= 2 && lease.renewalFailures >= 1, `${renewals} renewals sent`);
    assert.equal(await lease.release(), true);
  } finally {
    for (const res of held) res.destroy();
    s.close();
  }
});

test("a 410 to a retried acquire is a new attempt under a new id; to a first send, LeaseLostError", async () => {
  // A gateway: the first send is lost (503), its retry finds the grant made meanwhile ended
  // (410: a late duplicate), and only a new request id is granted.
  const ids = [];
  const gw = await serving((req, res) => {
    let data = "";
    req.on("data", (c) => (data += c));
    req.on("end", () => {
      const rid = JSON.parse(data).request_id;
      ids.push(rid);
      const json = (status, body) =>
        res.writeHead(status, { "content-type": "application/json" }).end(JSON.stringify(body));
      if (req.url.endsWith("/release")) return json(200, { released: true });
      if (ids.length === 1) return json(503, { error: "unavailable", message: "source down" });
      if (rid === ids[0]) return json(410, { error: "lease_lost", message: "the grant of this request id has ended" });
      json(200, { lock: "x", token: "x:2", value: 2, signed: null, request_id: rid, ttl: 10, expires_in: 10 });
    });
  });
  try {
    const client = new FencedClient(gw.url);
    const lease = await client.lock("x", { retryFor: 5 });
    assert.equal(ids.length, 3);
    assert.equal(ids[1], ids[0]); // (the retry: the same id)
    assert.notEqual(ids[2], ids[0]); // (the new attempt: a new one)
    assert.equal(lease.requestId, ids[2]);
    assert.equal(lease.token, "x:2");
    await lease.release();
    // an id given by the caller whose grant has ended: the first answer is 410, one clear error
    ids.length = 0;
    ids.push("spent"); // (as if the lost send had been this id's)
    await assert.rejects(client.lock("x", { requestId: "spent", retryFor: 5 }), (e) => {
      assert.ok(e instanceof LeaseLostError && e.status === 410, String(e));
      return true;
    });
  } finally {
    gw.close();
  }
});
