"""Guards: make a resource reject writes that carry a stale fencing token."""
