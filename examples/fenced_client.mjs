// A fenced lock client in plain JavaScript (Node 18+: the built-in fetch, no npm package).
//
//   node examples/fenced_client.mjs SERVER LOCK STORAGE_URL DATA [TTL]
//
// Takes LOCK from a `fenced serve` at SERVER, keeps it renewed, and on a line "write" on
// stdin PUTs DATA to STORAGE_URL with the fencing token in the Fencing-Token header (a
// storage service behind fenced's HTTP guard refuses a token lower than one it has seen).
// A line "release" (or the end of stdin) releases the lock and exits. Everything it learns
// is printed one line each: "token N", "write STATUS BODY", "lost ...", "released true|false".
//
// The rule to copy: the lease is held only while renewals are confirmed. Any renewal that
// is not answered 200 in time (410, a 503, a refused or dropped connection, no answer) means
// "lost": say so and never write again. Writes still carry the token, because a pause (GC,
// SIGSTOP) can fall between the last check and the write; the resource's guard catches that
// one. "write paused" shows it: it checks, prints "checked", waits for a line "resume", then
// writes (Figure 8-5 of Kleppmann's DDIA, played by tests/test_server_clients.py).

const [server, lock, storage, data, ttlText] = process.argv.slice(2);
const ttl = Number(ttlText ?? 10);
const headers = { "content-type": "application/json" };
if (process.env.FENCED_API_KEY) headers.authorization = `Bearer ${process.env.FENCED_API_KEY}`;
// Actions follow a "/-/" segment, which no lock name can hold.
const lockPath = `${server}/v1/locks/${lock.split("/").map(encodeURIComponent).join("/")}/-`;

// One request; never throws: a transport failure is status 0 with its reason.
async function call(verb, body, timeoutMs) {
  try {
    const r = await fetch(`${lockPath}/${verb}`, {
      method: "POST",
      headers,
      body: JSON.stringify(body),
      signal: AbortSignal.timeout(Math.max(1, Math.ceil(timeoutMs))),
    });
    const text = await r.text();
    let json = {};
    try { json = JSON.parse(text); } catch { json = { message: text.slice(0, 200) }; }
    return { status: r.status, body: json };
  } catch (err) {
    return { status: 0, body: { message: `${err.name}: ${err.cause?.code ?? err.message}` } };
  }
}

// A request id of our own makes a retried acquire idempotent: never two grants for one ask.
const requestId = `js-${process.pid}-${Date.now()}`;
let grant;
const acquireUntil = performance.now() + 60_000;
for (;;) {
  const r = await call(
    "acquire",
    { ttl, timeout: 30, request_id: requestId, owner: `node pid ${process.pid}` },
    40_000,
  );
  if (r.status === 200) { grant = r.body; break; }
  // 409: not granted within the long poll; 0 or 503: the gateway is away. The same request
  // id asks again (it cannot make a second grant); anything else is final.
  const again = r.status === 409 || r.status === 0 || r.status === 503;
  if (!again || performance.now() > acquireUntil) {
    console.log(`error ${r.status} ${r.body.message}`);
    process.exit(69);
  }
  if (r.status !== 409) await new Promise((ok) => setTimeout(ok, 500));
}
const token = grant.signed ?? grant.token;
// Until when the lease surely lasts (the server's expires_in, counted from the answer: the
// answer's own travel time is the slack), moved on by each confirmed renewal.
let validUntil = performance.now() + grant.expires_in * 1000;
console.log(`token ${grant.value}`);

// Renew at a third of the ttl; a renewal must be answered before the lease it extends runs
// out, or it counts as not confirmed. One at a time (a chain of timeouts, not an interval).
let lost = false;
let renewer;
function loseIt(reason) {
  if (lost) return;
  lost = true;
  clearTimeout(renewer);
  console.log(`lost ${reason}`);
}
async function renew() {
  const sent = performance.now();
  const r = await call("renew", { token, request_id: requestId }, validUntil - sent);
  if (lost) return;
  if (r.status === 200) {
    validUntil = sent + r.body.expires_in * 1000; // (from when it was sent: the safe side)
    renewer = setTimeout(renew, (ttl * 1000) / 3);
  }
  else loseIt(`${r.status || "no answer"} ${r.body.message ?? ""}`.trim());
}
renewer = setTimeout(renew, (ttl * 1000) / 3);

async function write() {
  if (lost) { console.log("write skipped: the lease is lost"); return; }
  await put();
}

async function put() {
  try {
    const r = await fetch(storage, { method: "PUT", headers: { "fencing-token": token }, body: data });
    console.log(`write ${r.status} ${(await r.text()).replace(/\s+/g, " ").slice(0, 200)}`);
  } catch (err) {
    console.log(`write failed ${err.name}: ${err.cause?.code ?? err.message}`);
  }
}

let paused = null; // "write paused": the write waiting for "resume"
async function release() {
  clearTimeout(renewer);
  const r = await call("release", { token, request_id: requestId }, 10_000);
  console.log(r.status === 200 ? `released ${r.body.released}` : `released unknown ${r.status}`);
  process.exit(0);
}

let buffered = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", async (chunk) => {
  buffered += chunk;
  let i;
  while ((i = buffered.indexOf("\n")) >= 0) {
    const line = buffered.slice(0, i).trim();
    buffered = buffered.slice(i + 1);
    if (line === "write") await write();
    if (line === "write paused") {
      if (lost) console.log("write skipped: the lease is lost");
      else { paused = put; console.log("checked"); }
    }
    if (line === "resume" && paused) { const go = paused; paused = null; await go(); }
    if (line === "release") await release();
  }
});
process.stdin.on("end", release);
