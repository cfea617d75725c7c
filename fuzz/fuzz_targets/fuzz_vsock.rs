//! virtio-vsock: rx, tx and event queues, packet headers and payloads from the fuzz input
//! (layout in `ember_fuzz::queue`), processed by the real device with host Unix sockets.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ember_fuzz::vsock::run(data));
