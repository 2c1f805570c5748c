// Types of fenced-client (index.js).

export class FencedError extends Error {
  /** The HTTP status (0: no answer). */
  status: number;
  /** The server's error code: "timeout", "lease_lost", "forbidden", "invalid_request", ...;
   * "bad_answer": a 200 that is no JSON object or lacks what it must carry. */
  code: string;
  constructor(message: string, options?: { status?: number; code?: string });
}
/** Not granted within the timeout (409 `timeout`). */
export class LockTimeoutError extends FencedError {}
/** The lease is not (or no longer) confirmed valid: its token must not be used. */
export class LeaseLostError extends FencedError {}

export interface LockOptions {
  /** Lease seconds, 0.1-86400 (default 10). Renewed every ttl/3 in the background. */
  ttl?: number;
  /** Seconds to wait in line (FIFO); 0 (default): try once. */
  timeout?: number;
  /** Your id for this grant (1-64 of A-Z a-z 0-9 _ . : -); random if absent. A retry with
   * the same id returns the same grant. It is the grant's capability: keep it private. */
  requestId?: string;
  /** Who you are, for operators (status, dashboard). */
  owner?: string;
  /** Seconds before the confirmed end at which the token stops being handed out
   * (default min(1, ttl/10)). */
  safetyMargin?: number;
  /** Seconds to keep retrying connection errors and 503s for a single try (timeout 0;
   * default 10). With a timeout, they are retried until it, never past it. */
  retryFor?: number;
  /** Called once, with the reason, when the lease is lost. */
  onLost?: (reason: string) => void;
}

export interface LeaseEventMap {
  lost: CustomEvent<string>;
}

export class Lease extends EventTarget {
  /** Made by FencedClient.lock(). */
  private constructor();
  readonly name: string;
  readonly requestId: string;
  readonly ttl: number;
  /** The token's number (strictly greater than every earlier grant's). */
  readonly value: number;
  readonly margin: number;
  /** Renewals confirmed so far. */
  readonly renewals: number;
  /** Renewal attempts that failed (each retried while the lease's time lasts). */
  readonly renewalFailures: number;
  /** Why it was lost (null while held or after release). */
  readonly lostReason: string | null;
  /** Resolves with the reason once lost; never rejects (pending forever if released). */
  readonly lost: Promise<string>;
  /** "held" while confirmed valid by this process's clock (monotonic; on Linux also counting
   * through a suspend of the machine: clock.js). */
  readonly state: "held" | "lost" | "released";
  /** Milliseconds the lease is surely still valid for (0 once lost or released). */
  readonly remaining: number;
  /** The fencing token for every write; throws LeaseLostError unless the lease is confirmed
   * valid now. */
  readonly token: string;
  /** Idempotent; never rejects. true: released; false: it had already ended; null: the
   * server could not be reached (the lease ends at its ttl). */
  release(): Promise<boolean | null>;
  addEventListener<K extends keyof LeaseEventMap>(
    type: K,
    listener: (event: LeaseEventMap[K]) => void,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(
    type: string,
    listener: EventListenerOrEventListenerObject | null,
    options?: boolean | AddEventListenerOptions,
  ): void;
}

export interface CheckResult {
  token: string;
  lock: string;
  current: boolean;
  highest: string | null;
  stale: boolean;
  never_granted: boolean;
  verdict: "current" | "stale" | "not_current" | "never_granted";
}

export interface LockStatus {
  name: string;
  held: boolean;
  token: string | null;
  last_token: string | null;
  remaining: number | null;
  waiters: number | null;
  owner: string | null;
  holder: string | null;
  version: string;
}

export class FencedClient {
  /** The server's base URL, without a trailing slash. */
  readonly url: string;
  /** Seconds one request may take, connecting included (past a long poll's own wait). */
  readonly requestTimeout: number;
  /** url: e.g. "http://127.0.0.1:7400" (no user name or password, query or fragment: a
   * FencedError). apiKey: a bearer secret, visible ASCII with blanks inside only, at most 4096
   * characters, else a FencedError that never shows it (default $FENCED_API_KEY, unset or
   * empty: none; null: none). requestTimeout: default 10 (0.001-3600). */
  constructor(url: string, options?: { apiKey?: string | null; requestTimeout?: number });
  lock(name: string, options?: LockOptions): Promise<Lease>;
  withLock<T>(name: string, options: LockOptions, fn: (lease: Lease) => Promise<T> | T): Promise<T>;
  check(token: string): Promise<CheckResult>;
  status(name: string): Promise<LockStatus>;
}
