// fenced-client: locks with fencing tokens from a `fenced serve`, for Node >= 18 (its built-in
// fetch; no dependencies). See README.md and index.d.ts.
//
// The contract: `lease.token` is handed out only while the lease is confirmed valid by this
// process's own clock (monotonic, and counting through a suspend on Linux: clock.js): the last
// confirmed renewal, counted from when it was sent, plus the ttl (never more: whatever the
// server says), minus a safety margin. After that it throws LeaseLostError, never the stale
// token. Renewals run in the background; a failure that leaves the lease unconfirmed past its
// time (no answer, a 5xx, a 410, a timeout) ends in "lost" (an event, a state, a promise that
// resolves) and never in an unhandled rejection.

import { now } from "./clock.js";

const NAME = /^[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*(\/[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*)*$/;
const REQUEST_ID = /^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$/;
const MIN_TTL = 0.1;
const MAX_TTL = 86_400;
const MAX_TIMEOUT = 31_536_000;
// An API key travels as written in "Authorization: Bearer <key>": visible ASCII, blanks inside
// only (the server's rule for its keys file, and the Python client's); at most 4096 characters
// (proxies refuse longer header lines: nginx's default buffer is 8 KiB for a whole line).
const MAX_KEY = 4096;
// The most of an answer that is read (fenced serve's answers are a few hundred bytes): a
// runaway page (an error loop, a misrouted download) must not fill the memory.
const MAX_ANSWER = 1 << 20;
// An error code as fenced serve sends them ("timeout", "lease_lost"); anything else is no code.
const CODE = /^[a-z][a-z0-9_]{0,63}$/;
// Server text that repeats this many letters and digits of the key in a row, however spaced,
// escaped or cased (a proxy's page echoing the header: "&amp;", squeezed blanks), is withheld.
const KEY_RUN = 8;
const WITHHELD = "(withheld: it repeats part of the API key)";

/** Every error this package throws. `status` is the HTTP status (0: no answer), `code` the
 * server's error code (`timeout`, `lease_lost`, `forbidden`, ...). */
export class FencedError extends Error {
  constructor(message, { status = 0, code = "error" } = {}) {
    super(message);
    this.name = "FencedError";
    this.status = status;
    this.code = code;
  }
}

/** The lock was not granted within the timeout (409 `timeout`). */
export class LockTimeoutError extends FencedError {
  constructor(message, opts) {
    super(message, opts);
    this.name = "LockTimeoutError";
  }
}

/** The lease is not (or no longer) confirmed valid: its token must not be used. */
export class LeaseLostError extends FencedError {
  constructor(message, opts) {
    super(message, opts);
    this.name = "LeaseLostError";
  }
}

function randomId() {
  return `js-${globalThis.crypto.randomUUID().replaceAll("-", "")}`;
}

function checkNumber(what, value, min, max) {
  if (typeof value !== "number" || !Number.isFinite(value) || value < min || value > max) {
    throw new FencedError(`${what} must be a number from ${min} to ${max}, not ${value}`, {
      code: "invalid_request",
    });
  }
}

// Letters and digits only, lower-cased: what survives escaping, squeezing and re-casing.
const skeleton = (text) => text.toLowerCase().replace(/[^a-z0-9]+/g, "");

// The runs of KEY_RUN letters and digits of the key (all of them if it has fewer; none if it has
// fewer than 4: then only the key as written is replaced).
function keyRuns(key) {
  const k = skeleton(key);
  if (k.length < 4) return null;
  const n = Math.min(KEY_RUN, k.length);
  const runs = new Set();
  for (let i = 0; i + n <= k.length; i++) runs.add(k.slice(i, i + n));
  return { n, runs };
}

// The first part of a body, at most `cap` bytes, and whether there was more (not read).
async function readCapped(r, cap) {
  if (!r.body) return { text: "", over: false };
  if (Number(r.headers.get("content-length")) > cap) {
    await r.body.cancel().catch(() => {});
    return { text: "", over: true };
  }
  const reader = r.body.getReader();
  const chunks = [];
  let size = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    size += value.byteLength;
    if (size > cap) {
      await reader.cancel().catch(() => {});
      return { text: "", over: true };
    }
    chunks.push(value);
  }
  const all = new Uint8Array(size);
  let at = 0;
  for (const c of chunks) {
    all.set(c, at);
    at += c.byteLength;
  }
  return { text: new TextDecoder().decode(all), over: false };
}

function describe(r) {
  if (r.status === 0) return `no answer: ${r.body.message}`;
  return `${r.status} ${r.body.error ?? "error"}: ${r.body.message ?? ""}`.trim();
}

// Half to all of `ms`: clients that failed together do not retry in step.
const jitter = (ms) => ms * (0.5 + Math.random() / 2);

const sleep = (ms) => new Promise((ok) => setTimeout(ok, Math.max(0, ms)));

function invalid(message) {
  return new FencedError(message, { code: "invalid_request" });
}

// What is wrong with an API key, never the key itself (nor any of its characters).
function keyProblem(key) {
  if (key === "") return "is empty: give the key, or null for a server without keys";
  if (key.length > MAX_KEY) return `is ${key.length} characters long: an API key is at most ${MAX_KEY}`;
  for (let i = 0; i < key.length; i++) {
    const c = key.charCodeAt(i);
    const blank = c === 0x20 && (i === 0 || i === key.length - 1);
    if (c > 0x20 && c < 0x7f && !blank) continue;
    if (c === 0x20 && !blank) continue;
    const kind =
      c === 0x0a || c === 0x0d
        ? "a line break"
        : blank
          ? "a blank at its start or end"
          : c < 0x20 || c === 0x7f
            ? "a control character"
            : "a non-ASCII character";
    return `has ${kind} (character ${i + 1}): an API key is visible ASCII, blanks inside only (an Authorization header carries it as written)`;
  }
  return null;
}

// The key to send: apiKey as given (null: none), else $FENCED_API_KEY (empty: none, as unset).
function apiKeyOf(apiKey) {
  let where = "apiKey";
  if (apiKey === undefined) {
    apiKey = globalThis.process?.env?.FENCED_API_KEY || null;
    where = "$FENCED_API_KEY";
  }
  if (apiKey === null) return null;
  if (typeof apiKey !== "string") throw invalid(`apiKey must be a string (or null: no key), not ${typeof apiKey}`);
  const problem = keyProblem(apiKey);
  if (problem) throw invalid(`${where} ${problem}`);
  return apiKey;
}

// A URL as an error may show it: no user name or password, query or fragment; text that is no
// URL at all only by its first character (it may be a secret pasted in the wrong place).
function shown(url) {
  if (typeof url !== "string") return String(typeof url);
  try {
    const u = new URL(url);
    return `${u.protocol}//${u.host}${u.pathname}`;
  } catch {
    return url.includes("://") ? `${url.split("://", 1)[0]}://…` : `${url.slice(0, 1)}…`;
  }
}

// The server's base URL (no trailing slash), or one clear error.
function baseUrl(url) {
  let u = null;
  try {
    if (typeof url === "string") u = new URL(url);
  } catch {
    u = null;
  }
  if (!u || (u.protocol !== "http:" && u.protocol !== "https:") || !u.hostname) {
    throw invalid(`not an http(s) URL of a fenced server: ${shown(url)}`);
  }
  if (u.username || u.password) {
    // (fetch refuses such a URL, and one that names a secret ends up in logs and errors)
    throw invalid(
      `the URL ${shown(url)} has a user name or password in it: give the API key as apiKey or $FENCED_API_KEY`,
    );
  }
  if (u.search || u.hash || url.includes("?") || url.includes("#")) {
    throw invalid(`the URL ${shown(url)} has a query or fragment: give the server's base URL`);
  }
  return `${u.origin}${u.pathname}`.replace(/\/+$/, "");
}

export class FencedClient {
  /**
   * @param {string} url the server, e.g. "http://127.0.0.1:7400" (no user name or password)
   * @param {{apiKey?: string | null, requestTimeout?: number}} [options] apiKey: sent as a
   *   bearer token (default $FENCED_API_KEY; null: none); requestTimeout: seconds one request
   *   may take, connecting included, past a long poll's own wait (default 10)
   */
  constructor(url, { apiKey, requestTimeout = 10 } = {}) {
    this.url = baseUrl(url);
    checkNumber("requestTimeout", requestTimeout, 0.001, 3600);
    this.requestTimeout = requestTimeout;
    this._headers = { "content-type": "application/json", accept: "application/json" };
    const key = apiKeyOf(apiKey);
    // (kept out of every message and property listing: a secret)
    if (key !== null) {
      Object.defineProperty(this, "_key", { value: key });
      Object.defineProperty(this, "_auth", { value: `Bearer ${key}` });
      Object.defineProperty(this, "_keyRuns", { value: keyRuns(key) });
    }
  }

  // Text from elsewhere (an answer, a transport error) without the key, should it echo it: the
  // key as written is "***"; text that still repeats a run of its letters and digits (escaped,
  // spaced, cut) is withheld whole. Applied to the whole text, before any cutting or squeezing.
  _scrub(text) {
    let s = String(text);
    if (!this._key) return s;
    s = s.replaceAll(this._key, "***");
    const k = this._keyRuns;
    if (k) {
      const bare = skeleton(s);
      for (let i = 0; i + k.n <= bare.length; i++) {
        if (k.runs.has(bare.slice(i, i + k.n))) return WITHHELD;
      }
    }
    return s;
  }

  // One request, bounded by timeoutMs from the start (connecting included); never throws: a
  // transport failure or timeout is status 0 with its reason. `bad`: the answer is no JSON
  // object (a proxy's page, another server, a redirect). Every text from the server is
  // scrubbed (_scrub) and an error code that is none is dropped, so describe() and `code`
  // show nothing of the key.
  async _call(method, path, body, timeoutMs) {
    const headers = { ...this._headers };
    if (this._auth) headers.authorization = this._auth;
    try {
      const r = await fetch(`${this.url}${path}`, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        // Never followed: the request id and the token (a capability) would go to another
        // origin, and its answer would be taken for this server's grant.
        redirect: "manual",
        signal: AbortSignal.timeout(Math.max(1, Math.ceil(timeoutMs))),
      });
      if (r.status >= 300 && r.status < 400) {
        await r.body?.cancel().catch(() => {});
        const to = r.headers.get("location");
        let where = "";
        if (to) {
          let abs = to;
          try {
            abs = new URL(to, `${this.url}/`).href;
          } catch {
            // (shown as given)
          }
          where = `to ${this._scrub(shown(abs))}`;
        }
        return { status: r.status, body: { message: `redirected ${where}: not followed (give the server's own URL)` }, bad: true };
      }
      const { text, over } = await readCapped(r, MAX_ANSWER);
      if (over) {
        return { status: r.status, body: { message: `not JSON: an answer over ${MAX_ANSWER} bytes (not read)` }, bad: true };
      }
      let json;
      try {
        json = JSON.parse(text);
      } catch {
        json = undefined;
      }
      if (json === null || typeof json !== "object" || Array.isArray(json)) {
        const snippet = this._scrub(text).replace(/\s+/g, " ").trim().slice(0, 200);
        return { status: r.status, body: { message: `not JSON: ${snippet || "(empty)"}` }, bad: true };
      }
      if (json.message !== undefined) {
        if (typeof json.message === "string") json.message = this._scrub(json.message);
        else delete json.message;
      }
      if (json.error !== undefined && !(typeof json.error === "string" && CODE.test(json.error) && this._scrub(json.error) === json.error)) {
        delete json.error;
      }
      return { status: r.status, body: json };
    } catch (err) {
      const why = err?.name === "TimeoutError" ? "timed out" : err?.cause?.code ?? err?.message;
      return { status: 0, body: { message: this._scrub(why) } };
    }
  }

  // The bound of one call of lock(): the long poll's own wait and requestTimeout, but no more
  // than the time lock() has left + 1 s (a last try gets a fair chance to be answered).
  _lockBound(left, until) {
    const own = Math.min(left, 60) + this.requestTimeout;
    return Math.min(own, Math.max(0, until - now()) / 1000 + 1) * 1000;
  }

  // An answer that must be a 200 with a JSON object.
  _ok(what, r) {
    if (r.status === 200 && r.bad) {
      throw new FencedError(`${what} failed: the answer is ${r.body.message}`, { status: 200, code: "bad_answer" });
    }
    if (r.status !== 200) {
      throw new FencedError(`${what} failed: ${describe(r)}`, { status: r.status, code: r.body.error ?? (r.status ? "error" : "unavailable") });
    }
    return r.body;
  }

  _lockPath(name, action) {
    if (typeof name !== "string" || !NAME.test(name)) {
      throw new FencedError(`not a lock name: ${JSON.stringify(name)}`, {
        code: "invalid_request",
      });
    }
    return `/v1/locks/${name}${action ? `/-/${action}` : ""}`;
  }

  /**
   * Take the lock `name`, waiting up to `timeout` seconds in line (FIFO), and keep it renewed
   * in the background until `release()`. A connection error or a 503 is retried with the same
   * request id (idempotent: never a second grant) until `timeout` has passed — or, for a
   * single try (`timeout` 0), for `retryFor` seconds (default 10).
   * @returns {Promise<Lease>}
   */
  async lock(name, options = {}) {
    let {
      ttl = 10,
      timeout = 0,
      requestId = randomId(),
      owner,
      safetyMargin,
      retryFor = 10,
      onLost,
    } = options;
    const path = this._lockPath(name, "acquire");
    checkNumber("ttl", ttl, MIN_TTL, MAX_TTL);
    checkNumber("timeout", timeout, 0, MAX_TIMEOUT);
    checkNumber("retryFor", retryFor, 0, MAX_TIMEOUT);
    if (typeof requestId !== "string" || !REQUEST_ID.test(requestId)) {
      throw new FencedError(`not a request id (1-64 of A-Z a-z 0-9 _ . : -): ${requestId}`, {
        code: "invalid_request",
      });
    }
    const margin = safetyMargin ?? Math.min(1, ttl / 10);
    checkNumber("safetyMargin", margin, 0, ttl / 2);
    const start = now();
    const waitUntil = start + timeout * 1000;
    const retryUntil = start + (timeout > 0 ? timeout : retryFor) * 1000;
    let backoff = 100;
    let busy = 50; // the pause after a 409 that came at once (a front that cannot long-poll)
    let sends = 0; // (sends of this request id)
    for (;;) {
      const left = Math.max(0, (waitUntil - now()) / 1000);
      const body = { ttl, timeout: left, request_id: requestId };
      if (owner !== undefined) body.owner = owner;
      // The server answers a long poll within its max wait (60 s), requestTimeout is for
      // the rest (connecting, the source), and lock() ends by its time left + 1 s.
      const sent = now();
      sends += 1;
      const r = await this._call("POST", path, body, this._lockBound(left, retryUntil));
      const received = now();
      if (r.status === 200) {
        const expiresIn = r.body.expires_in;
        const token = r.body.signed ?? r.body.token;
        if (typeof expiresIn !== "number" || !Number.isFinite(expiresIn) || expiresIn < 0 || typeof token !== "string") {
          const what = r.bad ? `is ${r.body.message}` : "has no expires_in or token";
          throw new FencedError(`could not take ${name}: the answer ${what}`, {
            status: 200,
            code: "bad_answer",
          });
        }
        // Counted from when the request was sent, never from the answer's arrival: the grant
        // was made after the send, and an answer can wait in a socket for any time (a paused
        // process, a slow network) while the lease runs out at the source.
        // Never longer than the ttl asked for, whatever the answer says (a broken or foreign
        // gateway's "expires_in": 1000 would keep a dead lease "held" for 16 minutes).
        let validUntil = sent + (Math.min(expiresIn, ttl) - margin) * 1000;
        let grant = r.body;
        if (received - sent > (ttl * 1000) / 3) {
          // Waited in line, or paused: confirm the grant (a renewal, counted from its own
          // send) before handing out its token; one that cannot be confirmed is not held.
          const again = now();
          const rr = await this._call(
            "POST",
            this._lockPath(name, "renew"),
            { token, request_id: requestId, ttl },
            Math.min(ttl, this.requestTimeout) * 1000,
          );
          if (rr.status !== 200 || typeof rr.body.expires_in !== "number" || !(rr.body.expires_in >= 0)) {
            await this._call("POST", this._lockPath(name, "release"), { token, request_id: requestId }, 2000);
            throw new LeaseLostError(`took ${name}, but could not confirm the grant: ${describe(rr)}`, {
              status: rr.status,
              code: "lease_lost",
            });
          }
          validUntil = again + (Math.min(rr.body.expires_in, ttl) - margin) * 1000;
          grant = { ...r.body, ...rr.body };
        }
        return new Lease(this, name, grant, { ttl, requestId, margin, validUntil, onLost });
      }
      if (r.status === 410 && sends > 1 && received < retryUntil) {
        // A retry of ours answered "this request id's grant has ended": it was granted and
        // ran out before an answer got through. A new attempt, under a new id (a request id
        // names one attempt: the gateway refuses a late duplicate of an ended grant).
        requestId = randomId();
        sends = 0;
        continue;
      }
      const transient = r.status === 0 || r.status === 503;
      if (r.status === 409 && r.body.error === "timeout" && received < waitUntil) {
        // Asked again at once after a long poll; after one that came at once, after a pause
        // (doubling, jittered, within the time left): no spinning on a front that answers 409.
        if (received - sent >= 1000) busy = 50;
        else {
          await sleep(Math.min(jitter(busy), waitUntil - received));
          busy = Math.min(busy * 2, 1000);
        }
        continue;
      }
      if (transient && received < retryUntil) {
        await sleep(Math.min(jitter(backoff), retryUntil - received));
        backoff = Math.min(backoff * 2, 2000);
        continue;
      }
      const Err =
        r.status === 409 && r.body.error === "timeout"
          ? LockTimeoutError
          : r.status === 410
            ? LeaseLostError
            : FencedError;
      throw new Err(`could not take ${name}: ${describe(r)}`, {
        status: r.status,
        code: r.body.error ?? (r.status ? "error" : "unavailable"),
      });
    }
  }

  /** Take the lock, run `fn(lease)`, release (also when `fn` throws). */
  async withLock(name, options, fn) {
    const lease = await this.lock(name, options);
    try {
      return await fn(lease);
    } finally {
      await lease.release();
    }
  }

  /** `POST /v1/check`: is this token the current grant of its lock? */
  async check(token) {
    return this._ok("check", await this._call("POST", "/v1/check", { token }, this.requestTimeout * 1000));
  }

  /** `GET /v1/locks/{name}`: who holds it, and the highest token granted. */
  async status(name) {
    const path = this._lockPath(name);
    return this._ok("status", await this._call("GET", path, undefined, this.requestTimeout * 1000));
  }
}

/** A granted lock. States: "held" -> "lost" | "released". Events: "lost" (detail: reason). */
export class Lease extends EventTarget {
  #client;
  #body;
  #validUntil;
  #timer = null;
  #watchdog = null;
  #state = "held";
  #releasing = null;
  #lastFailure = null;
  #resolveLost;

  constructor(client, name, grant, { ttl, requestId, margin, validUntil, onLost }) {
    super();
    this.#client = client;
    this.name = name;
    this.requestId = requestId;
    // The ttl granted, if the server says (it may grant less than asked), never more than asked.
    const granted = grant.ttl;
    this.ttl = typeof granted === "number" && granted >= MIN_TTL && granted < ttl ? granted : ttl;
    this.value = grant.value;
    this.margin = margin;
    this.renewals = 0;
    this.renewalFailures = 0;
    this.lostReason = null;
    this.#body = { token: grant.signed ?? grant.token, request_id: requestId, ttl: this.ttl };
    this.#validUntil = validUntil;
    /** Resolves (never rejects) with the reason once the lease is lost; never if released. */
    this.lost = new Promise((ok) => {
      this.#resolveLost = ok;
    });
    if (onLost) {
      this.addEventListener("lost", (e) => {
        try {
          onLost(e.detail);
        } catch {
          // A callback that throws would be an uncaught exception in Node's EventTarget.
        }
      });
    }
    this.#armWatchdog();
    this.#schedule((this.ttl * 1000) / 3);
  }

  /** "held", "lost" or "released". A held lease whose time has run out is "lost". */
  get state() {
    if (this.#state === "held" && now() >= this.#validUntil) {
      this.#lose(this.#expiredReason());
    }
    return this.#state;
  }

  /** Milliseconds the lease is surely still valid for (0 once lost or released). */
  get remaining() {
    return this.state === "held" ? Math.max(0, this.#validUntil - now()) : 0;
  }

  /** The fencing token to send with every write; throws LeaseLostError unless confirmed
   * valid now. (A pause can still fall between this and the write: the resource's guard,
   * comparing tokens, refuses that write.) */
  get token() {
    const state = this.state;
    if (state !== "held") {
      throw new LeaseLostError(`the lease on ${this.name} is ${state}: ${this.lostReason ?? state}`, {
        code: state === "released" ? "released" : "lease_lost",
      });
    }
    return this.#body.token;
  }

  /** Give the lock back. Idempotent: every call gets the first one's answer — true (released),
   * false (it had already ended) or null (the server could not be reached: it ends at its
   * ttl). Never rejects. */
  release() {
    if (this.#releasing) return this.#releasing;
    const wasHeld = this.state === "held";
    this.#stop();
    this.#state = wasHeld ? "released" : this.#state;
    // Retried only while the lease's confirmed time lasts: after it the source ends the
    // lease by itself, and a lost lease gets one attempt.
    const until = Math.min(this.#validUntil, now() + 10_000);
    this.#releasing = (async () => {
      const path = this.#client._lockPath(this.name, "release");
      for (;;) {
        const wait = Math.min(Math.max(until - now(), 2000), this.#client.requestTimeout * 1000);
        const r = await this.#client._call("POST", path, this.#body, wait);
        if (r.status === 200) return r.body.released === true;
        if (r.status === 410) return false;
        // Sent again only if it surely did not arrive (refused connection) or was refused
        // unprocessed (503); a release by request id is idempotent in any case.
        const again = r.status === 503 || (r.status === 0 && /ECONNREFUSED/.test(r.body.message));
        if (!again || now() + 200 > until) return null;
        await sleep(200);
      }
    })();
    return this.#releasing;
  }

  #expiredReason() {
    const last = this.#lastFailure ? ` (last renewal: ${this.#lastFailure})` : "";
    return `not confirmed within its ttl${last}`;
  }

  #stop() {
    clearTimeout(this.#timer);
    clearTimeout(this.#watchdog);
  }

  #lose(reason) {
    if (this.#state !== "held") return;
    this.#state = "lost";
    this.lostReason = reason;
    this.#stop();
    // A listener that throws must not stop us (nor become an unhandled error here).
    try {
      this.dispatchEvent(new CustomEvent("lost", { detail: reason }));
    } catch {
      /* ignored: the state is already "lost" */
    }
    this.#resolveLost(reason);
  }

  // Fires at the end of the confirmed time unless a renewal moved it on.
  #armWatchdog() {
    clearTimeout(this.#watchdog);
    const left = this.#validUntil - now();
    this.#watchdog = setTimeout(() => void this.state, Math.max(0, left) + 1);
  }

  #schedule(ms) {
    clearTimeout(this.#timer);
    this.#timer = setTimeout(() => {
      this.#renew().catch((err) => this.#lose(`renewal failed: ${err?.message ?? err}`));
    }, ms);
    // (Not unref'd: a held lease keeps the process alive, as an open socket does, until it is
    // released or lost; `await lease.lost` must not find an empty event loop.)
  }

  async #renew() {
    if (this.state !== "held") return;
    const sent = now();
    const path = this.#client._lockPath(this.name, "renew");
    // An answer that comes after the lease's confirmed end could not confirm it anyway. Each
    // attempt gets half the time left (at least 200 ms, if there is that much; at most
    // requestTimeout): one hung on a dead connection (a gateway that hangs, a NAT's idle drop)
    // is cut off with time to ask again, on a fresh connection, while the lease lasts.
    const left = this.#validUntil - sent;
    const bound = Math.min(this.#client.requestTimeout * 1000, Math.max(left / 2, Math.min(left, 200)));
    const r = await this.#client._call("POST", path, this.#body, bound);
    if (this.#state !== "held") return;
    const expiresIn = r.body.expires_in;
    if (r.status === 200 && typeof expiresIn === "number" && expiresIn >= 0) {
      // Counted from when it was sent (the safe side), and never longer than the ttl.
      const until = sent + (Math.min(expiresIn, this.ttl) - this.margin) * 1000;
      this.#validUntil = Math.max(this.#validUntil, until);
      this.renewals += 1;
      this.#lastFailure = null;
      this.#armWatchdog();
      this.#schedule((this.ttl * 1000) / 3);
      return;
    }
    this.renewalFailures += 1;
    // A request cut off at the lease's end says nothing new: keep the failure before it.
    const cutOff = r.status === 0 && r.body.message === "timed out" && now() >= this.#validUntil;
    if (!(cutOff && this.#lastFailure)) this.#lastFailure = describe(r);
    // No answer, a timeout, 5xx, 408, 429: the lease may still be good; ask again while its
    // confirmed time lasts. Anything else (410 lease_lost, 403, 400) is final.
    const transient = r.status === 0 || r.status >= 500 || r.status === 408 || r.status === 429;
    const rest = this.#validUntil - now();
    if (!transient) this.#lose(this.#lastFailure);
    else if (rest <= 0) this.#lose(this.#expiredReason());
    else this.#schedule(Math.min(Math.max(50, (this.ttl * 1000) / 20), 1000, rest));
  }
}
