"""Internal: see the package docstring of weightstream for the public API."""
