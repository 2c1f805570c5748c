// The package's contract against a real `fenced serve` at $FENCED_TEST_URL, with the JDK
// alone (no test framework): tests/test_clients.py compiles it with javac and runs it with
// java in `make test`. Exit 0: every check passed; otherwise the first failure is printed.

import dev.fenced.client.FencedClient;
import dev.fenced.client.FencedException;
import dev.fenced.client.Lease;
import dev.fenced.client.LeaseLostException;
import dev.fenced.client.LockOptions;
import dev.fenced.client.LockTimeoutException;
import com.sun.net.httpserver.HttpServer;
import java.io.IOException;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.DoubleSupplier;
import java.util.function.Function;
import java.util.function.Supplier;

public final class ClientTest {
    static final String URL = System.getenv("FENCED_TEST_URL");

    public static void main(String[] args) throws Exception {
        if (args.length > 0) { // only these (by name): one test, against a planted bug say
            for (String name : args) ClientTest.class.getDeclaredMethod(name).invoke(null);
            System.out.println("ok");
            return;
        }
        basic();
        lostOn410();
        busy();
        badInput();
        unreachable();
        badKeys();
        badUrls();
        keyed();
        notJson();
        hung();
        renewalHung();
        // (session 11: an outside attack's findings)
        keyNeverShown();
        expiresInCapped();
        renewalHungDefaultTimeout();
        redirectNotFollowed();
        hugeAnswer();
        busy409();
        concurrentRelease();
        noThreadLeft();
        lateDuplicate();
        suspended(); // (last: it moves this JVM's lease clock an hour on)
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

    // -- what a client must refuse or survive: bad keys and URLs, odd answers, hung servers ----

    /** A bad API key is one clear FencedException before any request; the key never shown. */
    static void badKeys() {
        Map<String, String> bad = new LinkedHashMap<>();
        bad.put("non-ASCII", "fk_sécret_0123456789abcdef");
        bad.put("not Latin-1", "fk_ключ_密钥_0123456789abcdef");
        bad.put("header injection", "fk_secret_0123\r\nX-Evil: injected");
        bad.put("a newline", "fk_secret_0123\nmore_secret_456");
        bad.put("a control character", "fk_secret_0123\tmore_secret_456");
        bad.put("blanks around it", " fk_secret_0123456789abcdef ");
        bad.put("empty", "");
        bad.put("too long", "fk_" + "x".repeat(4094));
        for (Map.Entry<String, String> e : bad.entrySet()) {
            String what = e.getKey(), key = e.getValue();
            try {
                new FencedClient("http://127.0.0.1:9", key);
                throw new AssertionError(what + ": accepted");
            } catch (FencedException x) {
                String m = x.getMessage();
                check("invalid_request".equals(x.code()) && m.startsWith("apiKey "), what + ": " + m);
                check(!m.contains("\n") && !m.contains("\r"), what + ": two lines");
                for (String part : key.split("[\r\n\t ]+")) {
                    check(part.length() <= 3 || !m.contains(part), what + ": the key shown: " + m);
                }
            }
        }
        // What the rule lets through: 4096 visible characters, blanks inside; null: no key.
        new FencedClient("http://127.0.0.1:9", "fk_" + "x".repeat(4093));
        new FencedClient("http://127.0.0.1:9", "fk two words !#$%&()*+,-./:;<=>?@[]^_`{|}~");
        new FencedClient("http://127.0.0.1:9", null);
        expect(FencedException.class,
                () -> new FencedClient("http://127.0.0.1:9", null, Duration.ZERO), "requestTimeout 0");
    }

    /** A URL with credentials, a query or no URL at all: one clear error never showing them. */
    static void badUrls() {
        String[][] cases = {
            {"http://tenant:hunter2-pass@127.0.0.1:7400", "hunter2"},
            {"http://fk_secret_in_user@127.0.0.1:7400/", "fk_secret"},
            {"https://127.0.0.1:7400/?key=fk_secret_query", "fk_secret"},
            {"http://127.0.0.1:7400/#fk_secret_fragment", "fk_secret"},
            {"fk_secret_pasted_here", "k_secret"},
            {"ftp://127.0.0.1/", "\u0000"},
        };
        for (String[] c : cases) {
            try {
                new FencedClient(c[0], (String) null);
                throw new AssertionError(c[0] + ": accepted");
            } catch (FencedException e) {
                check("invalid_request".equals(e.code()) && !e.getMessage().contains(c[1]), c[0] + ": " + e.getMessage());
            }
        }
        String url = new FencedClient("http://127.0.0.1:7400/base/", (String) null).url();
        check(url.equals("http://127.0.0.1:7400/base"), "base " + url);
    }

    /** A keyed server: the rightful key takes and releases, a wrong one is 401 (not shown). */
    static void keyed() {
        String keyedUrl = System.getenv("FENCED_TEST_KEYED_URL");
        if (keyedUrl == null) return;
        FencedClient client = new FencedClient(keyedUrl, System.getenv("FENCED_TEST_KEY"));
        Lease lease = client.lock(unique("java/keyed"), new LockOptions().ttl(Duration.ofSeconds(5)));
        check(lease.value() == 1, "keyed token " + lease.value());
        check(lease.release() == Lease.Released.RELEASED, "keyed release");
        String wrong = "fk_wrong_but_well_formed_0123";
        try {
            new FencedClient(keyedUrl, wrong).lock("java/keyed-wrong");
            throw new AssertionError("a wrong key was granted");
        } catch (FencedException e) {
            check(e.status() == 401 && !e.getMessage().contains(wrong), "wrong key: " + e.getMessage());
        }
    }

    /** A real HTTP server (the JDK's) that answers every request with {@code status, body}, or
     * with the request's Authorization header (an echoing proxy) if body is null. */
    static HttpServer serving(int status, String body) throws IOException {
        HttpServer server = HttpServer.create(new InetSocketAddress(InetAddress.getLoopbackAddress(), 0), 0);
        server.createContext("/", ex -> {
            ex.getRequestBody().readAllBytes();
            String text = body != null ? body : "bad request: " + ex.getRequestHeaders().getFirst("authorization");
            byte[] bytes = text.getBytes(java.nio.charset.StandardCharsets.UTF_8);
            ex.getResponseHeaders().set("content-type", "text/html");
            ex.sendResponseHeaders(status, bytes.length == 0 ? -1 : bytes.length);
            try (OutputStream out = ex.getResponseBody()) {
                out.write(bytes);
            }
        });
        server.start();
        return server;
    }

    /** An answer that is no JSON object: one clear FencedException, never taken for a result. */
    static void notJson() throws Exception {
        String key = "fk_echoed_secret_0123456789";
        Object[][] cases = {
            {200, "<html><body>Welcome to nginx!</body></html>"},
            {200, "[1, 2]"},
            {200, "null"},
            {200, ""},
            {200, "[".repeat(100_000)}, // (nested past any stack)
            {502, "<html><head><title>502 Bad Gateway</title></head></html>"},
        };
        for (Object[] c : cases) {
            int status = (Integer) c[0];
            HttpServer server = serving(status, (String) c[1]);
            try {
                FencedClient client = new FencedClient("http://127.0.0.1:" + server.getAddress().getPort(), key);
                List<Runnable> calls = List.of(
                        () -> client.status("x"),
                        () -> client.check("x:1"),
                        () -> client.lock("x", new LockOptions().retryFor(Duration.ZERO)));
                for (Runnable call : calls) {
                    try {
                        call.run();
                        throw new AssertionError(status + ": taken for a result");
                    } catch (FencedException e) {
                        String m = e.getMessage();
                        check(!(e instanceof LeaseLostException) && e.status() == status, status + ": " + e);
                        check(status != 200 || "bad_answer".equals(e.code()), status + ": " + e.code() + " " + m);
                        check(m.contains("not JSON") && !m.contains("\n"), status + ": " + m);
                    }
                }
            } finally {
                server.stop(0);
            }
        }
        HttpServer echo = serving(400, null);
        try {
            new FencedClient("http://127.0.0.1:" + echo.getAddress().getPort(), key).status("x");
            throw new AssertionError("echo: a 400 taken for a result");
        } catch (FencedException e) {
            check(!e.getMessage().contains(key) && e.getMessage().contains("Bearer ***"), "echo: " + e.getMessage());
        } finally {
            echo.stop(0);
        }
    }

    /** A server that accepts and never answers, or sends a head and never the whole body. */
    static ServerSocket hanging(boolean head) throws IOException {
        ServerSocket server = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
        Thread t = new Thread(() -> {
            List<Socket> held = new ArrayList<>();
            try {
                for (;;) {
                    Socket s = server.accept();
                    held.add(s);
                    if (head) {
                        s.getInputStream().read(new byte[4096]);
                        s.getOutputStream().write(("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                + "content-length: 90\r\n\r\n{\"held\"").getBytes(java.nio.charset.StandardCharsets.US_ASCII));
                        s.getOutputStream().flush();
                    }
                }
            } catch (IOException e) {
                for (Socket s : held) {
                    try {
                        s.close();
                    } catch (IOException ignored) {
                        // closing: nothing to do
                    }
                }
            }
        });
        t.setDaemon(true);
        t.start();
        return server;
    }

    /** Milliseconds {@code call} takes to throw a FencedException with status 0. */
    static long rejection(String what, Runnable call) {
        long started = System.nanoTime();
        try {
            call.run();
        } catch (FencedException e) {
            check(e.status() == 0 && e.getMessage().contains("timed out"), what + ": " + e.getMessage());
            return (System.nanoTime() - started) / 1_000_000;
        }
        throw new AssertionError(what + ": it did not fail");
    }

    /** A hung server: requestTimeout bounds each call, connecting included; lock() its timeout. */
    static void hung() throws Exception {
        ServerSocket silent = hanging(false), halfway = hanging(true);
        List<String> urls = new ArrayList<>(List.of(
                "http://127.0.0.1:" + silent.getLocalPort(), "http://127.0.0.1:" + halfway.getLocalPort()));
        // (never accepted: a full listen queue, held by tests/server/test_server_clients.py)
        String unaccepted = System.getenv("FENCED_TEST_UNACCEPTED_PORT");
        if (unaccepted != null) urls.add("http://127.0.0.1:" + unaccepted);
        try {
            List<CompletableFuture<Void>> runs = new ArrayList<>();
            for (String url : urls) {
                Supplier<Void> each = () -> {
                    FencedClient quick = new FencedClient(url, null, Duration.ofMillis(500));
                    List<Runnable> calls = List.of(
                            () -> quick.status("x"),
                            () -> quick.check("x:1"),
                            () -> quick.lock("x", new LockOptions().retryFor(Duration.ZERO)));
                    for (Runnable call : calls) {
                        long took = rejection(url, call);
                        check(took >= 450 && took < 4000, url + ": " + took + " ms for a 0.5 s requestTimeout");
                    }
                    // lock()'s own timeout bounds it (+ 1 s for a last try), whatever requestTimeout says
                    FencedClient plain = new FencedClient(url, (String) null);
                    long took = rejection(url, () -> plain.lock("x", new LockOptions().timeout(Duration.ofMillis(500))));
                    check(took >= 450 && took < 4500, url + ": " + took + " ms for a 0.5 s timeout");
                    return null;
                };
                runs.add(CompletableFuture.supplyAsync(each)); // (side by side: 3 s, not 9)
            }
            for (CompletableFuture<Void> run : runs) {
                try {
                    run.join();
                } catch (java.util.concurrent.CompletionException e) {
                    if (e.getCause() instanceof Error err) throw err;
                    throw e;
                }
            }
        } finally {
            silent.close();
            halfway.close();
        }
    }

    /** A renewal hung on its connection is asked again within requestTimeout: the lease is kept
     * (it waited out the lease's whole confirmed time, and the lease was lost). */
    static void renewalHung() throws Exception {
        // A gateway that grants (ttl 3 s), never answers the first renewal, and answers the next.
        AtomicInteger renewals = new AtomicInteger();
        CountDownLatch done = new CountDownLatch(1);
        HttpServer server = HttpServer.create(new InetSocketAddress(InetAddress.getLoopbackAddress(), 0), 0);
        server.setExecutor(Executors.newCachedThreadPool(r -> {
            Thread t = new Thread(r);
            t.setDaemon(true);
            return t;
        }));
        server.createContext("/", ex -> {
            ex.getRequestBody().readAllBytes();
            String path = ex.getRequestURI().getPath();
            String body;
            if (path.endsWith("/-/acquire")) {
                body = "{\"lock\": \"r\", \"token\": \"r:1\", \"value\": 1, \"ttl\": 3, \"request_id\": \"q\", \"expires_in\": 3}";
            } else if (path.endsWith("/-/renew")) {
                if (renewals.incrementAndGet() == 1) {
                    try {
                        done.await(); // (hangs: the answer never comes)
                    } catch (InterruptedException e) {
                        Thread.currentThread().interrupt();
                    }
                    ex.close();
                    return;
                }
                body = "{\"ttl\": 3, \"expires_in\": 3}";
            } else {
                body = "{\"released\": true}";
            }
            byte[] bytes = body.getBytes(java.nio.charset.StandardCharsets.UTF_8);
            ex.getResponseHeaders().set("content-type", "application/json");
            ex.sendResponseHeaders(200, bytes.length);
            try (OutputStream out = ex.getResponseBody()) {
                out.write(bytes);
            }
        });
        server.start();
        try {
            FencedClient client = new FencedClient(
                    "http://127.0.0.1:" + server.getAddress().getPort(), null, Duration.ofMillis(300));
            Lease lease = client.lock("r", new LockOptions().ttl(Duration.ofSeconds(3)));
            long deadline = System.nanoTime() + 10_000_000_000L;
            while (lease.renewals() < 1 && lease.state() == Lease.State.HELD) {
                check(System.nanoTime() - deadline < 0, "no renewal");
                Thread.sleep(20);
            }
            check(lease.state() == Lease.State.HELD, "lost: " + lease.lostReason());
            check(lease.renewals() == 1, "renewals " + lease.renewals());
            check(renewals.get() >= 2 && lease.renewalFailures() >= 1, renewals.get() + " renewals sent");
            check(lease.release() == Lease.Released.RELEASED, "release");
        } finally {
            done.countDown();
            server.stop(0);
        }
    }

    // -- an outside attack's findings (session 11) ---------------------------------------------

    /** A fake gateway (the JDK's server, daemon threads): {@code reply} gives {status, body} or
     * {status, body, location}, or null to hang (never answer). */
    static HttpServer fake(Function<com.sun.net.httpserver.HttpExchange, Object[]> reply) throws IOException {
        HttpServer server = HttpServer.create(new InetSocketAddress(InetAddress.getLoopbackAddress(), 0), 0);
        server.setExecutor(Executors.newCachedThreadPool(r -> {
            Thread t = new Thread(r);
            t.setDaemon(true);
            return t;
        }));
        server.createContext("/", ex -> {
            ex.getRequestBody().readAllBytes();
            Object[] r = reply.apply(ex);
            if (r == null) return; // (hangs: the answer never comes)
            byte[] bytes = ((String) r[1]).getBytes(java.nio.charset.StandardCharsets.UTF_8);
            ex.getResponseHeaders().set("content-type", "application/json");
            if (r.length > 2) ex.getResponseHeaders().set("location", (String) r[2]);
            ex.sendResponseHeaders((Integer) r[0], bytes.length == 0 ? -1 : bytes.length);
            try (OutputStream out = ex.getResponseBody()) {
                out.write(bytes);
            }
        });
        server.start();
        return server;
    }

    static String at(HttpServer s) {
        return "http://127.0.0.1:" + s.getAddress().getPort();
    }

    static String grant(double ttl, double expiresIn) {
        return "{\"lock\": \"r\", \"token\": \"r:1\", \"value\": 1, \"request_id\": \"q\", \"ttl\": " + ttl
                + ", \"expires_in\": " + expiresIn + "}";
    }

    /** Server text repeating the API key never shows it: code, message, a page cut or squeezed
     * or escaped (was: error as sent; cut before scrubbing; squeezed before; "&amp;"). */
    static void keyNeverShown() throws Exception {
        String key = "fk_S3cr3t&K3y  abcdefghijklmnop";
        List<String> pieces = List.of("S3cr3t", "K3y", "abcdefghijklmnop");
        Map<String, Function<String, Object[]>> pages = new LinkedHashMap<>();
        pages.put("a JSON error's code", a -> new Object[] {502, "{\"error\": \"rejected " + a + "\", \"message\": \"denied\"}"});
        pages.put("a JSON error's message", a -> new Object[] {403, "{\"error\": \"forbidden\", \"message\": \"you sent " + a + "\"}"});
        pages.put("a page cut across the key", a -> new Object[] {502, "x".repeat(200 - 7 - 12) + " " + a + " end"});
        pages.put("a page with the key's blanks", a -> new Object[] {502, "<html>bad gateway; you sent: " + a + "</html>"});
        pages.put("an HTML-escaped page", a -> new Object[] {502, "<html>you sent: " + a.replace("&", "&amp;") + "</html>"});
        for (Map.Entry<String, Function<String, Object[]>> page : pages.entrySet()) {
            HttpServer s = fake(ex -> page.getValue().apply(ex.getRequestHeaders().getFirst("authorization")));
            try {
                FencedClient client = new FencedClient(at(s), key, Duration.ofSeconds(2));
                List<Runnable> calls = List.of(
                        () -> client.lock("invoices", new LockOptions().retryFor(Duration.ZERO)),
                        () -> client.status("x"));
                for (Runnable call : calls) {
                    try {
                        call.run();
                        throw new AssertionError(page.getKey() + ": taken for a result");
                    } catch (FencedException e) {
                        String shown = e.code() + " " + e.getMessage() + " " + e;
                        for (String p : pieces) check(!shown.contains(p), page.getKey() + ": " + p + " shown: " + shown);
                    }
                }
            } finally {
                s.stop(0);
            }
        }
        // The other side: an error without the key is shown, its code kept.
        HttpServer plain = fake(ex -> new Object[] {403, "{\"error\": \"forbidden\", \"message\": \"not on lock x\"}"});
        try {
            new FencedClient(at(plain), key).status("x");
            throw new AssertionError("a 403 taken for a result");
        } catch (FencedException e) {
            check("forbidden".equals(e.code()) && e.getMessage().contains("403 forbidden: not on lock x"), e.getMessage());
        } finally {
            plain.stop(0);
        }
    }

    /** An expires_in past the ttl is not believed: unconfirmed, the lease ends at its ttl (was:
     * held, handing out its token, for 1000 s). */
    static void expiresInCapped() throws Exception {
        // Grants, and confirms one renewal (a lock() slower than ttl/3 asks one), with expires_in
        // 1000 for a ttl of 1 s; the next renewals are 503.
        AtomicInteger renewals = new AtomicInteger();
        HttpServer s = fake(ex -> ex.getRequestURI().getPath().endsWith("/-/acquire")
                ? new Object[] {200, grant(1, 1000)}
                : renewals.incrementAndGet() == 1
                ? new Object[] {200, "{\"ttl\": 1, \"expires_in\": 1000}"}
                : new Object[] {503, "{\"error\": \"unavailable\"}"});
        try {
            Lease lease = new FencedClient(at(s)).lock("r", new LockOptions().ttl(Duration.ofSeconds(1)));
            check("r:1".equals(lease.token()), "the holder's token");
            check(lease.remaining().toMillis() <= 1000, "remaining " + lease.remaining());
            String reason = lease.lost().get(5, TimeUnit.SECONDS);
            check(reason.startsWith("not confirmed within its ttl (last renewal: 503"), reason);
            expect(LeaseLostException.class, lease::token, "token after its ttl");
        } finally {
            s.stop(0);
        }
    }

    /** With the default requestTimeout (10 s), a renewal hung on its connection is cut off in time
     * and asked again (was: waited on to the lease's end: lost). */
    static void renewalHungDefaultTimeout() throws Exception {
        AtomicInteger renewals = new AtomicInteger();
        HttpServer s = fake(ex -> {
            String path = ex.getRequestURI().getPath();
            if (path.endsWith("/-/acquire")) return new Object[] {200, grant(4, 4)};
            if (path.endsWith("/-/renew")) {
                return renewals.incrementAndGet() == 1 ? null : new Object[] {200, "{\"ttl\": 4, \"expires_in\": 4}"};
            }
            return new Object[] {200, "{\"released\": true}"};
        });
        try {
            Lease lease = new FencedClient(at(s)).lock("r", new LockOptions().ttl(Duration.ofSeconds(4)));
            long deadline = System.nanoTime() + 10_000_000_000L;
            while (lease.renewals() < 1 && lease.state() == Lease.State.HELD) {
                check(System.nanoTime() - deadline < 0, "no renewal");
                Thread.sleep(20);
            }
            check(lease.state() == Lease.State.HELD, "lost: " + lease.lostReason());
            check(renewals.get() >= 2 && lease.renewalFailures() >= 1, renewals.get() + " renewals sent");
            check(lease.release() == Lease.Released.RELEASED, "release");
        } finally {
            s.stop(0);
        }
    }

    /** A redirect is not followed, and says where it led (without its query). */
    static void redirectNotFollowed() throws Exception {
        AtomicInteger reached = new AtomicInteger();
        HttpServer other = fake(ex -> {
            reached.incrementAndGet();
            return new Object[] {200, grant(10, 10)};
        });
        HttpServer front = fake(ex -> new Object[] {307, "", at(other) + ex.getRequestURI().getPath() + "?key=fk_leaked_query"});
        try {
            FencedClient client = new FencedClient(at(front), "alice-secret-0123456789");
            try {
                client.lock("invoices", new LockOptions().retryFor(Duration.ZERO));
                throw new AssertionError("a redirect's grant was taken");
            } catch (FencedException e) {
                String m = e.getMessage();
                check(e.status() == 307 && m.matches(".*redirected to http://127\\.0\\.0\\.1:\\d+/v1/locks/invoices/-/acquire: not followed.*"), m);
                check(!m.contains("fk_leaked"), m);
            }
            check(reached.get() == 0, "the other origin was asked");
        } finally {
            front.stop(0);
            other.stop(0);
        }
    }

    /** An answer larger than 1 MiB is cut off unread, with or without a content-length. */
    static void hugeAnswer() throws Exception {
        for (boolean length : new boolean[] {true, false}) {
            AtomicInteger sent = new AtomicInteger();
            HttpServer s = HttpServer.create(new InetSocketAddress(InetAddress.getLoopbackAddress(), 0), 0);
            s.setExecutor(Executors.newCachedThreadPool(r -> {
                Thread t = new Thread(r);
                t.setDaemon(true);
                return t;
            }));
            s.createContext("/", ex -> {
                ex.getRequestBody().readAllBytes();
                ex.sendResponseHeaders(502, length ? 64 << 20 : 0);
                byte[] chunk = new byte[1 << 16];
                java.util.Arrays.fill(chunk, (byte) 'A');
                try (OutputStream out = ex.getResponseBody()) {
                    while (sent.get() < 64 << 20) {
                        out.write(chunk);
                        sent.addAndGet(chunk.length);
                    }
                } catch (IOException hungUp) {
                    // the client closed the connection: what is tested
                }
            });
            s.start();
            try {
                new FencedClient(at(s), null, Duration.ofSeconds(20)).check("x:1");
                throw new AssertionError("a 502 taken for a result");
            } catch (FencedException e) {
                check(e.status() == 502 && e.getMessage().contains("over 1048576 bytes (not read)"),
                        e.getMessage().substring(0, Math.min(200, e.getMessage().length())));
                check(sent.get() < 16 << 20, (sent.get() >> 20) + " MiB sent before the client hung up");
            } finally {
                s.stop(0);
            }
        }
    }

    /** A lock() answered 409 at once backs off (jittered) until its timeout, not a spin. */
    static void busy409() throws Exception {
        AtomicInteger asked = new AtomicInteger();
        HttpServer s = fake(ex -> {
            asked.incrementAndGet();
            return new Object[] {409, "{\"error\": \"timeout\", \"message\": \"not acquired\"}"};
        });
        try {
            long started = System.nanoTime();
            expect(LockTimeoutException.class,
                    () -> new FencedClient(at(s)).lock("x", new LockOptions().timeout(Duration.ofMillis(1500))), "409");
            long took = (System.nanoTime() - started) / 1_000_000;
            check(took >= 1400 && took < 4000, took + " ms for a 1.5 s timeout");
            check(asked.get() >= 3 && asked.get() <= 15, asked.get() + " requests in 1.5 s");
        } finally {
            s.stop(0);
        }
    }

    /** Two threads releasing one lease get the same, first, answer: RELEASED (was: both could
     * get ALREADY_ENDED, 15 runs of 40). */
    static void concurrentRelease() throws Exception {
        FencedClient client = new FencedClient(URL);
        var pool = Executors.newFixedThreadPool(2);
        try {
            for (int i = 0; i < 40; i++) {
                Lease lease = client.lock(unique("java/rel") + "-" + i, new LockOptions().ttl(Duration.ofSeconds(30)));
                java.util.concurrent.CyclicBarrier together = new java.util.concurrent.CyclicBarrier(2);
                java.util.concurrent.Callable<Lease.Released> release = () -> {
                    together.await(10, TimeUnit.SECONDS);
                    return lease.release();
                };
                var one = pool.submit(release);
                var two = pool.submit(release);
                Lease.Released a = one.get(30, TimeUnit.SECONDS), b = two.get(30, TimeUnit.SECONDS);
                check(a == Lease.Released.RELEASED && b == Lease.Released.RELEASED, "run " + i + ": " + a + " / " + b);
            }
        } finally {
            pool.shutdownNow();
        }
    }

    static long timerThreads() {
        return Thread.getAllStackTraces().keySet().stream()
                .filter(t -> t.getName().equals("fenced-lease-timers") && t.isAlive()).count();
    }

    /** Clients whose leases ended leave no timer thread behind (was: one per client, forever);
     * close() releases what is held and refuses lock() after it. */
    static void noThreadLeft() throws Exception {
        HttpServer s = fake(ex -> ex.getRequestURI().getPath().endsWith("/-/release")
                ? new Object[] {200, "{\"released\": true}"}
                : new Object[] {200, grant(30, 30)});
        try {
            long before = timerThreads();
            for (int i = 0; i < 50; i++) {
                try (Lease lease = new FencedClient(at(s)).lock("r", new LockOptions().ttl(Duration.ofSeconds(30)))) {
                    lease.token();
                }
            }
            long deadline = System.nanoTime() + 15_000_000_000L; // (each ends 1 s after its last timer)
            while (timerThreads() > before) {
                check(System.nanoTime() - deadline < 0, timerThreads() + " timer threads left (" + before + " before)");
                Thread.sleep(50);
            }
            FencedClient client = new FencedClient(at(s));
            Lease held = client.lock("r", new LockOptions().ttl(Duration.ofSeconds(30)));
            client.close();
            check(held.state() == Lease.State.RELEASED, "close() left it " + held.state());
            try {
                client.lock("r");
                throw new AssertionError("a closed client took a lock");
            } catch (FencedException e) {
                check("closed".equals(e.code()), e.code());
            }
            client.close(); // (idempotent)
        } finally {
            s.stop(0);
        }
    }

    /** A lease whose machine was suspended past its ttl hands out no token on waking: played by
     * moving the boot-time clock the package reads (/proc/uptime on Linux) an hour on while the
     * monotonic one stands (was: System.nanoTime() alone; "held" for the rest of the ttl). */
    static void suspended() throws Exception {
        HttpServer s = fake(ex -> ex.getRequestURI().getPath().endsWith("/-/release")
                ? new Object[] {200, "{\"released\": true}"}
                : new Object[] {200, grant(30, 30)});
        Class<?> clock = Class.forName("dev.fenced.client.Clock");
        java.lang.reflect.Field boot = clock.getDeclaredField("boot");
        boot.setAccessible(true);
        java.lang.reflect.Method restart = clock.getDeclaredMethod("restart");
        restart.setAccessible(true);
        Object original = boot.get(null);
        double[] suspended = {0};
        boot.set(null, (DoubleSupplier) () -> System.nanoTime() / 1e9 + suspended[0]);
        restart.invoke(null);
        try {
            Lease lease = new FencedClient(at(s)).lock("s", new LockOptions().ttl(Duration.ofSeconds(30)));
            check("r:1".equals(lease.token()), "the holder before the suspend: its token");
            suspended[0] = 3600; // an hour, in which the source let the lease go
            expect(LeaseLostException.class, lease::token, "token after a suspend of an hour");
            check(lease.state() == Lease.State.LOST, "state " + lease.state());
            check(lease.remaining().isZero(), "remaining " + lease.remaining());
        } finally {
            boot.set(null, original);
            restart.invoke(null);
            s.stop(0);
        }
    }

    /** A 410 to a retried acquire (its grant was made and ended before an answer got through)
     * is a new attempt under a new id; a 410 to a first send (a caller's id whose grant has
     * ended) is one LeaseLostException. */
    static void lateDuplicate() throws Exception {
        List<String> ids = Collections.synchronizedList(new ArrayList<>());
        HttpServer server = HttpServer.create(new InetSocketAddress(InetAddress.getLoopbackAddress(), 0), 0);
        server.createContext("/", ex -> {
            String sent = new String(ex.getRequestBody().readAllBytes(), java.nio.charset.StandardCharsets.UTF_8);
            String rid = sent.replaceAll(".*\"request_id\"\\s*:\\s*\"([^\"]*)\".*", "$1");
            String path = ex.getRequestURI().getPath();
            int status = 200;
            String body;
            if (path.endsWith("/-/release")) {
                body = "{\"released\": true}";
            } else {
                ids.add(rid);
                if (ids.size() == 1) {
                    status = 503;
                    body = "{\"error\": \"unavailable\", \"message\": \"source down\"}";
                } else if (rid.equals(ids.get(0))) {
                    status = 410;
                    body = "{\"error\": \"lease_lost\", \"message\": \"the grant of this request id has ended\"}";
                } else {
                    body = "{\"lock\": \"x\", \"token\": \"x:2\", \"value\": 2, \"ttl\": 10, \"request_id\": \"" + rid + "\", \"expires_in\": 10}";
                }
            }
            byte[] bytes = body.getBytes(java.nio.charset.StandardCharsets.UTF_8);
            ex.getResponseHeaders().set("content-type", "application/json");
            ex.sendResponseHeaders(status, bytes.length);
            try (OutputStream out = ex.getResponseBody()) {
                out.write(bytes);
            }
        });
        server.start();
        try {
            FencedClient client = new FencedClient("http://127.0.0.1:" + server.getAddress().getPort(), null);
            Lease lease = client.lock("x", new LockOptions().retryFor(Duration.ofSeconds(5)));
            check(ids.size() == 3, "sends " + ids);
            check(ids.get(1).equals(ids.get(0)), "the retry: the same id " + ids);
            check(!ids.get(2).equals(ids.get(0)), "the new attempt: a new id " + ids);
            check(lease.requestId().equals(ids.get(2)), "the lease's id " + lease.requestId());
            check(lease.release() == Lease.Released.RELEASED, "release");
            ids.clear();
            ids.add("spent");
            expect(LeaseLostException.class,
                    () -> client.lock("x", new LockOptions().requestId("spent").retryFor(Duration.ofSeconds(5))),
                    "a caller's id whose grant has ended");
        } finally {
            server.stop(0);
        }
    }
}
