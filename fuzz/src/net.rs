//! virtio-net under a hostile driver: transmit chains and receive buffers from the fuzz input
//! (layout in [`crate::queue`]), processed by the real device, which sits on one end of a Unix
//! datagram socket pair standing in for its TAP (`Tap::from_frame_socket`). The harness plays
//! the network on the other end: each round it sends frames the device must deliver into the
//! guest's receive buffers, and reads back what the device transmitted.
//!
//! `selector` bits:
//! - 0 ([`MRG_RXBUF`]): `VIRTIO_NET_F_MRG_RXBUF` acked.
//! - 1 ([`GUEST_OFFLOADS`]): `GUEST_CSUM`, `GUEST_TSO4`, `GUEST_TSO6`, `GUEST_ECN` acked.
//! - 2 ([`HOST_OFFLOADS`]): `CSUM`, `HOST_TSO4`, `HOST_TSO6`, `HOST_ECN` acked.
//! - 3..=5: what the network sends each round ([`traffic`]; pattern 0 has it closed, so every
//!   transmit fails, as on a TAP that is down).
//! - 6 ([`STAGED`]): the driver publishes its avail entries over the rounds instead of all at
//!   once (round `r` of 4 shows `avail_idx × (r + 1) / 4`), so the device sees buffers arrive
//!   while it holds a frame, and transmit chains arrive late.
//! - 7 ([`RESTORE`]): after the first round, the device's state is saved and the run goes on
//!   with a new device built from it on a new socket pair (what `Net::restore` does after
//!   attaching its TAP).
//!
//! `VERSION_1`, `MAC`, `STATUS` and `INDIRECT_DESC` are always acked, `RING_EVENT_IDX` when the
//! receive queue's event-index flag is set (the device applies it to both queues), all masked
//! with what the device offers.
//!
//! Beyond "no panic": every frame the device transmits has a sane length and a vnet header that
//! asks only for negotiated offloads, the network sees exactly the frames the device counts as
//! sent, and the device completes no more chains on a queue than its avail index offered. The
//! last check needs the driver's rings to stay as the driver wrote them: a receive buffer may
//! lie over a descriptor table or an avail ring (the guest's choice, which the device must
//! survive), and then the frames written there rewrite them, so the check is skipped.

use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex, OnceLock};

use ember_devices::legacy::EventTrigger;
use ember_devices::virtio::net::{
    features, MacAddr, Net, NetConfig, Tap, ETH_HLEN, MAX_FRAME_LEN, VNET_HDR_LEN,
};
use ember_devices::virtio::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use ember_devices::GuestMemoryMmap;
use ember_snapshot::Persist;
use event_manager::{EventManager, SubscriberOps};
use vm_memory::{Bytes, GuestAddress};

use crate::queue::{avail_ring, desc_table, used_ring, FuzzInput, PAYLOAD};

/// The name the stand-in TAP goes by (the guest's MAC is derived from it).
pub const TAP_NAME: &str = "fuzz0";
/// `selector` bit: `MRG_RXBUF` acked.
pub const MRG_RXBUF: u8 = 1;
/// `selector` bit: the guest-side (receive) offloads acked.
pub const GUEST_OFFLOADS: u8 = 2;
/// `selector` bit: the host-side (transmit) offloads acked.
pub const HOST_OFFLOADS: u8 = 4;
/// `selector` bit: avail entries are published over the rounds.
pub const STAGED: u8 = 0x40;
/// `selector` bit: save the device after the first round and go on with a restored one.
pub const RESTORE: u8 = 0x80;
/// Where the frames of [`traffic::INPUT`] are, in guest-address terms: the start of the
/// payload, read from the input before the run (the guest may use the same bytes as buffers;
/// that does no harm). One byte `n` (taken modulo [`MAX_INPUT_FRAMES`]` + 1`), then `n` records
/// of a le16 length and that many bytes (cut short where the payload ends).
pub const INPUT_FRAMES: u64 = PAYLOAD;
/// Most frames [`traffic::INPUT`] takes from the input.
pub const MAX_INPUT_FRAMES: usize = 8;
/// Event-loop rounds per input.
const ROUNDS: usize = 4;

/// What the network sends each round: `selector` bits 3..=5 ([`traffic::bits`]).
pub mod traffic {
    /// Nothing: the network has closed its end, so every transmit fails.
    pub const CLOSED: u8 = 0;
    /// One 60-byte frame.
    pub const SMALL: u8 = 1;
    /// A 1514-byte frame and a small one with `DATA_VALID`.
    pub const MTU: u8 = 2;
    /// GSO frames: TCPv4 (20000 bytes), TCPv6 with ECN (9000 bytes), and UDP GSO, which the
    /// device never accepts.
    pub const GSO: u8 = 3;
    /// The largest frame the device takes and one byte more (dropped).
    pub const EXTREMES: u8 = 4;
    /// Frames too short for a vnet and an Ethernet header (0, 11, 25 bytes), then the shortest
    /// valid one.
    pub const RUNTS: u8 = 5;
    /// 70 small frames: more than the device handles per event.
    pub const BURST: u8 = 6;
    /// Frames from the input (see [`super::INPUT_FRAMES`]).
    pub const INPUT: u8 = 7;

    /// The `selector` bits for traffic pattern `t`.
    pub const fn bits(t: u8) -> u8 {
        (t & 7) << 3
    }
}

/// What a run did, summed over the devices of a run (two with [`RESTORE`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Frames the network received from the device.
    pub tx_frames: u64,
    /// Transmit chains the device refused.
    pub tx_malformed: u64,
    /// Frames the network refused (it is closed, or its socket is full).
    pub tx_errors: u64,
    /// Frames the device put into the guest's buffers.
    pub rx_frames: u64,
    /// Frames from the network the device dropped.
    pub rx_dropped: u64,
    /// Receive chains the device refused.
    pub rx_malformed: u64,
    /// Times the device held a frame for want of receive buffers.
    pub rx_stalls: u64,
}

/// Runs one fuzz input through a virtio-net device.
pub fn run(data: &[u8]) {
    let _ = run_and_return_outcome(data);
}

/// [`run`], returning guest memory afterwards (for tests that check the completions).
pub fn run_and_return_memory(data: &[u8]) -> GuestMemoryMmap {
    run_and_return_outcome(data).0
}

/// [`run`], returning guest memory and what the device did.
pub fn run_and_return_outcome(data: &[u8]) -> (GuestMemoryMmap, Outcome) {
    let (dev, peer) = device();
    let max = dev.queue_max_sizes().to_vec();
    let input = FuzzInput::parse(data, &max);
    let s = input.selector;
    let mut acked =
        VIRTIO_F_VERSION_1 | features::MAC | features::STATUS | features::RING_INDIRECT_DESC;
    if s & MRG_RXBUF != 0 {
        acked |= features::MRG_RXBUF;
    }
    if s & GUEST_OFFLOADS != 0 {
        acked |= features::GUEST_CSUM
            | features::GUEST_TSO4
            | features::GUEST_TSO6
            | features::GUEST_ECN;
    }
    if s & HOST_OFFLOADS != 0 {
        acked |= features::CSUM | features::HOST_TSO4 | features::HOST_TSO6 | features::HOST_ECN;
    }
    if input.queues.first().is_some_and(|q| q.event_idx) {
        acked |= features::RING_EVENT_IDX;
    }
    let acked = acked & dev.avail_features();
    let frames = host_frames(&input);
    let closed = (s >> 3) & 7 == traffic::CLOSED;
    let staged = s & STAGED != 0;
    let mem = input.memory();
    if staged {
        publish(&mem, &input, 0);
    }
    let mut rings = DriverRings::new(&mem, input.queues.len());
    let irq = Arc::new(Interrupt::new(
        EventTrigger::new().expect("fuzz harness: eventfd"),
    ));
    let mut out = Outcome::default();
    let mut rig = Rig::start(
        dev,
        (!closed).then_some(peer),
        acked,
        mem.clone(),
        irq.clone(),
        input.virtqueues(&max),
    );
    for round in 0..ROUNDS {
        if round == 1 && s & RESTORE != 0 {
            rig = rig.restore(&mem, &irq, closed, &mut out);
        }
        if staged && round > 0 {
            rings.check(&mem);
            publish(&mem, &input, round);
            rings.expect(&mem);
        }
        if let Some(peer) = &rig.peer {
            for f in &frames {
                // A full socket drops the frame, as a full TAP queue would.
                let _ = peer.send(f);
            }
        }
        {
            let d = rig.dev.lock().expect("fuzz harness: device lock");
            for evt in d.queue_events() {
                let _ = evt.write(1);
            }
        }
        let _ = rig.mgr.run_with_timeout(0);
        rig.drain();
    }
    let state = rig.dev.lock().expect("fuzz harness: device lock").save();
    rig.finish(&mut out);
    rings.check(&mem);
    if rings.intact {
        for (q, vq) in input.queues.iter().enumerate() {
            // The device's own count: a receive buffer may lie over a used ring.
            let used = state.queues[q].next_used;
            assert!(
                used <= vq.avail_idx,
                "queue {q}: used index {used} ran past the avail index {}",
                vq.avail_idx
            );
        }
    }
    (mem, out)
}

/// Bytes of a queue's descriptor table and avail ring (the used ring follows them).
const DRIVER_AREA: usize = (used_ring(0) - desc_table(0)) as usize;

/// The driver's part of each queue (descriptor table and avail ring), to notice the device
/// writing received frames over it.
struct DriverRings {
    queues: usize,
    expected: Vec<u8>,
    intact: bool,
}

impl DriverRings {
    fn new(mem: &GuestMemoryMmap, queues: usize) -> Self {
        let mut r = DriverRings {
            queues,
            expected: Vec::new(),
            intact: true,
        };
        r.expect(mem);
        r
    }

    fn read(&self, mem: &GuestMemoryMmap) -> Vec<u8> {
        let mut out = vec![0u8; self.queues * DRIVER_AREA];
        for (q, area) in out.chunks_mut(DRIVER_AREA).enumerate() {
            mem.read_slice(area, GuestAddress(desc_table(q)))
                .expect("fuzz harness: rings inside memory");
        }
        out
    }

    /// The rings as they are now are the driver's.
    fn expect(&mut self, mem: &GuestMemoryMmap) {
        self.expected = self.read(mem);
    }

    /// Notes whether the rings are still the driver's.
    fn check(&mut self, mem: &GuestMemoryMmap) {
        self.intact &= self.read(mem) == self.expected;
    }
}

/// Writes each queue's avail index as the driver shows it in `round` with [`STAGED`].
fn publish(mem: &GuestMemoryMmap, input: &FuzzInput, round: usize) {
    for (q, vq) in input.queues.iter().enumerate() {
        let idx = (u32::from(vq.avail_idx) * (round as u32 + 1) / ROUNDS as u32) as u16;
        mem.write_obj(idx.to_le(), GuestAddress(avail_ring(q) + 2))
            .expect("fuzz harness: avail ring inside memory");
    }
}

/// A device on a fresh socket pair, and the network's end of it.
fn device() -> (Net, UnixDatagram) {
    let (ours, peer) = UnixDatagram::pair().expect("fuzz harness: socket pair");
    peer.set_nonblocking(true)
        .expect("fuzz harness: non-blocking socket");
    let tap = Tap::from_frame_socket(ours, TAP_NAME).expect("fuzz harness: stand-in TAP");
    let cfg = NetConfig {
        tap: TAP_NAME.into(),
        mac: None,
    };
    let dev = Net::with_tap(cfg, tap).expect("fuzz harness: virtio-net device");
    (dev, peer)
}

/// One running device: its event loop and the network's end of its socket pair.
struct Rig {
    dev: Arc<Mutex<Net>>,
    mgr: EventManager<Arc<Mutex<Net>>>,
    peer: Option<UnixDatagram>,
    acked: u64,
    /// Frames the network received from this device.
    seen: u64,
    /// Their bytes, without vnet headers.
    seen_bytes: u64,
    buf: Vec<u8>,
}

impl Rig {
    fn start(
        mut dev: Net,
        peer: Option<UnixDatagram>,
        acked: u64,
        mem: GuestMemoryMmap,
        irq: Arc<Interrupt>,
        queues: Vec<virtio_queue::Queue>,
    ) -> Self {
        dev.set_acked_features(acked);
        assert_eq!(dev.acked_features(), acked);
        dev.activate(mem, irq, queues)
            .expect("fuzz harness: activation of valid queues");
        let dev = Arc::new(Mutex::new(dev));
        let mut mgr = EventManager::<Arc<Mutex<Net>>>::new().expect("fuzz harness: epoll");
        mgr.add_subscriber(dev.clone());
        Rig {
            dev,
            mgr,
            peer,
            acked,
            seen: 0,
            seen_bytes: 0,
            buf: vec![0; VNET_HDR_LEN + MAX_FRAME_LEN + 1],
        }
    }

    /// Reads and checks every frame the device sent.
    fn drain(&mut self) {
        let Some(peer) = &self.peer else {
            return;
        };
        while let Ok(n) = peer.recv(&mut self.buf) {
            check_tx_frame(&self.buf[..n], self.acked);
            self.seen += 1;
            self.seen_bytes += (n - VNET_HDR_LEN) as u64;
        }
    }

    /// Ends this device: the network saw exactly what it counted as sent.
    fn finish(mut self, out: &mut Outcome) {
        self.drain();
        let m = self
            .dev
            .lock()
            .expect("fuzz harness: device lock")
            .metrics();
        assert_eq!(
            (m.tx_frames, m.tx_bytes),
            (self.seen, self.seen_bytes),
            "frames counted as sent differ from what reached the network ({m:?})"
        );
        out.tx_frames += m.tx_frames;
        out.tx_malformed += m.tx_malformed;
        out.tx_errors += m.tx_errors;
        out.rx_frames += m.rx_frames;
        out.rx_dropped += m.rx_dropped;
        out.rx_malformed += m.rx_malformed;
        out.rx_stalls += m.rx_stalls;
    }

    /// Saves this device, ends it, and starts a new one from the saved state.
    fn restore(
        self,
        mem: &GuestMemoryMmap,
        irq: &Arc<Interrupt>,
        closed: bool,
        out: &mut Outcome,
    ) -> Self {
        let state = self.dev.lock().expect("fuzz harness: device lock").save();
        assert!(state.activated && state.queues.len() == 2, "{state:?}");
        assert_eq!(state.mac, MacAddr::derive(TAP_NAME).bytes());
        let acked = state.acked_features;
        self.finish(out);
        let queues: Vec<_> = state
            .queues
            .iter()
            .map(|q| {
                q.to_queue(Some(mem))
                    .expect("fuzz harness: the device's own queue state was refused")
            })
            .collect();
        let (dev, peer) = device();
        let peer = (!closed).then_some(peer);
        Rig::start(dev, peer, acked, mem.clone(), irq.clone(), queues)
    }
}

/// What the device hands the host must be well-formed whatever the guest wrote: a vnet header
/// and at least an Ethernet header, at most [`MAX_FRAME_LEN`] bytes of frame, and a header that
/// asks only for negotiated offloads, with `num_buffers` clear.
fn check_tx_frame(f: &[u8], acked: u64) {
    assert!(
        (VNET_HDR_LEN + ETH_HLEN..=VNET_HDR_LEN + MAX_FRAME_LEN).contains(&f.len()),
        "transmitted frame of {} bytes",
        f.len()
    );
    let (flags, gso) = (f[0], f[1]);
    assert!(flags & !1 == 0, "transmitted header flags {flags:#x}");
    if flags != 0 {
        assert_ne!(acked & features::CSUM, 0, "NEEDS_CSUM without CSUM");
    }
    let need = match gso & 0x7f {
        0 => 0,
        1 => features::HOST_TSO4,
        4 => features::HOST_TSO6,
        other => panic!("transmitted GSO type {other}"),
    };
    assert_eq!(acked & need, need, "GSO type {gso:#x} not negotiated");
    if gso & 0x80 != 0 {
        assert!(need != 0, "ECN without a GSO type");
        assert_ne!(acked & features::HOST_ECN, 0, "ECN without HOST_ECN");
    }
    assert_eq!(f[10..12], [0, 0], "num_buffers set on a transmitted frame");
}

/// A frame from the network: `hdr` then an Ethernet frame of `len` bytes for the guest.
fn frame(hdr: [u8; 2], len: usize) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f[..2].copy_from_slice(&hdr);
    f.extend_from_slice(&MacAddr::derive(TAP_NAME).bytes());
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1, 0x08, 0x00]);
    f.extend((0..len.saturating_sub(ETH_HLEN)).map(|i| (i % 251) as u8));
    f.truncate(VNET_HDR_LEN + len);
    f
}

/// The fixed traffic patterns, built once.
fn patterns() -> &'static [Vec<Vec<u8>>] {
    static P: OnceLock<Vec<Vec<Vec<u8>>>> = OnceLock::new();
    P.get_or_init(|| {
        const NEEDS_CSUM: u8 = 1;
        const DATA_VALID: u8 = 2;
        let mut p = vec![Vec::new(); 7]; // CLOSED sends nothing; INPUT is not built here.
        p[traffic::SMALL as usize] = vec![frame([0, 0], 60)];
        p[traffic::MTU as usize] = vec![frame([0, 0], 1514), frame([DATA_VALID, 0], 100)];
        p[traffic::GSO as usize] = vec![
            frame([NEEDS_CSUM, 1], 20_000),
            frame([NEEDS_CSUM, 4 | 0x80], 9000),
            frame([NEEDS_CSUM, 5], 3000),
        ];
        p[traffic::EXTREMES as usize] = vec![
            frame([0, 0], MAX_FRAME_LEN),
            frame([0, 0], MAX_FRAME_LEN + 1),
        ];
        p[traffic::RUNTS as usize] = vec![
            Vec::new(),
            vec![0; 11],
            frame([0, 0], 13),
            frame([0, 0], ETH_HLEN),
        ];
        p[traffic::BURST as usize] = (0..70).map(|_| frame([0, 0], 60)).collect();
        p
    })
}

/// The frames the network sends each round.
fn host_frames(input: &FuzzInput) -> Vec<&[u8]> {
    let t = (input.selector >> 3) & 7;
    if t != traffic::INPUT {
        return patterns()[usize::from(t)]
            .iter()
            .map(Vec::as_slice)
            .collect();
    }
    let region = input
        .payload
        .get((INPUT_FRAMES - PAYLOAD) as usize..)
        .unwrap_or_default();
    let Some((&n, mut rest)) = region.split_first() else {
        return Vec::new();
    };
    let n = usize::from(n) % (MAX_INPUT_FRAMES + 1);
    let mut out = Vec::new();
    while out.len() < n && rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        out.push(&rest[2..2 + len]);
        rest = &rest[2 + len..];
    }
    out
}
