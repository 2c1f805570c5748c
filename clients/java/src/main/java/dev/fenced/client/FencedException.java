package dev.fenced.client;

/** Every error this package throws. */
public class FencedException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final int status;
    private final String code;

    public FencedException(String message, int status, String code) {
        super(message);
        this.status = status;
        this.code = code;
    }

    /** The HTTP status (0: no answer). */
    public int status() {
        return status;
    }

    /** The server's error code: "timeout", "lease_lost", "forbidden", "invalid_request", ...;
     * "bad_answer": a 200 that is no JSON object or lacks what it must carry. */
    public String code() {
        return code;
    }
}
