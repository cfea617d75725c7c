//! virtio-net (device type 1) backed by a host TAP device.
//!
//! Two queues: receive (0) and transmit (1), 256 entries each. The device runs on the VMM's
//! event loop (no threads of its own): it watches both queue eventfds and the TAP.
//!
//! # Offloads
//! The TAP speaks `virtio_net_hdr_v1` (12 bytes, `TUNSETVNETHDRSZ`), the same header the guest
//! uses with `VIRTIO_F_VERSION_1`, so offload metadata passes straight through.
//! - Guest → host: `CSUM`, `HOST_TSO4`, `HOST_TSO6`, `HOST_ECN`. The tun driver accepts partial
//!   checksums and TCP GSO from its writer unconditionally, so these cost nothing to offer. The
//!   header of every transmit chain is copied out of guest memory once and checked against the
//!   negotiated features before the kernel sees it (no time-of-check/time-of-use window).
//! - Host → guest: `GUEST_CSUM`, `GUEST_TSO4`, `GUEST_TSO6`, `GUEST_ECN`, mapped at activation
//!   onto `TUNSETOFFLOAD` (`TUN_F_CSUM`, `TUN_F_TSO4/6`, `TUN_F_TSO_ECN`) from what the driver
//!   actually accepted; the host stack checksums and segments whatever the guest did not accept.
//!   Headers read from the TAP are checked against the same features before delivery.
//! - Not offered: `HOST_UFO`/`GUEST_UFO` (Linux stopped generating UFO in 4.14; a guest would
//!   not use it, and accepting it would only widen what a guest can hand the host kernel), USO
//!   (`HOST_USO`, `GUEST_USO4/6`: the 6.1 guest kernel has no virtio USO support), `CTRL_VQ`
//!   and everything behind it (no runtime offload or filter changes, no multiqueue), `MTU`.
//! - `MRG_RXBUF` is offered: with it the Linux driver posts page-sized receive buffers and a
//!   64 KiB GSO frame spans several, instead of one ~64 KiB chain per frame (19 descriptors,
//!   so only 13 frames fit a 256-entry ring). `EVENT_IDX` and `INDIRECT_DESC` are offered too.
//!
//! # Receive path and back-pressure
//! Frames are read from the TAP one at a time into a device-owned buffer (one frame, at most
//! `12 + MAX_FRAME_LEN` bytes) and copied into the guest's buffers. A frame is only taken off
//! the ring once it fits completely; when the guest has too few receive buffers the frame stays
//! *pending*, notifications are enabled on the receive queue, and the TAP is dropped from the
//! epoll interest set (level-triggered, so nothing spins). The guest's next receive-queue kick
//! delivers the pending frame and re-arms the TAP. Meanwhile frames queue in the kernel's TAP
//! queue (bounded by its `txqueuelen`; beyond that the host drops them, as a real link would).
//! At most one frame is ever buffered here and none is dropped unless it cannot fit the guest's
//! buffers at all (larger than the whole ring without `MRG_RXBUF`, or larger than
//! `MAX_FRAME_LEN`), which is counted. Each event handles at most 64 frames (256 transmit
//! chains) before yielding to the rest of the event loop.
//!
//! # Transmit path
//! Each chain must be device-readable only, at most 256 descriptors, at most
//! `12 + MAX_FRAME_LEN` bytes, inside guest memory, and carry at least a header and an Ethernet
//! header. It is written with one `writev` straight from guest memory. A refused chain is
//! completed with length 0 and counted; so is a frame the TAP refuses (for example when the
//! interface is down). Writes to a TAP do not block in practice (tun's send buffer is unbounded
//! by default), so there is no transmit back-pressure path.
//!
//! # Snapshots
//! [`NetState`] holds the MAC, the accepted features and the queues. The pending receive frame
//! is not saved (it is lost like a frame on the wire). A restored device may attach to a
//! different TAP (each clone has its own); the guest keeps the MAC it had.
//!
//! # Without a TAP
//! Tests and fuzz targets build the device with [`Net::with_tap`] on a [`Tap`] made by
//! [`Tap::from_frame_socket`] (one end of a Unix datagram socket pair, no root needed); the
//! device itself runs unchanged.
//!
//! Not implemented: rate limiting, multiqueue, the control queue.

mod mac;
mod rxtx;
mod tap;

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_bindings::bindings::virtio_net as vn;
use virtio_bindings::bindings::virtio_ring as vr;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{
    device_type, interrupt_cause, ActivateError, Interrupt, QueueSnapshot, VirtioDevice,
    VIRTIO_F_VERSION_1,
};
use crate::GuestMemoryMmap;

pub use mac::{MacAddr, MacError};
pub use rxtx::{ChainError, ETH_HLEN, MAX_CHAIN_DESCS, MAX_FRAME_LEN};
pub use tap::{Tap, TapError, VNET_HDR_LEN};

/// Feature bits of virtio-net (and the ring features it offers).
pub mod features {
    use super::{vn, vr};
    /// Driver → device partial checksums.
    pub const CSUM: u64 = 1 << vn::VIRTIO_NET_F_CSUM;
    /// Device → driver partial checksums.
    pub const GUEST_CSUM: u64 = 1 << vn::VIRTIO_NET_F_GUEST_CSUM;
    /// The device has a MAC address in its config space.
    pub const MAC: u64 = 1 << vn::VIRTIO_NET_F_MAC;
    /// The driver takes TCPv4 GSO frames.
    pub const GUEST_TSO4: u64 = 1 << vn::VIRTIO_NET_F_GUEST_TSO4;
    /// The driver takes TCPv6 GSO frames.
    pub const GUEST_TSO6: u64 = 1 << vn::VIRTIO_NET_F_GUEST_TSO6;
    /// The driver takes GSO frames with ECN.
    pub const GUEST_ECN: u64 = 1 << vn::VIRTIO_NET_F_GUEST_ECN;
    /// The device takes TCPv4 GSO frames.
    pub const HOST_TSO4: u64 = 1 << vn::VIRTIO_NET_F_HOST_TSO4;
    /// The device takes TCPv6 GSO frames.
    pub const HOST_TSO6: u64 = 1 << vn::VIRTIO_NET_F_HOST_TSO6;
    /// The device takes GSO frames with ECN.
    pub const HOST_ECN: u64 = 1 << vn::VIRTIO_NET_F_HOST_ECN;
    /// Received frames may span several buffers.
    pub const MRG_RXBUF: u64 = 1 << vn::VIRTIO_NET_F_MRG_RXBUF;
    /// The config space has a link status.
    pub const STATUS: u64 = 1 << vn::VIRTIO_NET_F_STATUS;
    /// Indirect descriptor tables.
    pub const RING_INDIRECT_DESC: u64 = 1 << vr::VIRTIO_RING_F_INDIRECT_DESC;
    /// Event-index notification suppression.
    pub const RING_EVENT_IDX: u64 = 1 << vr::VIRTIO_RING_F_EVENT_IDX;
}

/// Size of both queues.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the receive queue.
pub const RX_QUEUE: usize = 0;
/// Index of the transmit queue.
pub const TX_QUEUE: usize = 1;
/// Frames handled per event before yielding to the rest of the event loop.
const RX_BUDGET: usize = 64;
/// Transmit chains handled per event before yielding.
const TX_BUDGET: usize = 256;
/// One byte more than the largest accepted frame, so a truncated read is recognisable.
const RX_BUF_LEN: usize = VNET_HDR_LEN + MAX_FRAME_LEN + 1;

const OFFERED: u64 = VIRTIO_F_VERSION_1
    | features::CSUM
    | features::GUEST_CSUM
    | features::MAC
    | features::GUEST_TSO4
    | features::GUEST_TSO6
    | features::GUEST_ECN
    | features::HOST_TSO4
    | features::HOST_TSO6
    | features::HOST_ECN
    | features::MRG_RXBUF
    | features::STATUS
    | features::RING_INDIRECT_DESC
    | features::RING_EVENT_IDX;

/// Configuration of one network interface.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Name of an existing TAP device (created by the orchestrator, possibly in a netns).
    pub tap: String,
    /// Guest MAC address, `aa:bb:cc:dd:ee:ff`; a locally administered one is derived otherwise.
    #[serde(default)]
    pub mac: Option<String>,
}

impl NetConfig {
    /// The guest's MAC: the configured one (validated), or one derived from the TAP name.
    pub fn mac_addr(&self) -> Result<MacAddr, NetError> {
        match &self.mac {
            Some(s) => s.parse().map_err(|source| NetError::Mac {
                tap: self.tap.clone(),
                source,
            }),
            None => Ok(MacAddr::derive(&self.tap)),
        }
    }
}

/// Errors building or restoring a network device.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The TAP cannot be used.
    #[error(transparent)]
    Tap(#[from] TapError),
    /// The configured MAC is not usable.
    #[error("guest MAC for TAP {tap}: {source}")]
    Mac {
        /// The TAP.
        tap: String,
        /// Why.
        source: MacError,
    },
    /// A queue eventfd could not be made.
    #[error("virtio-net on TAP {tap}: cannot create an eventfd: {source}")]
    EventFd {
        /// The TAP.
        tap: String,
        /// Why.
        source: io::Error,
    },
    /// The snapshot state does not fit this device.
    #[error("restoring virtio-net on TAP {tap}: {reason}")]
    Restore {
        /// The TAP.
        tap: String,
        /// What is wrong.
        reason: String,
    },
}

/// Counters, for stats and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct NetMetrics {
    /// Frames written to the TAP.
    pub tx_frames: u64,
    /// Bytes written to the TAP (without vnet headers).
    pub tx_bytes: u64,
    /// Transmit chains refused (completed with length 0).
    pub tx_malformed: u64,
    /// Frames the TAP refused.
    pub tx_errors: u64,
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Bytes delivered to the guest (without vnet headers).
    pub rx_bytes: u64,
    /// Receive chains refused (completed with length 0).
    pub rx_malformed: u64,
    /// Frames read from the TAP and dropped (too large for the guest's buffers, truncated,
    /// too short, or with an offload the guest did not accept).
    pub rx_dropped: u64,
    /// Times the guest ran out of receive buffers (the TAP was paused until it refilled).
    pub rx_stalls: u64,
    /// Errors reading the TAP, or the TAP went away.
    pub tap_errors: u64,
}

/// Snapshot state of a network device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetState {
    /// The guest's MAC address.
    pub mac: [u8; 6],
    /// Features the driver accepted.
    pub acked_features: u64,
    /// Whether the driver had started the device.
    pub activated: bool,
    /// Receive and transmit queues (empty when not activated).
    pub queues: Vec<QueueSnapshot>,
}

struct Active {
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    rx: Queue,
    tx: Queue,
}

/// How the TAP is registered on the event loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TapWatch {
    /// `init` has not run yet.
    Unregistered,
    /// Registered without `EPOLLIN` (device stopped, or waiting for receive buffers).
    Paused,
    /// Registered for `EPOLLIN`.
    Reading,
    /// Removed after the TAP reported an error or hang-up.
    Failed,
}

/// A virtio-net device.
pub struct Net {
    config: NetConfig,
    mac: MacAddr,
    tap: Tap,
    acked: u64,
    queue_evts: [EventFd; 2],
    active: Option<Active>,
    broken: bool,
    rx_buf: Vec<u8>,
    rx_pending: Option<usize>,
    tap_watch: TapWatch,
    metrics: NetMetrics,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("tap", &self.tap.name())
            .field("mac", &self.mac)
            .field("acked", &format_args!("{:#x}", self.acked))
            .field("activated", &self.active.is_some())
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl Net {
    /// Attaches to the configured TAP (in the caller's network namespace).
    pub fn new(config: NetConfig) -> Result<Self, NetError> {
        let mac = config.mac_addr()?;
        let tap = Tap::open(&config.tap)?;
        Self::with_mac(config, mac, tap)
    }

    /// A device on a TAP the caller already has, for tests and fuzzing (see
    /// [`Tap::from_frame_socket`]). `config.tap` should be the TAP's name: it labels messages
    /// and, without `config.mac`, the guest's MAC is derived from it.
    #[doc(hidden)]
    pub fn with_tap(config: NetConfig, tap: Tap) -> Result<Self, NetError> {
        let mac = config.mac_addr()?;
        Self::with_mac(config, mac, tap)
    }

    fn with_mac(config: NetConfig, mac: MacAddr, tap: Tap) -> Result<Self, NetError> {
        let evt = || {
            EventFd::new(libc::EFD_NONBLOCK).map_err(|source| NetError::EventFd {
                tap: config.tap.clone(),
                source,
            })
        };
        Ok(Self {
            queue_evts: [evt()?, evt()?],
            tap,
            mac,
            acked: 0,
            active: None,
            broken: false,
            rx_buf: vec![0; RX_BUF_LEN],
            rx_pending: None,
            tap_watch: TapWatch::Unregistered,
            metrics: NetMetrics::default(),
            config,
        })
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    /// The guest's MAC address.
    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    /// The TAP it is attached to.
    pub fn tap_name(&self) -> &str {
        self.tap.name()
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.acked
    }

    /// Counters.
    pub fn metrics(&self) -> NetMetrics {
        self.metrics
    }

    /// Whether a received frame is waiting for guest buffers.
    pub fn rx_pending(&self) -> bool {
        self.rx_pending.is_some()
    }

    /// The TAP offload flags that match the features the driver accepted.
    fn tap_offload(acked: u64) -> libc::c_uint {
        let mut f = 0;
        if acked & features::GUEST_CSUM != 0 {
            f |= libc::TUN_F_CSUM;
            if acked & features::GUEST_TSO4 != 0 {
                f |= libc::TUN_F_TSO4;
            }
            if acked & features::GUEST_TSO6 != 0 {
                f |= libc::TUN_F_TSO6;
            }
            if acked & features::GUEST_ECN != 0
                && acked & (features::GUEST_TSO4 | features::GUEST_TSO6) != 0
            {
                f |= libc::TUN_F_TSO_ECN;
            }
        }
        f
    }

    fn config_space(&self) -> [u8; 10] {
        let mut c = [0u8; 10];
        c[..6].copy_from_slice(&self.mac.bytes());
        c[6..8].copy_from_slice(&(vn::VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        // max_virtqueue_pairs: only meaningful with VIRTIO_NET_F_MQ, reported as 1.
        c[8..10].copy_from_slice(&1u16.to_le_bytes());
        c
    }

    fn wants_tap_input(&self) -> bool {
        self.active.is_some() && !self.broken && self.rx_pending.is_none()
    }

    fn mark_broken(&mut self, what: &str, e: virtio_queue::Error) {
        crate::warn_limited!(
            "virtio-net on TAP {}: {what} queue is broken ({e}); device needs reset",
            self.tap.name()
        );
        self.broken = true;
        if let Some(a) = &self.active {
            a.interrupt.trigger(interrupt_cause::CONFIG);
        }
    }

    fn process_tx(&mut self) {
        if self.broken {
            return;
        }
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let used_before = active.tx.next_used();
        let mut budget = TX_BUDGET;
        let mut failure = None;
        loop {
            if budget == 0 {
                // Come back after the other event sources had their turn.
                let _ = self.queue_evts[TX_QUEUE].write(1);
                break;
            }
            let next = match active.tx.iter(&active.mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            let Some(chain) = next else {
                match active.tx.enable_notification(&active.mem) {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            };
            budget -= 1;
            let head = chain.head_index();
            match rxtx::gather_tx(&active.mem, chain, self.acked) {
                Ok(frame) => match self.tap.write_frame(&frame.hdr, &frame.body) {
                    Ok(_) => {
                        self.metrics.tx_frames += 1;
                        self.metrics.tx_bytes += frame.len as u64;
                    }
                    Err(e) => {
                        if self.metrics.tx_errors == 0 {
                            tracing::warn!(
                                "virtio-net: TAP {} refused a frame: {e}",
                                self.tap.name()
                            );
                        }
                        self.metrics.tx_errors += 1;
                    }
                },
                Err(e) => {
                    crate::debug_limited!(
                        "virtio-net on TAP {}: transmit chain {head} refused: {e}",
                        self.tap.name()
                    );
                    self.metrics.tx_malformed += 1;
                }
            }
            if let Err(e) = active.tx.add_used(&active.mem, head, 0) {
                failure = Some(e);
                break;
            }
        }
        if active.tx.next_used() != used_before
            && active.tx.needs_notification(&active.mem).unwrap_or(true)
        {
            active.interrupt.trigger(interrupt_cause::VRING);
        }
        if let Some(e) = failure {
            self.mark_broken("transmit", e);
        }
    }

    fn process_rx(&mut self) {
        if self.broken || self.tap_watch == TapWatch::Failed {
            return;
        }
        let Self {
            active,
            tap,
            rx_buf,
            rx_pending,
            metrics,
            acked,
            queue_evts,
            ..
        } = self;
        let Some(active) = active.as_mut() else {
            return;
        };
        let mergeable = *acked & features::MRG_RXBUF != 0;
        let used_before = active.rx.next_used();
        let mut rounds = 0;
        let mut failure = None;
        loop {
            if rounds >= RX_BUDGET {
                // Yield to the rest of the loop. A TAP that is still readable brings us back
                // (level-triggered); a held frame needs a nudge, as no kick may come for it.
                if rx_pending.is_some() {
                    let _ = queue_evts[RX_QUEUE].write(1);
                }
                break;
            }
            rounds += 1;
            let len = match *rx_pending {
                Some(n) => n,
                None => match tap.read_frame(rx_buf) {
                    Ok(n) if n >= rx_buf.len() => {
                        crate::debug_limited!("virtio-net: TAP {}: frame too large", tap.name());
                        metrics.rx_dropped += 1;
                        continue;
                    }
                    Ok(n) if n < VNET_HDR_LEN + ETH_HLEN => {
                        metrics.rx_dropped += 1;
                        continue;
                    }
                    Ok(n) => {
                        if !rxtx::fix_rx_header(&mut rx_buf[..n], *acked) {
                            metrics.rx_dropped += 1;
                            continue;
                        }
                        *rx_pending = Some(n);
                        n
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        if metrics.tap_errors == 0 {
                            tracing::warn!("virtio-net: reading TAP {}: {e}", tap.name());
                        }
                        metrics.tap_errors += 1;
                        continue;
                    }
                },
            };
            match rxtx::deliver_rx(
                &mut active.rx,
                &active.mem,
                &mut rx_buf[..len],
                mergeable,
                &mut metrics.rx_malformed,
            ) {
                Ok(rxtx::Delivery::Delivered) => {
                    *rx_pending = None;
                    metrics.rx_frames += 1;
                    metrics.rx_bytes += (len - VNET_HDR_LEN) as u64;
                }
                Ok(rxtx::Delivery::TooBig) => {
                    crate::debug_limited!(
                        "virtio-net: TAP {}: {len}-byte frame does not fit the guest's buffers",
                        tap.name()
                    );
                    *rx_pending = None;
                    metrics.rx_dropped += 1;
                }
                Ok(rxtx::Delivery::Retry) => continue,
                Ok(rxtx::Delivery::NoBuffers) => {
                    metrics.rx_stalls += 1;
                    break;
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if active.rx.next_used() != used_before
            && active.rx.needs_notification(&active.mem).unwrap_or(true)
        {
            active.interrupt.trigger(interrupt_cause::VRING);
        }
        if let Some(e) = failure {
            self.mark_broken("receive", e);
        }
    }

    /// Keeps the TAP's epoll interest in line with whether frames can be taken now.
    fn update_tap_watch(&mut self, ops: &mut EventOps) {
        let want = self.wants_tap_input();
        let (set, next) = match self.tap_watch {
            TapWatch::Reading if !want => (EventSet::empty(), TapWatch::Paused),
            TapWatch::Paused if want => (EventSet::IN, TapWatch::Reading),
            _ => return,
        };
        match ops.modify(Events::new(&self.tap, set)) {
            Ok(()) => self.tap_watch = next,
            Err(e) => crate::error_limited!(
                "virtio-net: cannot change the epoll interest of TAP {}: {e:?}",
                self.tap.name()
            ),
        }
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        device_type::NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        OFFERED
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked = features & OFFERED;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config_space(), offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        crate::debug_limited!("virtio-net: config write at {offset:#x} ignored");
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        let found = queues.len();
        let Ok::<[Queue; 2], _>([mut rx, mut tx]) = queues.try_into() else {
            return Err(ActivateError::QueueCount { expected: 2, found });
        };
        self.tap
            .set_offload(Self::tap_offload(self.acked))
            .map_err(|e| ActivateError::Backend(e.to_string()))?;
        let event_idx = self.acked & features::RING_EVENT_IDX != 0;
        rx.set_event_idx(event_idx);
        tx.set_event_idx(event_idx);
        self.active = Some(Active {
            mem,
            interrupt,
            rx,
            tx,
        });
        self.broken = false;
        self.rx_pending = None;
        // Let the event loop look at both queues (buffers or frames may already be waiting) and
        // start watching the TAP.
        for evt in &self.queue_evts {
            let _ = evt.write(1);
        }
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.broken = false;
        self.rx_pending = None;
        self.acked = 0;
        // The TAP leaves the epoll interest set at its next event (see `update_tap_watch`).
        if let Err(e) = self.tap.set_offload(0) {
            crate::warn_limited!("virtio-net: {e}");
        }
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }
}

impl MutEventSubscriber for Net {
    fn init(&mut self, ops: &mut EventOps) {
        for evt in &self.queue_evts {
            if let Err(e) = ops.add(Events::new(evt, EventSet::IN)) {
                tracing::error!("virtio-net: cannot watch a queue eventfd: {e:?}");
            }
        }
        let reading = self.wants_tap_input();
        let set = if reading {
            EventSet::IN
        } else {
            EventSet::empty()
        };
        match ops.add(Events::new(&self.tap, set)) {
            Ok(()) => {
                self.tap_watch = if reading {
                    TapWatch::Reading
                } else {
                    TapWatch::Paused
                }
            }
            Err(e) => {
                tracing::error!("virtio-net: cannot watch TAP {}: {e:?}", self.tap.name());
                self.tap_watch = TapWatch::Failed;
            }
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        let set = events.event_set();
        if fd == self.queue_evts[RX_QUEUE].as_raw_fd() {
            let _ = self.queue_evts[RX_QUEUE].read();
            self.process_rx();
        } else if fd == self.queue_evts[TX_QUEUE].as_raw_fd() {
            let _ = self.queue_evts[TX_QUEUE].read();
            self.process_tx();
        } else if fd == self.tap.as_raw_fd() {
            if set.intersects(EventSet::ERROR | EventSet::HANG_UP) {
                tracing::error!(
                    "virtio-net: TAP {} failed (deleted?); the guest will receive nothing more",
                    self.tap.name()
                );
                self.metrics.tap_errors += 1;
                if let Err(e) = ops.remove(Events::empty(&self.tap)) {
                    tracing::error!("virtio-net: cannot stop watching TAP: {e:?}");
                }
                self.tap_watch = TapWatch::Failed;
                return;
            }
            if set.contains(EventSet::IN) && self.tap_watch == TapWatch::Reading {
                self.process_rx();
            }
        } else {
            tracing::warn!("virtio-net: event for unknown fd {fd}");
        }
        self.update_tap_watch(ops);
    }
}

impl ember_snapshot::Persist for Net {
    type State = NetState;
    type ConstructorArgs = (NetConfig, Option<(GuestMemoryMmap, Arc<Interrupt>)>);
    type Error = NetError;

    fn save(&self) -> NetState {
        NetState {
            mac: self.mac.bytes(),
            acked_features: self.acked,
            activated: self.active.is_some(),
            queues: self
                .active
                .as_ref()
                .map(|a| vec![QueueSnapshot::from(&a.rx), QueueSnapshot::from(&a.tx)])
                .unwrap_or_default(),
        }
    }

    fn restore(
        (config, resources): Self::ConstructorArgs,
        state: &NetState,
    ) -> Result<Self, NetError> {
        let tap = config.tap.clone();
        let bad = |reason: String| NetError::Restore {
            tap: tap.clone(),
            reason,
        };
        let mac = MacAddr::from_bytes(state.mac).map_err(|e| bad(format!("saved MAC: {e}")))?;
        if config.mac.is_some() {
            let wanted = config.mac_addr()?;
            if wanted != mac {
                return Err(bad(format!(
                    "the guest already uses MAC {mac}; it cannot change to {wanted} on restore"
                )));
            }
        }
        if state.acked_features & !OFFERED != 0 {
            return Err(bad(format!(
                "saved features {:#x} include ones this device does not offer",
                state.acked_features
            )));
        }
        if !state.activated && !state.queues.is_empty() {
            return Err(bad("queues saved for a device that was not started".into()));
        }
        let tap = Tap::open(&config.tap)?;
        let mut net = Self::with_mac(config, mac, tap)?;
        net.acked = state.acked_features;
        if state.activated {
            let Some((mem, interrupt)) = resources else {
                return Err(bad(
                    "the device was started but no guest memory was given".into()
                ));
            };
            if state.queues.len() != 2 {
                return Err(bad(format!(
                    "{} queues saved, expected 2",
                    state.queues.len()
                )));
            }
            let mut queues = Vec::with_capacity(2);
            for (i, qs) in state.queues.iter().enumerate() {
                if qs.max_size != QUEUE_SIZE || !qs.ready {
                    return Err(bad(format!("queue {i}: not ready or wrong maximum size")));
                }
                queues.push(
                    qs.to_queue(Some(&mem))
                        .map_err(|e| bad(format!("queue {i}: {e}")))?,
                );
            }
            net.activate(mem, interrupt, queues)
                .map_err(|e| bad(e.to_string()))?;
        }
        Ok(net)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_features_are_consistent() {
        // Every offload offered has the feature it depends on (virtio 1.2 §5.1.3.1).
        let f = OFFERED;
        assert_ne!(f & VIRTIO_F_VERSION_1, 0);
        for (dep, on) in [
            (features::GUEST_TSO4, features::GUEST_CSUM),
            (features::GUEST_TSO6, features::GUEST_CSUM),
            (features::GUEST_ECN, features::GUEST_TSO4),
            (features::HOST_TSO4, features::CSUM),
            (features::HOST_TSO6, features::CSUM),
            (features::HOST_ECN, features::HOST_TSO4),
        ] {
            assert!(f & dep == 0 || f & on != 0);
        }
        // Nothing whose support is missing.
        for bit in [
            vn::VIRTIO_NET_F_GUEST_UFO,
            vn::VIRTIO_NET_F_HOST_UFO,
            vn::VIRTIO_NET_F_CTRL_VQ,
            vn::VIRTIO_NET_F_MQ,
        ] {
            assert_eq!(f & (1 << bit), 0, "bit {bit}");
        }
    }

    #[test]
    fn tap_offload_follows_guest_features() {
        assert_eq!(Net::tap_offload(0), 0);
        // TSO without checksum offload is not a valid combination: nothing is enabled.
        assert_eq!(Net::tap_offload(features::GUEST_TSO4), 0);
        assert_eq!(Net::tap_offload(features::GUEST_CSUM), libc::TUN_F_CSUM);
        assert_eq!(
            Net::tap_offload(OFFERED),
            libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_TSO_ECN
        );
        assert_eq!(
            Net::tap_offload(features::GUEST_CSUM | features::GUEST_ECN),
            libc::TUN_F_CSUM
        );
        // Host-side (guest → host) offloads never touch the TAP's receive offloads.
        assert_eq!(Net::tap_offload(features::CSUM | features::HOST_TSO4), 0);
    }

    #[test]
    fn config_mac_is_parsed_or_derived() {
        let cfg = |mac: Option<&str>| NetConfig {
            tap: "tap7".into(),
            mac: mac.map(String::from),
        };
        assert_eq!(
            cfg(Some("02:00:00:00:00:07"))
                .mac_addr()
                .unwrap()
                .to_string(),
            "02:00:00:00:00:07"
        );
        assert_eq!(cfg(None).mac_addr().unwrap(), MacAddr::derive("tap7"));
        let e = cfg(Some("01:00:00:00:00:07")).mac_addr().unwrap_err();
        assert!(matches!(e, NetError::Mac { .. }));
        assert!(
            e.to_string().contains("tap7") && e.to_string().contains("multicast"),
            "{e}"
        );
    }

    /// The device on a socket pair instead of a TAP (no root needed): the test plays the guest
    /// driver on mock rings and "the network" on the peer socket.
    #[test]
    fn frames_pass_both_ways_through_a_frame_socket() {
        use std::os::unix::net::UnixDatagram;
        use std::sync::Mutex;

        use event_manager::{EventManager, SubscriberOps};
        use virtio_queue::desc::{split::Descriptor, RawDescriptor};
        use virtio_queue::mock::MockSplitQueue;
        use vm_memory::{Address, Bytes, GuestAddress};

        const F_WRITE: u16 = 2;
        const F_NEXT: u16 = 1;
        let desc =
            |addr, len, flags, next| RawDescriptor::from(Descriptor::new(addr, len, flags, next));

        let (ours, peer) = UnixDatagram::pair().unwrap();
        peer.set_nonblocking(true).unwrap();
        let cfg = NetConfig {
            tap: "fake0".into(),
            mac: None,
        };
        let mut net = Net::with_tap(cfg, Tap::from_frame_socket(ours, "fake0").unwrap()).unwrap();
        assert_eq!(net.mac(), MacAddr::derive("fake0"));
        assert_eq!(net.tap_name(), "fake0");

        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let rxm = MockSplitQueue::create(&mem, GuestAddress(0), 16);
        let txm = MockSplitQueue::create(&mem, GuestAddress(0x4000), 16);
        // Receive: two 2 KiB buffers. Transmit: the header in its own descriptor, like Linux.
        rxm.add_desc_chains(
            &[
                desc(0x2_0000, 2048, F_WRITE, 0),
                desc(0x2_1000, 2048, F_WRITE, 0),
            ],
            0,
        )
        .unwrap();
        // NEEDS_CSUM, csum_start 34, csum_offset 16, and a num_buffers the device must clear.
        let tx_hdr = [1u8, 0, 0, 0, 0, 0, 34, 0, 16, 0, 7, 0];
        let tx_body: Vec<u8> = (0..60u8).collect();
        mem.write_slice(&tx_hdr, GuestAddress(0x3_0000)).unwrap();
        mem.write_slice(&tx_body, GuestAddress(0x3_1000)).unwrap();
        txm.add_desc_chains(
            &[
                desc(0x3_0000, 12, F_NEXT, 1),
                desc(0x3_1000, tx_body.len() as u32, 0, 0),
            ],
            0,
        )
        .unwrap();
        net.set_acked_features(VIRTIO_F_VERSION_1 | features::CSUM | features::GUEST_CSUM);
        let irq = Arc::new(Interrupt::new(crate::legacy::EventTrigger::new().unwrap()));
        let queues = vec![rxm.create_queue().unwrap(), txm.create_queue().unwrap()];
        net.activate(mem.clone(), irq.clone(), queues).unwrap();

        // From the network: a TSO frame the guest did not accept (dropped), then a frame with
        // DATA_VALID (kept: GUEST_CSUM was accepted).
        let mut gso = vec![0u8; VNET_HDR_LEN + 100];
        gso[..2].copy_from_slice(&[1, 1]);
        peer.send(&gso).unwrap();
        let mut frame = vec![0u8; VNET_HDR_LEN];
        frame[0] = 2;
        frame.extend((0..80u8).map(|b| b ^ 0x5a));
        peer.send(&frame).unwrap();

        let net = Arc::new(Mutex::new(net));
        let mut em = EventManager::<Arc<Mutex<Net>>>::new().unwrap();
        em.add_subscriber(net.clone());
        for _ in 0..20 {
            let m = net.lock().unwrap().metrics();
            if m.tx_frames == 1 && m.rx_frames == 1 && m.rx_dropped == 1 {
                break;
            }
            em.run_with_timeout(10).unwrap();
        }
        let m = net.lock().unwrap().metrics();
        assert_eq!(
            (m.tx_frames, m.tx_malformed, m.rx_frames, m.rx_dropped),
            (1, 0, 1, 1),
            "{m:?}"
        );

        // The network got the guest's frame, its header sanitised.
        let mut buf = [0u8; 256];
        let n = peer.recv(&mut buf).unwrap();
        assert_eq!(n, VNET_HDR_LEN + tx_body.len());
        assert_eq!(buf[..10], tx_hdr[..10]);
        assert_eq!(buf[10..12], [0, 0]);
        assert_eq!(buf[12..n], tx_body[..]);
        assert_eq!(
            peer.recv(&mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock,
            "one frame only"
        );

        // The guest got the network's frame in its first buffer, with num_buffers 1.
        let used = txm.used_addr();
        assert_eq!(mem.read_obj::<u16>(used.unchecked_add(2)).unwrap(), 1);
        let used = rxm.used_addr();
        assert_eq!(mem.read_obj::<u16>(used.unchecked_add(2)).unwrap(), 1);
        assert_eq!(mem.read_obj::<u32>(used.unchecked_add(4)).unwrap(), 0);
        assert_eq!(
            mem.read_obj::<u32>(used.unchecked_add(8)).unwrap() as usize,
            frame.len()
        );
        let mut got = vec![0u8; frame.len()];
        mem.read_slice(&mut got, GuestAddress(0x2_0000)).unwrap();
        assert_eq!(got[..10], frame[..10]);
        assert_eq!(got[10..12], [1, 0]);
        assert_eq!(got[12..], frame[12..]);
        assert_ne!(irq.status() & interrupt_cause::VRING, 0);
    }
}
