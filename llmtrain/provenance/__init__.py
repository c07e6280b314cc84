"""What trained what: lineage derived from run records, forget, which rows a new run trains."""
