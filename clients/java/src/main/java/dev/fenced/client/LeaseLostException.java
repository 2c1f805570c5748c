package dev.fenced.client;

/** The lease is not (or no longer) confirmed valid: its token must not be used. */
public class LeaseLostException extends FencedException {
    private static final long serialVersionUID = 1L;

    public LeaseLostException(String message, String code) {
        super(message, 0, code);
    }
}
