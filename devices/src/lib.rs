//! ember's device model.
//!
//! Only what a sandbox needs exists here: a 8250 serial port, enough of an i8042 to let the guest
//! reboot, the boot-marker port, and virtio devices on the virtio-mmio transport. Devices never
//! depend on the `vmm` crate: the VMM registers them on a [`bus::Bus`] and wires their interrupts
//! (irqfd) and queue notifications (ioeventfd) to KVM.
//!
//! Every byte a guest hands a device is untrusted: register accesses of the wrong size or offset
//! are ignored, descriptor chains are validated before use, and errors are reported per request
//! instead of panicking, and every log line a guest can cause is rate-limited per call site
//! ([`ratelimit`]).

pub mod bus;
pub mod legacy;
pub mod ratelimit;
pub mod virtio;

/// Guest memory as every device sees it. Each region carries a dirty bitmap (one bit per 4 KiB
/// page) that vm-memory sets on every write made through it — i.e. by device emulation — so
/// diff snapshots see device writes as well as the guest's own (KVM's dirty log).
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;

/// The bitmap slice type of [`GuestMemoryMmap`] (for virtio-queue's `Reader`/`Writer`).
pub type GuestBitmapSlice<'a> = vm_memory::bitmap::BS<'a, vm_memory::bitmap::AtomicBitmap>;
