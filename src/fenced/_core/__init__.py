"""The core layer (docs/design.md): the token, the errors, the clock, the backend contract,
the lease state machine, the one async lease core and its sync facade, signing.

Nothing is imported here: each module is imported by its own name, and what a module offers
the layers above is its ``__all__``.
"""
