"""In-place modules (filled in by the modules work)."""
