"""Token sources, one module per URL scheme (see ``fenced._core.backend.BUILTIN_SCHEMES``; others register through the ``fenced.backends`` entry-point group)."""
