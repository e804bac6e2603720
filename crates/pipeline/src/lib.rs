//! headroom-pipeline
