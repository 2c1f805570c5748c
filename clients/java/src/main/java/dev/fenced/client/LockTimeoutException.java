package dev.fenced.client;

/** The lock was not granted within the timeout (409 {@code timeout}). */
public class LockTimeoutException extends FencedException {
    private static final long serialVersionUID = 1L;

    public LockTimeoutException(String message, int status, String code) {
        super(message, status, code);
    }
}
