"""Drop-in replacements for other loaders' APIs (``weightstream.compat.runai``)."""
