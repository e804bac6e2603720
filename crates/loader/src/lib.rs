//! headroom-loader
