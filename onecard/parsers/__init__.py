"""parsers."""
