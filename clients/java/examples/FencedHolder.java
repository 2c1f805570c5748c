// A fenced lock holder in Java, on the dev.fenced.client package (clients/java).
//
//   javac -d build src/main/java/dev/fenced/client/*.java examples/FencedHolder.java
//   java -cp build FencedHolder SERVER LOCK STORAGE_URL DATA [TTL]
//
// The same program as examples/fenced_client.mjs, command for command: it takes LOCK from a
// `fenced serve` at SERVER (the package renews it in the background) and reads commands, one
// a line, on stdin:
//   write         PUT DATA to STORAGE_URL with the token in the Fencing-Token header;
//                 skipped once the lease is lost: lease.token() throws then.
//   write paused  take the token ("checked"), wait for "resume", then write with it: DDIA
//                 Figure 8-5's pause between check and write, which only the guard catches.
//   renewals      print how many renewals were confirmed, and how many attempts failed.
//   release       give the lock back (idempotent).
// The end of stdin releases and exits. It prints one line per thing it learns: "token N",
// "write STATUS BODY", "write skipped: ...", "lost REASON", "released true|false|unknown".

import dev.fenced.client.FencedClient;
import dev.fenced.client.FencedException;
import dev.fenced.client.Lease;
import dev.fenced.client.LeaseLostException;
import dev.fenced.client.LockOptions;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;

public final class FencedHolder {
    public static void main(String[] args) throws Exception {
        String storage = args[2];
        String data = args[3];
        double ttl = args.length > 4 ? Double.parseDouble(args[4]) : 10;
        FencedClient client = new FencedClient(args[0]);
        Lease lease;
        try {
            lease = client.lock(args[1], new LockOptions()
                    .ttl(Duration.ofMillis((long) (ttl * 1000)))
                    .timeout(Duration.ofSeconds(30))
                    .owner("java pid " + ProcessHandle.current().pid())
                    .onLost(reason -> System.out.println("lost " + reason)));
        } catch (FencedException e) {
            System.out.println("error " + e.status() + " " + e.getMessage());
            System.exit(69);
            return;
        }
        System.out.println("token " + lease.value());
        HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
        String paused = null;
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line; (line = in.readLine()) != null; ) {
            switch (line.trim()) {
                case "write" -> {
                    String token = tokenOrSay(lease);
                    if (token != null) put(http, storage, token, data);
                }
                case "write paused" -> {
                    paused = tokenOrSay(lease);
                    if (paused != null) System.out.println("checked");
                }
                case "resume" -> {
                    if (paused != null) put(http, storage, paused, data);
                    paused = null;
                }
                case "renewals" -> System.out.println(
                        "renewals " + lease.renewals() + " failed " + lease.renewalFailures());
                case "release" -> System.out.println("released " + said(lease.release()));
                default -> { }
            }
        }
        System.out.println("released " + said(lease.release()));
        System.exit(0);
    }

    private static String said(Lease.Released r) {
        return switch (r) {
            case RELEASED -> "true";
            case ALREADY_ENDED -> "false";
            case UNKNOWN -> "unknown";
        };
    }

    private static String tokenOrSay(Lease lease) {
        try {
            return lease.token();
        } catch (LeaseLostException e) {
            System.out.println("write skipped: the lease is lost");
            return null;
        }
    }

    private static void put(HttpClient http, String url, String token, String data) {
        try {
            HttpResponse<String> r = http.send(
                    HttpRequest.newBuilder(URI.create(url))
                            .header("fencing-token", token)
                            .PUT(HttpRequest.BodyPublishers.ofString(data))
                            .timeout(Duration.ofSeconds(30))
                            .build(),
                    HttpResponse.BodyHandlers.ofString());
            String body = r.body().replaceAll("\\s+", " ");
            System.out.println("write " + r.statusCode() + " " + body.substring(0, Math.min(200, body.length())));
        } catch (Exception e) {
            System.out.println("write failed " + e);
        }
    }
}
