//! virtio-blk: descriptor table, avail ring, request headers and data from the fuzz input
//! (layout in `ember_fuzz::queue`), processed by the real device on real files.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ember_fuzz::block::run(data));
