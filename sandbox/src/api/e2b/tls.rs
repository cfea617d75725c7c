//! The optional TLS listener of `ember serve` and the local CA / `*.<domain>` certificate it
//! uses. (Being written.)
