"""The directives users write: one module per directive (its value, JSON fields, rewrite,
Designer row and code), `base` for what they share, `spec` for the registry and `pn.Program`."""
