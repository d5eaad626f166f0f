"""Layer 4, the engine: model loading, precision, batches on the device (OOM guard), pooling, the loaded
Runtime, process-wide settings."""
