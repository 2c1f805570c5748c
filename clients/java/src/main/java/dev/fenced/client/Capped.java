package dev.fenced.client;

import java.io.ByteArrayOutputStream;
import java.net.http.HttpResponse;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.Flow;

/** An answer's body, read up to {@code cap} bytes: past that the exchange is cancelled (its
 * connection closed) and the body is {@code over}, its text not kept. */
final class Capped implements HttpResponse.BodySubscriber<Capped.Body> {
    /** The text (UTF-8), or {@code over}: the answer was longer than the cap (not read). */
    record Body(String text, boolean over) {}

    private final int cap;
    private final boolean tooLong; // its content-length says so: not read at all
    private final ByteArrayOutputStream out = new ByteArrayOutputStream();
    private final CompletableFuture<Body> result = new CompletableFuture<>();
    private Flow.Subscription subscription;

    Capped(HttpResponse.ResponseInfo info, int cap) {
        this.cap = cap;
        this.tooLong = info.headers().firstValueAsLong("content-length").orElse(-1) > cap;
    }

    @Override
    public CompletionStage<Body> getBody() {
        return result;
    }

    @Override
    public void onSubscribe(Flow.Subscription s) {
        subscription = s;
        if (tooLong) {
            s.cancel();
            result.complete(new Body("", true));
        } else {
            s.request(1);
        }
    }

    @Override
    public void onNext(List<ByteBuffer> items) {
        if (result.isDone()) return;
        for (ByteBuffer b : items) {
            int n = b.remaining();
            if (out.size() + (long) n > cap) {
                subscription.cancel();
                result.complete(new Body("", true));
                return;
            }
            byte[] bytes = new byte[n];
            b.get(bytes);
            out.write(bytes, 0, n);
        }
        subscription.request(1);
    }

    @Override
    public void onError(Throwable t) {
        result.completeExceptionally(t);
    }

    @Override
    public void onComplete() {
        result.complete(new Body(out.toString(StandardCharsets.UTF_8), false));
    }
}
