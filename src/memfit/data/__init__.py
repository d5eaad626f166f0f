"""Layer 1, the data path: read records (sources), tokenize once (tokenization), cut windows (chunking),
build relation examples (relation)."""
