"""Layer 5, jobs: the stream loop (runner), the embed and classify jobs, Encoder, Classifier and plan()."""
