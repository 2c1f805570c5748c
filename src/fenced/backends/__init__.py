"""Token sources, one module per URL scheme (see ``fenced._backend.SCHEMES``)."""
