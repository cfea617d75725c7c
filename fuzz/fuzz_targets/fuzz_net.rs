//! virtio-net: rx and tx queues, transmit chains and receive buffers from the fuzz input
//! (layout in `ember_fuzz::queue`), processed by the real device on a socket pair standing in
//! for its TAP, with frames from the network each round.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ember_fuzz::net::run(data));
