//! virtio-vsock under a hostile driver: packets on the tx queue, buffers on the rx and event
//! queues, all from the fuzz input; a host listener for guest port 1024 (`<uds_path>_1024`) that
//! accepts and answers, so connections get past the handshake.
//!
//! `selector` bit 0: a host client also connects to the device's socket and asks for guest port
//! 5000 (the host-initiated path).

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

use ember_devices::legacy::EventTrigger;
use ember_devices::virtio::vsock::{Vsock, VsockConfig};
use ember_devices::virtio::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use event_manager::{EventManager, SubscriberOps};

use crate::queue::{used_idx, FuzzInput};
use crate::ScratchDir;

/// The guest's context id in every run.
pub const GUEST_CID: u64 = 3;
/// The host port a listener waits on.
pub const HOST_PORT: u32 = 1024;
/// Event-loop rounds per input.
const ROUNDS: usize = 4;

thread_local! {
    static DIR: ScratchDir = ScratchDir::new("vsock");
}

/// Runs one fuzz input through a virtio-vsock device.
pub fn run(data: &[u8]) {
    let _ = run_and_return_memory(data);
}

/// [`run`], returning guest memory afterwards (for tests that check the completions).
pub fn run_and_return_memory(data: &[u8]) -> ember_devices::GuestMemoryMmap {
    DIR.with(|d| run_in(d.path(), data))
}

fn run_in(dir: &Path, data: &[u8]) -> ember_devices::GuestMemoryMmap {
    let uds = dir.join("v.sock");
    let port_path = dir.join(format!("v.sock_{HOST_PORT}"));
    let _ = std::fs::remove_file(&port_path);
    let listener = UnixListener::bind(&port_path).expect("fuzz harness: host listener");
    listener
        .set_nonblocking(true)
        .expect("fuzz harness: non-blocking listener");
    let mut dev = Vsock::new(VsockConfig {
        guest_cid: GUEST_CID,
        uds_path: uds.clone(),
    })
    .expect("fuzz harness: vsock device");
    let max = dev.queue_max_sizes().to_vec();
    let input = FuzzInput::parse(data, &max);
    dev.set_acked_features(VIRTIO_F_VERSION_1);
    let mem = input.memory();
    let irq = Arc::new(Interrupt::new(
        EventTrigger::new().expect("fuzz harness: eventfd"),
    ));
    dev.activate(mem.clone(), irq, input.virtqueues(&max))
        .expect("fuzz harness: activation of valid queues");
    let dev = Arc::new(Mutex::new(dev));
    let mut mgr = EventManager::<Arc<Mutex<Vsock>>>::new().expect("fuzz harness: epoll");
    mgr.add_subscriber(dev.clone());
    let mut host = Vec::new();
    if input.selector & 1 != 0 {
        if let Ok(mut s) = UnixStream::connect(&uds) {
            let _ = s.write_all(b"CONNECT 5000\n");
            host.push(s);
        }
    }
    for _ in 0..ROUNDS {
        {
            let d = dev.lock().expect("fuzz harness: device lock");
            for evt in d.queue_events() {
                let _ = evt.write(1);
            }
        }
        let _ = mgr.run_with_timeout(0);
        while let Ok((mut s, _)) = listener.accept() {
            let _ = s.set_nonblocking(true);
            let _ = s.write_all(b"hello from the host");
            host.push(s);
        }
    }
    drop(mgr);
    drop(dev);
    drop(host);
    for (q, vq) in input.queues.iter().enumerate() {
        let used = used_idx(&mem, q);
        assert!(
            used <= vq.avail_idx,
            "queue {q}: used index {used} ran past the avail index {}",
            vq.avail_idx
        );
    }
    mem
}
