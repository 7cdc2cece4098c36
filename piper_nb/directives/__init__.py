"""directives package."""
