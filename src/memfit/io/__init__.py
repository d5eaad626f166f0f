"""Layer 3, input/output on disk: input fingerprints, preflight checks, Parquet part writers, the token
table, reading outputs back."""
