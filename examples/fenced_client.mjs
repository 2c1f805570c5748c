// A fenced lock holder in JavaScript, on the fenced-client package (clients/js: Node 18+,
// its built-in fetch, no dependencies).
//
//   node examples/fenced_client.mjs SERVER LOCK STORAGE_URL DATA [TTL]
//
// Takes LOCK from a `fenced serve` at SERVER (the package renews it in the background) and
// reads commands, one a line, on stdin:
//   write         PUT DATA to STORAGE_URL with the token in the Fencing-Token header (a storage
//                 service behind fenced's HTTP guard refuses a token lower than one it has
//                 seen); skipped once the lease is lost: lease.token throws then.
//   write paused  take the token ("checked"), wait for a line "resume", then write with it:
//                 DDIA Figure 8-5's pause between check and write, which only the guard catches.
//   renewals      print how many renewals were confirmed, and how many attempts failed.
//   release       give the lock back (idempotent: say it twice, get the same answer).
// The end of stdin releases and exits. Everything it learns is printed one line each:
// "token N", "write STATUS BODY", "write skipped: ...", "lost REASON", "released true|false|unknown".

import { FencedClient, LeaseLostError } from "../clients/js/index.js";

const [server, lockName, storage, data, ttlText] = process.argv.slice(2);
const client = new FencedClient(server);

let lease;
try {
  lease = await client.lock(lockName, {
    ttl: Number(ttlText ?? 10),
    timeout: 30,
    owner: `node pid ${process.pid}`,
    onLost: (reason) => console.log(`lost ${reason}`),
  });
} catch (err) {
  console.log(`error ${err.status} ${err.message}`);
  process.exit(69);
}
console.log(`token ${lease.value}`);

async function put(token) {
  try {
    const r = await fetch(storage, { method: "PUT", headers: { "fencing-token": token }, body: data });
    console.log(`write ${r.status} ${(await r.text()).replace(/\s+/g, " ").slice(0, 200)}`);
  } catch (err) {
    console.log(`write failed ${err.name}: ${err.cause?.code ?? err.message}`);
  }
}

function tokenOrSay() {
  try {
    return lease.token;
  } catch (err) {
    if (!(err instanceof LeaseLostError)) throw err;
    console.log("write skipped: the lease is lost");
    return null;
  }
}

async function release() {
  const released = await lease.release();
  console.log(`released ${released ?? "unknown"}`);
}

let paused = null; // the token of "write paused", waiting for "resume"
// Commands run one after another, in the order they came (a write's line is printed before
// a later release's).
let queue = Promise.resolve();
const commands = {
  write: async () => {
    const token = tokenOrSay();
    if (token !== null) await put(token);
  },
  "write paused": async () => {
    paused = tokenOrSay();
    if (paused !== null) console.log("checked");
  },
  resume: async () => {
    if (paused === null) return;
    const token = paused;
    paused = null;
    await put(token);
  },
  renewals: async () => console.log(`renewals ${lease.renewals} failed ${lease.renewalFailures}`),
  release,
};

let buffered = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => {
  buffered += chunk;
  let i;
  while ((i = buffered.indexOf("\n")) >= 0) {
    const run = commands[buffered.slice(0, i).trim()];
    buffered = buffered.slice(i + 1);
    if (run) queue = queue.then(run);
  }
});
process.stdin.on("end", () => {
  queue = queue.then(release).then(() => process.exit(0));
});
