//! headroom-optim
