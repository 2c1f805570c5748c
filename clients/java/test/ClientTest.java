// The package's contract against a real `fenced serve` at $FENCED_TEST_URL, with the JDK
// alone (no test framework): tests/test_clients.py compiles it with javac and runs it with
// java in `make test`. Exit 0: every check passed; otherwise the first failure is printed.

import dev.fenced.client.FencedClient;
import dev.fenced.client.FencedException;
import dev.fenced.client.Lease;
import dev.fenced.client.LeaseLostException;
import dev.fenced.client.LockOptions;
import dev.fenced.client.LockTimeoutException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.TimeUnit;

public final class ClientTest {
    static final String URL = System.getenv("FENCED_TEST_URL");

    public static void main(String[] args) throws Exception {
        basic();
        lostOn410();
        busy();
        badInput();
        unreachable();
        System.out.println("ok");
    }

    static String unique(String what) {
        return what + "-" + ProcessHandle.current().pid() + "-" + System.nanoTime() % 1_000_000_000L;
    }

    static void check(boolean ok, String what) {
        if (!ok) throw new AssertionError(what);
    }

    static void expect(Class<? extends Throwable> type, Runnable r, String what) {
        try {
            r.run();
        } catch (Throwable t) {
            check(type.isInstance(t), what + ": " + t);
            return;
        }
        throw new AssertionError(what + ": nothing thrown");
    }

    /** A lease hands out its token, renews, and releases once. */
    static void basic() throws Exception {
        FencedClient client = new FencedClient(URL);
        String name = unique("java/basic");
        // (ttl 1.5 s: a renewal may be a second late on a loaded machine and still land in time)
        Lease lease = client.lock(name, new LockOptions().ttl(Duration.ofMillis(1500)));
        check(lease.state() == Lease.State.HELD, "held");
        check(lease.token().equals(name + ":1"), "token " + lease.token());
        check("current".equals(client.check(lease.token()).get("verdict")), "check current");
        long deadline = System.nanoTime() + 10_000_000_000L; // waited for with a bound
        while (lease.renewals() < 2) {
            check(System.nanoTime() - deadline < 0, "no renewals");
            Thread.sleep(20);
        }
        check(lease.state() == Lease.State.HELD, "still held");
        check(lease.release() == Lease.Released.RELEASED, "released");
        check(lease.release() == Lease.Released.RELEASED, "idempotent release");
        check(lease.state() == Lease.State.RELEASED, "state released");
        expect(LeaseLostException.class, lease::token, "token after release");
        check(Boolean.FALSE.equals(client.status(name).get("held")), "not held");
    }

    /** A renewal refused with 410 ends in lost: callback, state, future; never the token. */
    static void lostOn410() throws Exception {
        FencedClient client = new FencedClient(URL);
        String name = unique("java/lost");
        List<String> events = Collections.synchronizedList(new ArrayList<>());
        Lease lease = client.lock(name, new LockOptions().ttl(Duration.ofSeconds(1)).onLost(events::add));
        HttpResponse<String> r = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build().send(
                HttpRequest.newBuilder(URI.create(URL + "/v1/locks/" + name + "/-/force-release"))
                        .POST(HttpRequest.BodyPublishers.ofString("{}")).build(),
                HttpResponse.BodyHandlers.ofString());
        check(r.statusCode() == 200, "force release " + r.statusCode() + " " + r.body());
        String reason = lease.lost().get(10, TimeUnit.SECONDS);
        check(reason.startsWith("410 lease_lost"), "reason " + reason);
        check(events.equals(List.of(reason)), "callback " + events);
        check(lease.state() == Lease.State.LOST, "state lost");
        expect(LeaseLostException.class, lease::token, "token after lost");
        check(lease.release() == Lease.Released.ALREADY_ENDED, "release after lost");
        try (Lease next = client.lock(name, new LockOptions().ttl(Duration.ofSeconds(5)))) {
            check(next.value() == 2, "next token " + next.value());
        }
    }

    /** A held lock: a second lock() times out with LockTimeoutException. */
    static void busy() {
        FencedClient client = new FencedClient(URL);
        String name = unique("java/busy");
        Lease lease = client.lock(name, new LockOptions().ttl(Duration.ofSeconds(5)));
        try {
            expect(LockTimeoutException.class,
                    () -> client.lock(name, new LockOptions().timeout(Duration.ofMillis(200))), "busy");
        } finally {
            lease.release();
        }
    }

    /** Bad input is one clear FencedException, before any request. */
    static void badInput() {
        FencedClient client = new FencedClient(URL);
        expect(FencedException.class, () -> client.lock("no spaces"), "bad name");
        expect(FencedException.class, () -> client.lock("ok", new LockOptions().ttl(Duration.ZERO)), "ttl 0");
        expect(FencedException.class, () -> client.lock("ok", new LockOptions().requestId("-x")), "request id");
        expect(FencedException.class, () -> new FencedClient("localhost:7400"), "url");
    }

    /** An unreachable server: lock() retries, then one FencedException (status 0). */
    static void unreachable() throws Exception {
        // A port nothing listens on: held for the run by tests/server/test_server_clients.py
        // (FENCED_TEST_DEAD_PORT); else one that was free a moment ago, which another process
        // (another test worker's server) could take meanwhile.
        int port;
        String held = System.getenv("FENCED_TEST_DEAD_PORT");
        if (held != null) {
            port = Integer.parseInt(held);
        } else {
            try (java.net.ServerSocket probe = new java.net.ServerSocket(0)) {
                port = probe.getLocalPort();
            }
        }
        FencedClient client = new FencedClient("http://127.0.0.1:" + port);
        long started = System.nanoTime();
        try {
            client.lock("java/away", new LockOptions().retryFor(Duration.ofMillis(500)));
            throw new AssertionError("granted by nobody");
        } catch (FencedException e) {
            check(e.status() == 0, "status " + e.status());
        }
        check(System.nanoTime() - started >= 400_000_000L, "it did not retry");
    }
}
