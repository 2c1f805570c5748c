// A fenced lock client in plain JavaScript (Node 18+: the built-in fetch, no npm package).
//
//   node examples/fenced_client.mjs SERVER LOCK STORAGE_URL DATA [TTL]
//
// Takes LOCK from a `fenced serve` at SERVER, keeps it renewed, and on a line "write" on
// stdin PUTs DATA to STORAGE_URL with the fencing token in the Fencing-Token header (a
// storage service behind fenced's HTTP guard refuses a token lower than one it has seen).
// A line "release" (or the end of stdin) releases the lock and exits. Everything it learns
// is printed one line each: "token N", "write STATUS BODY", "lost ...", "released true|false".

const [server, lock, storage, data, ttlText] = process.argv.slice(2);
const ttl = Number(ttlText ?? 10);
const headers = { "content-type": "application/json" };
if (process.env.FENCED_API_KEY) headers.authorization = `Bearer ${process.env.FENCED_API_KEY}`;
const lockPath = `${server}/v1/locks/${lock.split("/").map(encodeURIComponent).join("/")}`;

async function call(verb, body) {
  const r = await fetch(`${lockPath}/${verb}`, { method: "POST", headers, body: JSON.stringify(body) });
  return { status: r.status, body: await r.json() };
}

// A request id of our own makes a retried acquire idempotent: never two grants for one ask.
const requestId = `js-${process.pid}-${Date.now()}`;
let grant;
for (;;) {
  const r = await call("acquire", { ttl, timeout: 30, request_id: requestId, owner: `node pid ${process.pid}` });
  if (r.status === 200) { grant = r.body; break; }
  if (r.status !== 409) { console.log(`error ${r.status} ${r.body.message}`); process.exit(69); }
}
const token = grant.signed ?? grant.token;
console.log(`token ${grant.value}`);

// Renew at a third of the ttl. A renewal refused with 410 means the lease is gone: stop
// trusting it (the resource will refuse our token once a later holder has written).
let lost = false;
const renewer = setInterval(async () => {
  const r = await call("renew", { token, request_id: requestId });
  if (r.status === 410 && !lost) { lost = true; console.log(`lost ${r.body.message}`); }
}, (ttl * 1000) / 3);

async function write() {
  const r = await fetch(storage, { method: "PUT", headers: { "fencing-token": token }, body: data });
  console.log(`write ${r.status} ${(await r.text()).replace(/\s+/g, " ").slice(0, 200)}`);
}

async function release() {
  clearInterval(renewer);
  const r = await call("release", { token, request_id: requestId });
  console.log(`released ${r.body.released}`);
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
    if (line === "release") await release();
  }
});
process.stdin.on("end", release);
